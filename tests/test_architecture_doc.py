"""docs/architecture.md's layer diagram draws the layer table of tests/test_layers.py.

The diagram is the first fenced block of the page: one line per layer, the top layer first,
each line's layer names on the left (written as in LAYERS without "attnlab.", the package
itself as "attnlab"; names apart by at most 4 spaces; ".hub" after "interop.hf" short for
"interop.hub") and a description after a wider gap; lines of box-drawing rules separate
groups. Every LAYERS entry must appear exactly once, entries of one layer on one line, and a
higher layer on a higher line.
"""

import re
from pathlib import Path

from tests.test_layers import LAYERS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def diagram_rows(text: str) -> list[list[str]]:
    """The layer names of each line of the page's first fenced block, top line first."""
    block = re.search(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    assert block, f"{PAGE.name} has no diagram block"
    rows = []
    for line in block.group(1).splitlines():
        if not line.strip() or set(line.strip()) <= set("─-=━"):
            continue  # a blank line or a rule between groups
        names, row = re.split(r"\s{5,}", line.strip())[0].split(), []  # before the description
        for name in names:
            if name.startswith(".") and row:  # ".hub" beside "interop.hf": a sibling module
                name = row[-1].rpartition(".")[0] + name
            row.append(name)
        rows.append(row)
    return rows


def short(entry: str) -> str:
    return "attnlab" if entry == "attnlab" else entry.removeprefix("attnlab.")


def diagram_problems(rows: list[list[str]], layers: dict[str, float]) -> list[str]:
    """What is wrong with a diagram of `rows` (top line first) for the layer table `layers`."""
    line_of: dict[str, int] = {}
    problems = []
    for i, names in enumerate(rows):
        for name in names:
            if name in line_of:
                problems.append(f"{name} is drawn twice")
            line_of[name] = i
    wanted = {short(e) for e in layers}
    problems += [f"the diagram lacks {n}" for n in sorted(wanted - set(line_of))]
    problems += [f"{n} is not in LAYERS" for n in sorted(set(line_of) - wanted)]
    for a in layers:
        for b in layers:
            if short(a) not in line_of or short(b) not in line_of:
                continue
            la, lb = line_of[short(a)], line_of[short(b)]  # 0 is the top line
            if layers[a] < layers[b] and la <= lb:
                problems.append(f"{a} (layer {layers[a]}) is not drawn below {b} ({layers[b]})")
            elif layers[a] == layers[b] and a < b and la != lb:
                problems.append(f"{a} and {b} share layer {layers[a]} but not a line")
    return problems


def test_the_diagram_draws_every_layer_once_at_its_height():
    assert diagram_problems(diagram_rows(PAGE.read_text()), LAYERS) == []


def test_the_check_reads_names_and_skips_descriptions_and_rules():
    text = (
        "```\n"
        "  cli                attnlab train | eval\n"
        "  ────────────────────────────\n"
        "  training   viz     what you do with a model\n"
        "  interop.hf   .hub        HF formats; Hub downloads\n"
        "```\n"
    )
    assert diagram_rows(text) == [["cli"], ["training", "viz"], ["interop.hf", "interop.hub"]]


def test_the_check_finds_a_layer_missing_misplaced_or_split():
    layers = {"attnlab.models": 1, "attnlab.training": 2, "attnlab.viz": 2, "attnlab.cli": 3}
    assert diagram_problems([["cli"], ["training", "viz"], ["models"]], layers) == []
    assert diagram_problems([["cli"], ["training", "viz"]], layers) == ["the diagram lacks models"]
    assert diagram_problems([["cli"], ["models"], ["training", "viz"]], layers) == [
        "attnlab.models (layer 1) is not drawn below attnlab.training (2)",
        "attnlab.models (layer 1) is not drawn below attnlab.viz (2)",
    ]
    assert diagram_problems([["cli"], ["training"], ["viz"], ["models"]], layers) == [
        "attnlab.training and attnlab.viz share layer 2 but not a line"
    ]
