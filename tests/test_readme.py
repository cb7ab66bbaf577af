"""Every `attnlab ...` command line in the bash blocks of README.md and of the docs pages it links
(PAGES) runs, as a user would type it.

The commands are read from whatever those pages hold now (so the test follows them), and run in
order in one scratch folder, README first, the way a reader goes down the pages: `train` writes
runs/default, which `eval`, `generate` and `viz` then open. To keep them fast, OVERRIDES below
appends a few flags per command (tiny sizes, the text fixture instead of a download) and
`setup_for` prepares what a line takes as already there (a local stand-in for a download, a run
that a later line makes); nothing else is changed. A command whose words and flags were already
run is not run twice.
"""

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from attnlab.cli.__main__ import main
from attnlab.training import datasets
from tests.data import SHAKESPEARE

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The pages whose commands and Python blocks run here, in reading order (docs/tutorial/ has its
# own test, tests/test_tutorial.py).
DOCS = ("finetuning", "serving", "experiments", "interop", "performance")
PAGES = [README, *(REPO / "docs" / f"{name}.md" for name in DOCS)]

TINY_TRAIN = [
    "--train.steps=2",
    "--train.batch_size=2",
    "--train.context=16",
    "--train.eval_every=2",
    "--train.eval_batches=1",
    "--train.sample_tokens=8",
    "--train.progress=false",
    "--model.n_layers=1",
    "--model.d_model=32",
    "--data.max_chars=20000",
]

# (command words, a regex the line must match or ""): flags appended to that line.
OVERRIDES = [
    (("train",), r"--config recipes/(shakespeare|bert)", ["--data.source=fixture.txt"]),
    (("train",), "", TINY_TRAIN),
    # README's --resume line continues a run of its own preset: in runs/default, which the first
    # line trained with llama-char, it would stop on the changed model config.
    (("train",), r"--resume", ["--train.out_dir=runs/resumed"]),
    (("eval",), "", ["--batches", "1"]),
    (("generate",), "", ["--max-new-tokens", "8"]),
    (("analyze", "rank"), "", ["--n", "8", "16", "--d-k", "2", "4", "--heads", "1", "2"]),
    (("lab", "heads"), "", ["--fast"]),
    (
        ("lab", "extrapolate"),
        "",
        ["--fast", "--steps=2", "--finetune-steps=1", "--data.source=fixture.txt"],
    ),
]

_PUNCT = {";", "&&", "||", "|", "&"}


def readme_commands(text: str) -> list[list[str]]:
    """argv (after `attnlab`) of every attnlab command in the bash blocks of `text`."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            words, segment = list(lexer), []
            for word in [*words, ";"]:
                if word in _PUNCT:
                    if segment and Path(segment[0]).name == "attnlab":
                        commands.append(segment[1:])
                    segment = []
                else:
                    segment.append(word)
    unique = []
    for argv in commands:
        if argv not in unique:
            unique.append(argv)
    return unique


COMMANDS = readme_commands("\n".join(page.read_text() for page in PAGES))


def overridden(argv: list[str]) -> list[str]:
    line = " ".join(argv)
    extra = []
    for words, pattern, flags in OVERRIDES:
        if tuple(argv[: len(words)]) == words and (not pattern or re.search(pattern, line)):
            extra += flags
    return argv + extra


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A scratch folder holding the recipes (as a clone does) and the text fixture."""
    ws = tmp_path_factory.mktemp("readme")
    (ws / "recipes").symlink_to(REPO / "recipes")
    text = SHAKESPEARE.read_text()[:20_000]
    (ws / "fixture.txt").write_text(text)
    return ws


def written_by(argv: list[str]) -> set[str]:
    """The runs a line writes: its --train.out_dir or --out, or what `convert` writes (its last
    word: `convert --from attnlab runs/default --to hf runs/default-hf`)."""
    pairs = zip(argv, argv[1:])
    written = {value for flag, value in pairs if flag in ("--train.out_dir", "--out")}
    return written | ({argv[-1]} if argv[0] == "convert" else set())


def _maker(run: str) -> list[str]:
    """The README line that writes `run`: the one naming it as its output, else the first
    line, `attnlab train`, which writes runs/default."""
    for argv in COMMANDS:
        if run in written_by(argv):
            return argv
    assert run == "runs/default", run
    return ["train"]


def runs_read(argv: list[str]) -> list[str]:
    """The runs a line reads: every word that names a run some line writes (--ckpt, --model,
    a reward model's directory, ...), but for the ones the line writes itself."""
    made = {"runs/default"}.union(*map(written_by, COMMANDS))
    return [word for word in argv if word in made and word not in written_by(argv)]


# Lines that setup_for already ran to make a run another line reads: their own test passes.
MADE: set[tuple[str, ...]] = set()


def setup_for(argv: list[str], ws: Path, monkeypatch) -> None:
    """Whatever a README line takes as already there (beyond what earlier lines made)."""
    if argv[:2] == ["data", "get"]:
        # No download in tests: the dataset's URL and hash become the text fixture's, so the
        # command runs its whole path (fetch, check, rename into the cache) on a local file.
        fixture = ws / "fixture.txt"
        local = replace(
            datasets.DATASETS[argv[2]], url=fixture.as_uri(), sha256=datasets.sha256_of(fixture)
        )
        monkeypatch.setitem(datasets.DATASETS, argv[2], local)
    for run in runs_read(argv):
        if not (ws / run).exists():
            # A run that a line of the other tier makes (`-m slow` alone skips `attnlab
            # train`), or that another pytest-xdist worker ran (each has its own folder).
            maker = _maker(run)
            setup_for(maker, ws, monkeypatch)
            assert main(overridden(maker)) == 0
            MADE.add(tuple(maker))
    if argv[0] == "train" and "--resume" in argv:
        # --resume continues a run: the first time, there is none to continue, so start it.
        plain = [a for a in overridden(argv) if a != "--resume"]
        if not (ws / "runs" / "resumed" / "checkpoints").is_dir():
            assert main(plain) == 0


def test_the_readme_shows_commands():
    assert COMMANDS, "no `attnlab ...` line found in README.md's bash blocks"
    assert ["train"] in COMMANDS


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: p.name)
def test_each_docs_page_is_linked_from_the_readme(page):
    assert f"]({page.relative_to(REPO).as_posix()})" in README.read_text(), page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_pages_links_resolve(page):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name} links {target}, which is missing"


# The fine-tuning block's lines (and what reads their runs) and the experiments take seconds
# each: the full suite runs them, the fast tier does not.
SLOW_RUNS = {"runs/chat", "runs/sft", "runs/dpo", "runs/bert", "runs/classify", "runs/tag"}


def _is_slow(argv: list[str]) -> bool:
    return argv[0] in ("finetune", "lab") or bool(SLOW_RUNS & set(argv))


README_PARAMS = [
    pytest.param(a, id=" ".join(a)[:60], marks=[pytest.mark.slow] if _is_slow(a) else [])
    for a in COMMANDS
]


@pytest.mark.parametrize("argv", README_PARAMS)
def test_readme_command_runs(argv, workspace, monkeypatch, capsys):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("ATTNLAB_DATA", str(workspace / "no_downloads"))
    if tuple(argv) in MADE:
        return  # run (and checked) already, to make a run that an earlier line reads
    setup_for(argv, workspace, monkeypatch)
    try:
        code = main(overridden(argv))
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 0, f"`attnlab {shlex.join(argv)}` failed:\n{err}"


def test_the_readme_commands_are_found_in_every_form():
    text = (
        "```bash\n"
        "python3 -m venv .venv && .venv/bin/attnlab train  # comment\n"
        'attnlab generate --prompt "def f(x):" --stream; echo done\n'
        "```\n"
        "```python\nattnlab train --not-bash\n```\n"
    )
    assert readme_commands(text) == [["train"], ["generate", "--prompt", "def f(x):", "--stream"]]


def test_attnlab_in_a_shell_is_the_main_run_here():
    """The commands run through main() here; `attnlab` in a shell is the same function."""
    assert 'attnlab = "attnlab.cli.__main__:main"' in (REPO / "pyproject.toml").read_text()


SERVED_AT = "http://127.0.0.1:8000"  # the README's server address; the test serves on a free port


def test_the_readme_python_example_runs(workspace, monkeypatch, capsys):
    """The Python blocks of README.md and its docs pages, as written, after the main job (tiny)
    made runs/default."""
    monkeypatch.chdir(workspace)
    if not (workspace / "runs" / "default").is_dir():
        assert main(overridden(["train"])) == 0
    assert re.search(r"```python\n", README.read_text()), "README.md shows no Python example"
    blocks = [
        (page, code)
        for page in PAGES
        for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    ]
    for page, code in blocks:
        if SERVED_AT in code:  # a client of `attnlab serve --ckpt runs/default --api-key s3cret`
            pytest.importorskip("openai")
            from tests.serve.server_helpers import Server

            server = Server(workspace / "runs" / "default", api_key="s3cret", model_name="default")
            try:
                served = code.replace(SERVED_AT, server.url)
                exec(compile(served, str(page), "exec"), {"__name__": "readme"})
            finally:
                server.close()
            continue
        exec(compile(code, str(page), "exec"), {"__name__": "readme"})
    assert "torch.Size([2, 16, 256])" in capsys.readouterr().out
