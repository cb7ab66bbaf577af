"""Named public corpora: downloaded once into a user cache, checked against a known SHA-256.

A recipe names a dataset (`data.source: shakespeare`), never a path outside the repository.
The first use downloads the file from its canonical URL into the data home (`$ATTNLAB_DATA`, or
`$XDG_CACHE_HOME/attnlab/data`, or `~/.cache/attnlab/data`); every later use reads it there.
`attnlab data get NAME` does the download explicitly, and `--from PATH` registers a copy the user
already has (after checking its hash), for machines without network.

A download is written beside its final name and renamed in only after its hash matched, so the
cache never holds a partial or wrong file under the dataset's name.
"""

import hashlib
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Dataset:
    """A public file, where it comes from, and the hash that says it arrived whole."""

    name: str
    url: str
    sha256: str
    size: int  # bytes
    filename: str
    about: str


DATASETS = {
    "shakespeare": Dataset(
        name="shakespeare",
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        size=1_115_394,
        filename="tinyshakespeare.txt",
        about="Tiny Shakespeare (Karpathy's char-rnn): 40,000 lines of the plays, public domain",
    ),
}


class DatasetUnavailable(ValueError):
    """A dataset is not in the cache and could not be fetched; the message says what to do."""


def data_home() -> Path:
    """Where downloaded datasets live: $ATTNLAB_DATA, else the user's cache directory."""
    if os.environ.get("ATTNLAB_DATA"):
        return Path(os.environ["ATTNLAB_DATA"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "attnlab" / "data"


def get_dataset(name: str) -> Dataset:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}")
    return DATASETS[name]


def dataset_path(name: str, home: Path | None = None) -> Path:
    """Where dataset `name` is (or will be) cached."""
    return (home or data_home()) / get_dataset(name).filename


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_cached(name: str, home: Path | None = None) -> bool:
    """Whether the cached file is there and has the expected hash."""
    path = dataset_path(name, home)
    return path.is_file() and sha256_of(path) == get_dataset(name).sha256


def fetch(name: str, home: Path | None = None, url: str | None = None, timeout: float = 60) -> Path:
    """Download dataset `name` into the cache once and return its path; a no-op when cached.

    Args:
        url: where to download from instead of the dataset's URL (tests use a file:// URL or a
            local server).

    Raises:
        DatasetUnavailable: no network (or the server failed); the message names the ways out.
        ValueError: the download's SHA-256 is not the expected one (the file is deleted).
    """
    ds = get_dataset(name)
    path = dataset_path(name, home)
    if is_cached(name, home):
        return path
    url = url or ds.url
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.part{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "reason", e)
        raise DatasetUnavailable(
            f"dataset {name!r} is not in {path.parent} and cannot be downloaded from {url} "
            f"({reason}): run `attnlab data get {name}` once online, or register a local copy "
            f"with `attnlab data get {name} --from PATH` (or train with --data.source PATH)"
        ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _check_and_move(name, tmp, path, f"the download from {url}")
    return path


def register(name: str, source: str | Path, home: Path | None = None) -> Path:
    """Copy a local file into the cache as dataset `name`, after checking its SHA-256."""
    source = Path(source)
    if not source.is_file():
        raise ValueError(f"--from {source}: no such file")
    path = dataset_path(name, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.part{os.getpid()}")
    shutil.copyfile(source, tmp)
    _check_and_move(name, tmp, path, str(source), keep_source=True)
    return path


def _check_and_move(name: str, tmp: Path, path: Path, what: str, keep_source=False) -> None:
    ds = get_dataset(name)
    digest = sha256_of(tmp)
    if digest != ds.sha256:
        size = tmp.stat().st_size
        tmp.unlink()
        fate = "not copied: give the original file" if keep_source else "deleted: try again"
        raise ValueError(
            f"{what} is not the expected {ds.filename} (SHA-256 {digest[:12]}..., {size:,} "
            f"bytes; expected {ds.sha256[:12]}..., {ds.size:,} bytes), {fate}"
        )
    os.replace(tmp, path)


def resolve(name: str, home: Path | None = None) -> Path:
    """The cached file of dataset `name` (a recipe's `data.source`), downloaded if missing."""
    return fetch(name, home)
