"""The Triton FlashAttention kernels (backend "triton") against SDPA and the eager path, on CPU.

Triton's interpreter must be switched on (`TRITON_INTERPRET=1`) before triton is imported, and
once imported triton stays in that mode for the whole process; so the kernels run in a child
process (this file run as a script) and the other tests in this process never see the variable.
The child computes, for each case, the largest difference of the output and of dQ, dK, dV from

    - SDPA: `F.scaled_dot_product_attention` with K/V expanded by `repeat_interleave` and the
      masks built here from `torch.tril` / `torch.arange` (not from attnlab.masks);
    - eager: attnlab's written-out `eager_attention` (the only reference for rows that may attend
      to nothing, where SDPA gives NaN and both attnlab paths give zeros).

Shapes are small (tens of positions) and deliberately not multiples of the 64-wide blocks.
bf16 is not checked here: Triton 3.9's interpreter gets `tl.dot` of bf16 tiles wrong (a 16 x 16
product off by 1e10, while fp16 is right), so fp16 covers the low-precision path on CPU and
`benchmarks/gpu_check.py` checks bf16 against SDPA on a GPU before timing it.
Every kernel test is `slow`: the child process alone (importing torch, then interpreting the
kernels in Python) takes several seconds; the argument checks below stay in the fast tier.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.components.backends import BACKENDS
from attnlab.components.triton_attention import triton_attention

OUT_TOL, GRAD_TOL = 1e-5, 1e-4  # fp32, max abs difference
LOW_TOL = {"float16": (4e-3, 1e-2)}  # (out, grads) vs fp32 SDPA

# name: (B, H, K, T, S, D, causal, key lengths or None, dtype, compare with SDPA)
CASES = {
    "odd": (2, 2, 2, 37, 37, 16, False, None, "float32", True),
    "causal_two_blocks": (1, 2, 2, 70, 70, 32, True, None, "float32", True),
    "gqa_t_ne_s": (2, 4, 2, 37, 70, 16, False, None, "float32", True),
    "prefill_causal": (1, 2, 2, 5, 67, 16, True, None, "float32", True),
    "padding_gqa": (2, 2, 1, 20, 67, 16, False, [67, 30], "float32", True),
}
SLOW_CASES = {
    "mqa_causal": (1, 4, 1, 45, 45, 16, True, None, "float32", True),
    "padding_causal": (2, 2, 2, 67, 67, 16, True, [67, 50], "float32", True),
    "head_dim_24": (1, 2, 2, 33, 33, 24, True, None, "float32", True),
    "head_dim_64": (1, 2, 2, 65, 65, 64, False, None, "float32", True),
    "head_dim_128": (1, 1, 1, 40, 40, 128, True, None, "float32", True),
    "t_gt_s_empty_rows": (1, 2, 2, 67, 40, 24, True, None, "float32", False),
    "empty_padding_row": (2, 2, 2, 9, 67, 16, False, [67, 0], "float32", False),
    "fp16_gqa": (2, 4, 2, 37, 50, 32, False, None, "float16", True),
}


def _reference_sdpa(q, k, v, causal, lengths):
    """SDPA on expanded K/V, masks from torch.tril / torch.arange; fp32."""
    import torch.nn.functional as F

    H, T, S = q.shape[1], q.shape[2], k.shape[2]
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    mask = torch.ones(1, 1, T, S, dtype=torch.bool)
    if causal:
        mask = mask & torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
    if lengths is not None:
        mask = mask & (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)


def _diffs(case) -> dict:
    """Run one case through the kernels; the max abs differences from the references."""
    from attnlab.components.backends import eager_attention

    B, H, K, T, S, D, causal, lengths, dtype, with_sdpa = case
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, n, L, D).to(dtype) for n, L in ((H, T), (K, S), (K, S)))
    mask = None
    if lengths is not None:
        mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    dout = torch.randn(B, H, T, D).to(dtype)

    def run(fn, *inputs):
        inputs = [x.detach().clone().requires_grad_() for x in inputs]
        out = fn(*inputs)
        grads = torch.autograd.grad(out, inputs, dout.to(out.dtype))
        return out, grads

    def gap(a, b):
        return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))

    out, grads = run(lambda q, k, v: triton_attention(q, k, v, mask, is_causal=causal)[0], q, k, v)
    result = {"dtype": str(dtype).removeprefix("torch."), "finite": bool(out.isfinite().all())}
    if with_sdpa:
        ref = run(lambda q, k, v: _reference_sdpa(q, k, v, causal, lengths), q, k, v)
        result["out_sdpa"] = gap([out], [ref[0]])
        result["grad_sdpa"] = gap(grads, ref[1])
    if dtype == torch.float32:
        ref = run(lambda q, k, v: eager_attention(q, k, v, mask, is_causal=causal)[0], q, k, v)
        result["out_eager"] = gap([out], [ref[0]])
        result["grad_eager"] = gap(grads, ref[1])
    return result


def _run_in_interpreter(cases: dict) -> dict:
    """Run `cases` in a child process with TRITON_INTERPRET=1; {name: differences}."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fast_results():
    return _run_in_interpreter(CASES)


@pytest.fixture(scope="module")
def slow_results():
    return _run_in_interpreter(SLOW_CASES)


def _check(result: dict) -> None:
    assert result["finite"]
    out_tol, grad_tol = LOW_TOL.get(result["dtype"], (OUT_TOL, GRAD_TOL))
    for ref in ("sdpa", "eager"):
        if f"out_{ref}" in result:
            assert result[f"out_{ref}"] <= out_tol, (ref, result)
            assert result[f"grad_{ref}"] <= grad_tol, (ref, result)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_matches_sdpa_and_eager(fast_results, name):
    _check(fast_results[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_matches_sdpa_and_eager_more_shapes(slow_results, name):
    _check(slow_results[name])


def test_registered_as_backend():
    assert BACKENDS["triton"] is triton_attention


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"bias": torch.zeros(1, 1, 4, 4)}, "bias"),
        ({"dropout": 0.1}, "dropout"),
        ({"return_weights": True}, "return_weights"),
        ({"mask": torch.ones(4, 4, dtype=torch.bool)}, "key-padding mask"),
    ],
)
def test_unsupported_arguments_name_themselves(kwargs, words):
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match=words):
        triton_attention(q, q, q, **kwargs)


def test_head_dim_out_of_range():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="head_dim 16-128, got 8"):
        triton_attention(q, q, q)


def test_cpu_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="needs a CUDA device.*backend='sdpa'"):
        triton_attention(q, q, q)


def _hypothesis_shapes(examples: int) -> dict:
    """Hypothesis draws shapes (in the child); the first case outside the fp32 tolerances."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    failures = []

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate])
    @given(
        B=st.integers(1, 2),
        K=st.integers(1, 2),
        G=st.integers(1, 3),
        T=st.integers(1, 80),
        S=st.integers(1, 80),
        D=st.sampled_from([16, 24, 32, 48]),
        causal=st.booleans(),
        padded=st.booleans(),
    )
    def check(B, K, G, T, S, D, causal, padded):
        lengths = [S - i * (S // 3) for i in range(B)] if padded else None
        case = (B, K * G, K, T, S, D, causal, lengths, "float32", False)
        try:
            _check(_diffs(case))
        except AssertionError as e:
            failures.append([case, str(e)])
            raise

    try:
        check()
    except AssertionError:
        pass
    return {"failures": failures[-1:]}


def _layer_gap() -> dict:
    """A GQA causal Attention layer on backend "triton" vs the same weights on "eager"."""
    from attnlab.components.attention import Attention
    from attnlab.components.context import AttentionContext

    torch.manual_seed(0)
    eager = Attention(64, n_heads=4, n_kv_heads=2, backend="eager")
    ours = Attention(64, n_heads=4, n_kv_heads=2, backend="triton")
    ours.load_state_dict(eager.state_dict())
    x = torch.randn(2, 19, 64)
    ctx = AttentionContext(is_causal=True)
    out_e, out_t = eager(x, ctx), ours(x, ctx)
    out_e.square().sum().backward()
    out_t.square().sum().backward()
    grads = [
        (a.grad - b.grad).abs().max().item() for a, b in zip(eager.parameters(), ours.parameters())
    ]
    return {"out": (out_e - out_t).abs().max().item(), "grad": max(grads)}


@pytest.mark.slow
def test_attention_layer_on_triton_backend():
    """The registry reaches the layer: Attention(backend="triton") equals backend="eager"."""
    result = _run_in_interpreter({"layer": None})
    assert result["out"] <= OUT_TOL and result["grad"] <= GRAD_TOL, result


@pytest.mark.slow
def test_hypothesis_shapes():
    """Shapes drawn by hypothesis (odd lengths, T != S, GQA, padding) equal the eager path."""
    result = _run_in_interpreter({"hypothesis": 15})
    assert result["failures"] == [], result["failures"]


if __name__ == "__main__":  # the child process: TRITON_INTERPRET=1 is already set
    cases = json.loads(sys.argv[1])
    if "layer" in cases:
        print(json.dumps(_layer_gap()))
    elif "hypothesis" in cases:
        print(json.dumps(_hypothesis_shapes(cases["hypothesis"])))
    else:
        print(json.dumps({name: _diffs(case) for name, case in cases.items()}))
