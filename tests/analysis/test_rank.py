"""analysis/rank.py: numerical rank by SVD, on matrices whose rank is known, and the attention
experiment against the library's own Attention layer."""

import pytest
import torch

from attnlab.analysis.rank import (
    RankAnalysis,
    energy_rank,
    format_rank_table,
    measure_heads,
    model_rank_table,
    numerical_rank,
    random_attention,
    random_rank_table,
    rank_analysis,
    summarize,
)
from attnlab.components.attention import Attention
from attnlab.components.context import AttentionContext
from attnlab.components.hooks import run_with_cache
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_numerical_rank_uses_the_dtypes_epsilon():
    d = torch.tensor([1.0, 1e-3, 1e-10, 0.0], dtype=torch.float64)
    a = torch.diag(d)
    assert numerical_rank(a) == 3  # 1e-10 > 4 * 2.2e-16
    assert numerical_rank(a.float()) == 2  # 1e-10 < 4 * 1.2e-7: float32 noise level
    assert numerical_rank(a, eps=1e-2) == 1
    assert numerical_rank(torch.zeros(3, 3)) == 0
    g = torch.Generator().manual_seed(0)
    low = torch.randn(20, 3, generator=g, dtype=torch.float64) @ torch.randn(
        3, 30, generator=g, dtype=torch.float64
    )
    assert numerical_rank(low) == 3


def test_energy_rank():
    assert energy_rank(torch.diag(torch.tensor([3.0, 0.1, 0.1]).double())) == 1  # 9 / 9.02
    assert energy_rank(torch.eye(5).double()) == 5


def test_random_attention_is_the_library_layer_and_reproducible():
    n, d_k, H, C = 12, 4, 3, 64
    probs, logits = random_attention(n, d_k, H, seed=5, causal=True, width=C)
    again, _ = random_attention(n, d_k, H, seed=5, causal=True, width=C)
    assert torch.equal(probs, again)
    # The same weights in an Attention layer (eager, captured) give the same probabilities.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, C, generator=g, dtype=torch.float64)
    w_q = torch.randn(H, C, d_k, generator=g, dtype=torch.float64) / C**0.5
    w_k = torch.randn(H, C, d_k, generator=g, dtype=torch.float64) / C**0.5
    attn = Attention(C, H, head_dim=d_k)
    with torch.no_grad():
        attn.q_proj.weight.copy_(w_q.permute(0, 2, 1).reshape(H * d_k, C))
        attn.k_proj.weight.copy_(w_k.permute(0, 2, 1).reshape(H * d_k, C))
        _, seen = run_with_cache(attn, x.float()[None], AttentionContext(is_causal=True))
    assert (seen["hook_pattern"][0].double() - probs).abs().max() < 1e-6
    assert numerical_rank(logits[0]) == d_k
    assert (probs.sum(-1) - 1).abs().max() < 1e-12


def test_rows_respect_the_bounds():
    rows = random_rank_table([8, 24], [2, 6], [1, 3], seed=1)
    assert len(rows) == 8
    for r in rows:
        assert r.logits_rank <= min(r.n, r.d_k)
        assert r.head_rank[0] <= r.head_rank[1] <= r.head_rank[2] <= r.n
        assert r.head_rank[2] <= r.joint_rank <= r.n
        assert 1 <= r.head_energy_rank <= r.n
    assert rows == random_rank_table([8, 24], [2, 6], [1, 3], seed=1)  # seeded
    table = format_rank_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert "rank(Q K^T) <= d_k held in every row" in summarize(rows)


def test_joint_rank_of_low_rank_heads_adds_up():
    # Head 0: queries 0-2 read token 0, queries 3-5 read token 1 (rank 2); head 1: even queries
    # read token 2, odd ones token 3 (rank 2). Their column spaces share the all-ones vector
    # (P 1 = 1 for any attention matrix), so together they span 2 + 2 - 1 = 3 dimensions.
    n = 6
    p = torch.zeros(2, n, n, dtype=torch.float64)
    p[0, :3, 0] = p[0, 3:, 1] = 1.0
    p[1, 0::2, 2] = p[1, 1::2, 3] = 1.0
    row = measure_heads(p, "handmade", d_k=1)
    assert row.head_rank == (2, 2, 2) and row.joint_rank == 3


def test_model_rows_and_report():
    torch.manual_seed(0)
    model = build_model(get_preset("llama-tiny"))
    rows = model_rank_table(model, torch.randint(256, (1, 10)), "init")
    assert [r.source for r in rows] == ["init decoder_self layer 0", "init decoder_self layer 1"]
    assert all(r.n == 10 and r.n_heads == 4 and r.d_k == 16 for r in rows)
    assert all(r.tol_eps == torch.finfo(torch.float32).eps for r in rows)
    _, report = rank_analysis(RankAnalysis(n=(8,), d_k=(2,), heads=(1, 2)))
    assert "tol = max(rows, cols) * eps * sigma_max, eps = 2.2e-16 (float64)" in report
    with pytest.raises(ValueError, match=">= 1"):
        rank_analysis(RankAnalysis(n=(0,)))
