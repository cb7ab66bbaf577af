"""`attnlab serve`: one clear line for a checkpoint it cannot serve or a port in use."""

import socket

import torch

from attnlab.checkpoint import save_pretrained
from attnlab.cli.__main__ import main
from attnlab.models.build import build_model
from attnlab.models.presets import bert_tiny
from attnlab.tokenizer import train_char_tokenizer
from tests.serve.server_helpers import write_checkpoint


def test_a_port_in_use_is_one_line(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "tiny")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(["serve", "--ckpt", str(ckpt), "--port", str(port), "--engine", "sequential"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"attnlab serve: error: port {port} on 127.0.0.1 is in use: choose another with --port"
    )


def test_an_encoder_checkpoint_is_one_line(tmp_path, capsys):
    torch.manual_seed(0)
    save_pretrained(
        tmp_path / "bert", build_model(bert_tiny()), bert_tiny(), train_char_tokenizer(["ab"])
    )
    assert main(["serve", "--ckpt", str(tmp_path / "bert"), "--engine", "sequential"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is an encoder with a masked-LM head" in err[0]
    assert "attnlab serve needs a decoder-only LM" in err[0]


def test_a_checkpoint_without_a_tokenizer_is_one_line(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "tiny")
    (ckpt / "tokenizer.json").unlink()
    assert main(["serve", "--ckpt", str(ckpt), "--engine", "sequential"]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def test_compile_attention_with_the_sequential_engine_is_one_line(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "tiny")
    args = ["serve", "--ckpt", str(ckpt), "--engine", "sequential", "--compile-attention"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compile-attention is for the batched engine" in err[0]


def test_a_kernel_that_does_not_compile_is_one_line(tmp_path, capsys, monkeypatch):
    """Where torch.compile fails (no C compiler), --compile-attention says so and what to do."""
    import attnlab.accel.paged_attention as paged_attention

    def broken(*args):
        raise OSError("no C compiler\nmore detail")

    monkeypatch.setattr(paged_attention, "compiled_decode_attention", lambda: broken)
    ckpt = write_checkpoint(tmp_path / "tiny")
    assert main(["serve", "--ckpt", str(ckpt), "--compile-attention", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "attnlab serve: error: the paged decode attention did not compile (OSError: no C "
        "compiler): serve without --compile-attention"
    ]


def test_a_decode_step_that_does_not_compile_is_one_line(tmp_path, capsys, monkeypatch):
    """--compile says that it compiles, then, where torch.compile fails, what to do; with the
    sequential engine it is refused."""
    import attnlab.accel.paged_step as paged_step

    def broken(*args, **kwargs):
        raise OSError("no C compiler\nmore detail")

    monkeypatch.setattr(paged_step.torch, "compile", lambda fn, **kw: broken)
    ckpt = write_checkpoint(tmp_path / "tiny")
    assert main(["serve", "--ckpt", str(ckpt), "--compile", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("attnlab serve: compiling the decode step")
    assert err[1:] == [
        "attnlab serve: error: the decode step did not compile (OSError: no C compiler): "
        "serve without --compile"
    ]
    args = ["serve", "--ckpt", str(ckpt), "--compile", "--engine", "sequential", "--port", "0"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == (
        "attnlab serve: error: --compile is for the batched engine (--engine batched)"
    )


def test_kv_cache_memory_takes_sizes_and_shares(tmp_path, capsys):
    """--kv-cache-memory: bytes with a unit or a share of the available memory; anything else
    is one line from argparse, naming the value and the forms it takes."""
    from attnlab.cli.serve import kv_memory_bytes, memory_size

    cpu = torch.device("cpu")
    assert kv_memory_bytes(memory_size("512MiB"), cpu) == 512 << 20
    assert kv_memory_bytes(memory_size("2G"), cpu) == 2 << 30
    assert kv_memory_bytes(memory_size("1.5GB"), cpu) == 1_500_000_000
    assert kv_memory_bytes(memory_size("4096"), cpu) == 4096
    assert 0 < kv_memory_bytes(memory_size("25%"), cpu) < kv_memory_bytes("50%", cpu)
    assert kv_memory_bytes(None, cpu) is None
    ckpt = write_checkpoint(tmp_path / "tiny")
    for bad in ("lots", "0.2", "150%", "3 parsecs"):
        try:
            main(["serve", "--ckpt", str(ckpt), "--kv-cache-memory", bad])
        except SystemExit as err:
            assert err.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"{bad!r} is not a memory size" in err, err
