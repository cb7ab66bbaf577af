"""Shared by the tests that use torch.compile: a skip mark for machines that cannot compile, and
the FX graphs dynamo traces (what the compiler is given, before inductor lowers it)."""

import shutil

import pytest
import torch

needs_compiler = pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported()
    or not any(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang")),
    reason="torch.compile needs dynamo and a C compiler",
)


def traced_graphs(fn, *args, **kwargs) -> tuple[object, list[str]]:
    """Run torch.compile(fn)(*args, **kwargs) through a backend that records each graph and runs
    it as it is (no C compiler needed). Returns (the output, the graphs as text)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=record)(*args, **kwargs), graphs


def count_unguarded_compiles(monkeypatch) -> list[int]:
    """Count the graphs compiled without guards from now on: each call of
    torch.compiler.skip_all_guards_unsafe (Dynamo calls the filter once per graph it builds)
    appends the number of guards it dropped."""
    calls = []
    skip = torch.compiler.skip_all_guards_unsafe

    def counted(entries):
        calls.append(len(entries))
        return skip(entries)

    monkeypatch.setattr(torch.compiler, "skip_all_guards_unsafe", counted)
    return calls
