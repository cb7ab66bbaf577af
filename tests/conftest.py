"""Shared set-up: one torch thread, and every test starts from the same RNG state."""

import pytest
import torch

# The tests use tiny tensors: a team of threads only adds synchronisation (and on a shared
# machine, threads spinning against each other), and one thread makes results reproducible.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seed():
    """Seed torch's global RNG so every test is reproducible on its own and in any order."""
    torch.manual_seed(0)
    return 0
