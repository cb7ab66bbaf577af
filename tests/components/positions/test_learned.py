"""Learned absolute positions: an nn.Embedding lookup added to the input, with a hard limit."""

import pytest
import torch

from attnlab.components.positions.learned import LearnedPosition


def test_embed_adds_embedding_rows():
    torch.manual_seed(0)
    module = LearnedPosition(max_seq_len=16, d_model=8)
    assert isinstance(module.table, torch.nn.Embedding)
    assert module.table.weight.shape == (16, 8)
    x = torch.randn(2, 4, 8)
    pos = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 15]])
    out = module.embed(x, pos)
    assert out.shape == (2, 4, 8)
    torch.testing.assert_close(out[1, 3], x[1, 3] + module.table.weight[15])
    torch.testing.assert_close(module.embed(x, torch.arange(4)), x + module.table.weight[:4])
    assert list(module.state_dict()) == ["table.weight"]


def test_gradient_reaches_only_used_rows():
    module = LearnedPosition(max_seq_len=8, d_model=4)
    module.embed(torch.zeros(1, 2, 4), torch.tensor([1, 3])).sum().backward()
    used = module.table.weight.grad.abs().sum(-1) > 0
    assert used.tolist() == [False, True, False, True, False, False, False, False]


def test_position_beyond_table_raises():
    module = LearnedPosition(max_seq_len=512, d_model=8)
    with pytest.raises(
        ValueError, match=r"position 600 is beyond the learned position table of 512"
    ):
        module.embed(torch.zeros(1, 2, 8), torch.tensor([3, 600]))
    with pytest.raises(ValueError, match="position 512"):
        module.embed(torch.zeros(1, 1, 8), torch.tensor([[512]]))
    with pytest.raises(ValueError, match="max_seq_len=0"):
        LearnedPosition(max_seq_len=0, d_model=8)
