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


@pytest.fixture(autouse=True, scope="module")
def fresh_compile_caches():
    """Each test module starts with dynamo's caches empty: compiled FlexAttention recompiles per
    shape, and past dynamo's limit of 8 per function it falls back to the unfused (T, S) path with
    a warning, so shapes compiled by earlier modules would count against later ones."""
    torch._dynamo.reset()
