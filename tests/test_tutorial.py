"""Every chapter of docs/tutorial/ runs as a reader would run it, and draws what it shows.

Each chapter's ```python blocks are run in order in one namespace (a reader pasting them into
one session), in a scratch folder, so the pictures they write land in its `pictures/`. The
chapters that take more than a couple of seconds (they train a model) are in the slow tier.
`python tests/test_tutorial.py [01 02 ...]` runs them (all, or the chapters named) and copies
the pictures they show into docs/tutorial/pictures/: the committed ones come from the same code.
"""

import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = REPO / "docs" / "tutorial"
CHAPTERS = sorted(TUTORIAL.glob("[0-9][0-9]-*.md"))
# Under a second each on 2 quiet cores; the others train a model for a few seconds or more.
FAST = {
    "01-attention",
    "03-positions",
    "04-ffn-and-norms",
    "05-three-families",
    "06-masks",
    "08-generation",
    "09-flashattention",
    "10-quantization",
    "11-fine-tuning",
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def shown_pictures(text: str) -> set[str]:
    """The PNGs a page shows from its pictures/ folder."""
    return set(re.findall(r"\]\(pictures/([\w.-]+\.png)\)", text))


def run_chapter(chapter: Path) -> dict:
    """Run the chapter's blocks in order, in one namespace, in the current folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace = {"__name__": "tutorial"}
    try:
        for i, code in enumerate(python_blocks(chapter.read_text()), start=1):
            exec(compile(code, f"{chapter.name}, block {i}", "exec"), namespace)
    finally:
        plt.close("all")
    return namespace


def test_the_tutorial_has_its_chapters_in_order():
    names = [p.stem for p in CHAPTERS]
    assert len(names) == 12, names
    assert [int(n[:2]) for n in names] == list(range(1, 13))
    contents = (TUTORIAL / "README.md").read_text()
    assert [f"{n}.md" for n in names] == re.findall(r"\]\((\d\d-[\w-]+\.md)\)", contents)
    assert "docs/tutorial/README.md" in (REPO / "README.md").read_text()


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_each_chapter_cites_its_paper_and_names_its_attnlab_files(chapter):
    text = chapter.read_text()
    head = text.split("\n\n")[1]  # the italic line under the title
    assert "Paper" in head and re.search(r"arXiv:\d{4}\.\d{4,5}", head), chapter.name
    files = re.findall(r"`(attnlab/[\w/.]+)`", head)
    assert files, f"{chapter.name} names no attnlab file"
    for name in files:
        assert (REPO / name).exists(), f"{chapter.name} names {name}, which does not exist"
    assert python_blocks(text), f"{chapter.name} has no Python block"


@pytest.mark.parametrize("page", [*CHAPTERS, TUTORIAL / "README.md"], ids=lambda p: p.stem)
def test_the_tutorial_links_resolve(page):
    for target in re.findall(r"\]\(([^)#]+\.(?:md|png))\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name} links {target}, which is missing"


def test_the_committed_pictures_are_shown_and_named_by_their_chapter():
    shown = {name: p for p in CHAPTERS for name in shown_pictures(p.read_text())}
    for png in (TUTORIAL / "pictures").glob("*.png"):
        assert png.name in shown, f"{png.name} is committed but no chapter shows it"
        assert png.name[:2] == shown[png.name].name[:2], png.name
        assert png.stat().st_size < 80_000, f"{png.name} is large for a page's picture"


CHAPTER_PARAMS = [
    pytest.param(p, id=p.stem, marks=[] if p.stem in FAST else [pytest.mark.slow]) for p in CHAPTERS
]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize("chapter", CHAPTER_PARAMS)
def test_the_chapter_runs_and_draws_what_it_shows(chapter, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path / "no_downloads"))
    run_chapter(chapter)
    drawn = {p.name for p in (tmp_path / "pictures").glob("*.png")}
    shown = shown_pictures(chapter.read_text())
    assert shown <= drawn, f"{chapter.name} shows {sorted(shown - drawn)} but does not draw them"


if __name__ == "__main__":  # redraw the committed pictures with the chapters' own code
    import shutil
    import tempfile

    sys.path.insert(0, str(REPO))
    chosen = [p for p in CHAPTERS if not sys.argv[1:] or p.stem[:2] in sys.argv[1:]]
    for chapter in chosen:
        with tempfile.TemporaryDirectory() as scratch:
            os.chdir(scratch)
            print(chapter.name, flush=True)
            run_chapter(chapter)
            for name in shown_pictures(chapter.read_text()):
                shutil.copy(Path(scratch) / "pictures" / name, TUTORIAL / "pictures" / name)
