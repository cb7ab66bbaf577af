"""Fixtures for the viz tests: one CPU thread (bit-reproducible, and no spinning thread teams on
a shared machine) and figures closed by garbage collection (they are pyplot-free)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
