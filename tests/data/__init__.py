"""Data files the tests use, inside the repository (provenance in README.md beside them)."""

from pathlib import Path

DATA = Path(__file__).resolve().parent
SHAKESPEARE = DATA / "tinyshakespeare_head.txt"  # the first ~200 KB of Tiny Shakespeare
