"""Every test that compiles, launches torchrun or drives a browser is marked `slow`.

The fast tier (`pytest -m "not slow"`) relies on it. The check reads the test files' syntax trees:
a test is heavy when it (or a function or fixture of its own module that it uses) calls
`torch.compile`, `traced_graphs`, `torchrun` or Playwright, or when it is decorated with
`needs_compiler`; it must then carry `@pytest.mark.slow` (or its module a `pytestmark` with it).
"""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
HEAVY_CALLS = {"torch.compile", "traced_graphs", "torchrun", "sync_playwright"}
HEAVY_DECORATORS = {"needs_compiler"}


def _name(node: ast.AST) -> str:
    """Dotted name of a Name/Attribute/Call node ("torch.compile", "pytest.mark.slow")."""
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _calls(fn: ast.AST) -> set[str]:
    """The names `fn` calls, each also as its last part ("sync_api.sync_playwright" -> both)."""
    names = {_name(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    return names | {n.rsplit(".", 1)[-1] for n in names}


def _module_is_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(_name(t) == "pytestmark" for t in node.targets):
            return "pytest.mark.slow" in {_name(n) for n in ast.walk(node.value)}
    return False


def unmarked_heavy_tests(path: Path) -> list[str]:
    """Names of the heavy tests in `path` that are not marked slow."""
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    heavy: set[str] = set()
    changed = True
    while changed:  # a module function is heavy if it calls something heavy (to a fixed point)
        changed = False
        for name, fn in functions.items():
            uses = _calls(fn) | {a.arg for a in fn.args.args}  # calls, and fixtures by name
            if name not in heavy and uses & (HEAVY_CALLS | heavy):
                heavy.add(name)
                changed = True
    if _module_is_slow(tree):
        return []
    out = []
    for name, fn in functions.items():
        if not name.startswith("test_"):
            continue
        decorators = {_name(d) for d in fn.decorator_list}
        if (
            name in heavy or decorators & HEAVY_DECORATORS
        ) and "pytest.mark.slow" not in decorators:
            out.append(name)
    return out


@pytest.mark.parametrize(
    "path", sorted(TESTS.rglob("test_*.py")), ids=lambda p: str(p.relative_to(TESTS))
)
def test_compile_torchrun_and_browser_tests_are_marked_slow(path):
    assert unmarked_heavy_tests(path) == []


def test_the_check_finds_an_unmarked_compile_test(tmp_path):
    src = tmp_path / "test_example.py"
    src.write_text(
        "import pytest, torch\n"
        "def helper(x):\n    return torch.compile(x)\n"
        "def test_direct():\n    torch.compile(abs)\n"
        "def test_through_a_helper():\n    helper(abs)\n"
        "@pytest.mark.slow\ndef test_marked():\n    torch.compile(abs)\n"
        "def test_plain():\n    pass\n"
        "@pytest.fixture\ndef page():\n    with sync_api.sync_playwright() as pw:\n"
        "        yield pw\n"
        "def test_in_a_browser(page):\n    pass\n"
    )
    expected = ["test_direct", "test_through_a_helper", "test_in_a_browser"]
    assert unmarked_heavy_tests(src) == expected
