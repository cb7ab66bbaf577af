"""Shared fixtures: every test starts from the same RNG state."""

import pytest
import torch


@pytest.fixture(autouse=True)
def seed():
    """Seed torch's global RNG so every test is reproducible on its own and in any order."""
    torch.manual_seed(0)
    return 0
