"""The flash backend (FlashAttention-2 in PyTorch) against `F.scaled_dot_product_attention`.

References are built here: masks from `torch.tril` / `torch.arange`, GQA by `repeat_interleave`
on k/v, and SDPA called directly (rows that attend to nothing are zeroed, the eager convention).
Small block sizes make every case span several tiles, with ragged last tiles.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.components.attention import Attention
from attnlab.components.backends import BACKENDS, eager_attention
from attnlab.components.context import AttentionContext
from attnlab.components.flash import FlashAttention, flash_attention
from attnlab.components.hooks import run_with_cache
from attnlab.components.kv_cache import ModelCache
from attnlab.models.build import build_model
from attnlab.models.presets import PRESETS

FWD_ATOL, GRAD_ATOL = 1e-5, 1e-4  # fp32, max abs difference


def _ref_causal(T: int, S: int) -> torch.Tensor:
    """(T, S) bool: the T queries are the last T of S positions (bottom-right aligned)."""
    return torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)


def _ref_padding(lengths: list[int], S: int) -> torch.Tensor:
    """(B, 1, 1, S) bool key-padding mask, True = a real token."""
    return (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]


def _reference(q, k, v, mask=None, bias=None, is_causal=False):
    """SDPA on repeated k/v with one dense float mask; rows with no allowed key -> zeros."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    T, S = q.shape[2], k.shape[2]
    allowed = torch.ones(T, S, dtype=torch.bool)
    if is_causal:
        allowed = allowed & _ref_causal(T, S)
    if mask is not None:
        allowed = allowed & mask
    float_mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    if bias is not None:
        float_mask = float_mask + bias
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)
    return out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)


def _leaves(*shapes, dtype=torch.float32):
    return [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]


def _check(B, H, K, T, S, D, mask=None, bias=None, is_causal=False, bq=4, bk=3):
    """Forward within 1e-5 and q, k, v (and bias) gradients within 1e-4 of the reference."""
    q, k, v = _leaves((B, H, T, D), (B, K, S, D), (B, K, S, D))
    extra = [bias] if bias is not None and bias.requires_grad else []
    out, _ = flash_attention(q, k, v, mask, bias, is_causal, block_q=bq, block_k=bk)
    ref = _reference(q, k, v, mask, bias, is_causal)
    torch.testing.assert_close(out, ref, atol=FWD_ATOL, rtol=0)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v, *extra], d_out)
    ref_grads = torch.autograd.grad(ref, [q, k, v, *extra], d_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=GRAD_ATOL, rtol=0)


@pytest.mark.parametrize(
    "case", ["none", "causal", "padding", "padded_causal", "mask_4d", "bias", "all"]
)
def test_flash_matches_sdpa(case):
    torch.manual_seed(0)
    B, H, T, S, D = 2, 4, 11, 11, 8  # 11 is no multiple of the block sizes 4 and 3
    mask, bias = None, None
    if case in ("padding", "padded_causal", "all"):
        mask = _ref_padding([S, 6], S)  # (B, 1, 1, S)
    if case == "mask_4d":
        mask = torch.rand(B, 1, T, S) > 0.3  # (B, 1, T, S)
    if case in ("bias", "all"):
        bias = torch.randn(H, T, S, requires_grad=True)  # learned, like T5's
    _check(B, H, H, T, S, D, mask, bias, is_causal=case in ("causal", "padded_causal", "all"))


@pytest.mark.parametrize("K", [1, 2])  # MQA and GQA with 4 query heads
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_gqa_and_mqa(K, is_causal):
    torch.manual_seed(1)
    _check(2, 4, K, 7, 9, 8, mask=_ref_padding([9, 5], 9), is_causal=is_causal)


@pytest.mark.parametrize("T, S", [(5, 13), (1, 13), (3, 3)])
def test_flash_cache_prefill_and_decode(T, S):
    """T != S: the queries are the last T of S keys (prefill against a cache, decode)."""
    torch.manual_seed(2)
    _check(1, 2, 2, T, S, 4, is_causal=True)


def test_flash_fully_masked_rows_give_zeros_not_nan():
    torch.manual_seed(3)
    mask = torch.ones(2, 1, 6, 8, dtype=torch.bool)
    mask[0, 0, 2] = False  # one query row that may attend to nothing
    mask[1] = False  # a whole sequence of them
    q, k, v = _leaves((2, 2, 6, 4), (2, 2, 8, 4), (2, 2, 8, 4))
    out, weights = flash_attention(q, k, v, mask, block_q=4, block_k=3, return_weights=True)
    assert out[0, :, 2].abs().max() == 0 and out[1].abs().max() == 0
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.isfinite(weights).all() and weights[1].abs().max() == 0
    _check(2, 2, 2, 6, 8, 4, mask=mask)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2),
    K=st.integers(1, 2),
    G=st.integers(1, 3),
    T=st.integers(1, 9),
    extra=st.integers(0, 6),
    D=st.sampled_from([1, 4, 8]),
    bq=st.integers(1, 5),
    bk=st.integers(1, 5),
    is_causal=st.booleans(),
    padded=st.booleans(),
)
def test_flash_matches_sdpa_drawn_shapes(B, K, G, T, extra, D, bq, bk, is_causal, padded):
    S = T + extra
    mask = _ref_padding([max(1, S - i) for i in range(B)], S) if padded else None
    _check(B, K * G, K, T, S, D, mask=mask, is_causal=is_causal, bq=bq, bk=bk)


def test_flash_gradcheck_float64():
    torch.manual_seed(4)
    q, k, v = _leaves((1, 2, 5, 3), (1, 1, 6, 3), (1, 1, 6, 3), dtype=torch.float64)
    bias = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    mask = _ref_padding([5], 6)

    def f(q, k, v, bias):
        return flash_attention(q, k, v, mask, bias, is_causal=True, block_q=2, block_k=4)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


def test_flash_backward_keeps_nothing_t_by_s():
    """The saved tensors are the inputs, the output and L (B, H, T): no (T, S) probabilities."""
    T, S = 12, 16
    q, k, v = _leaves((1, 2, T, 4), (1, 2, S, 4), (1, 2, S, 4))
    out, _ = flash_attention(q, k, v, is_causal=True, block_q=4, block_k=4)
    shapes = [tuple(t.shape) for t in out.grad_fn.saved_tensors if t is not None]
    assert isinstance(out.grad_fn, FlashAttention._backward_cls)
    assert sorted(shapes) == sorted(
        [(1, 2, T, 4), (1, 2, S, 4), (1, 2, S, 4), (1, 2, T, 4), (1, 2, T)]
    )


def test_flash_probabilities_equal_eager_weights():
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    mask, bias = _ref_padding([10, 6], 10), torch.randn(4, 7, 10)
    args = dict(mask=mask, bias=bias, is_causal=True, return_weights=True)
    _, weights = flash_attention(q, k, v, block_q=3, block_k=4, **args)
    _, expected = eager_attention(q, k, v, **args)
    torch.testing.assert_close(weights, expected, atol=FWD_ATOL, rtol=0)


def test_capture_weights_on_a_flash_layer_does_not_call_eager(monkeypatch):
    torch.manual_seed(6)
    layer = Attention(d_model=16, n_heads=4, n_kv_heads=2, backend="flash").eval()
    eager_layer = Attention(d_model=16, n_heads=4, n_kv_heads=2, backend="eager").eval()
    eager_layer.load_state_dict(layer.state_dict())
    x, ctx = torch.randn(2, 9, 16), AttentionContext(is_causal=True)
    expected_out, expected = run_with_cache(eager_layer, x, ctx, names=["hook_pattern"])

    def no_eager(*args, **kwargs):
        raise AssertionError("the eager path was called")

    monkeypatch.setitem(BACKENDS, "eager", no_eager)
    out, seen = run_with_cache(layer, x, ctx, names=["hook_pattern"])
    torch.testing.assert_close(out, expected_out, atol=FWD_ATOL, rtol=0)
    torch.testing.assert_close(
        seen["hook_pattern"], expected["hook_pattern"], atol=FWD_ATOL, rtol=0
    )


@pytest.mark.parametrize(
    "bad, match",
    [(dict(dropout=0.1), "flash backend is dropout-free"), (dict(block_q=0), "block sizes")],
)
def test_flash_bad_arguments_name_the_value(bad, match):
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, q, q, **bad)


def _with_backend(cfg, backend: str):
    return replace(cfg, attention=replace(cfg.attention, backend=backend))


@pytest.mark.parametrize("preset", ["llama-tiny", "t5-tiny"])  # GQA + RoPE; learned T5 bias
def test_flash_model_equals_sdpa_model(preset):
    """A whole model built with attention.backend="flash": logits and gradients as with sdpa."""
    torch.manual_seed(7)
    cfg = PRESETS[preset]()
    flash_model = build_model(_with_backend(cfg, "flash")).eval()
    sdpa_model = build_model(_with_backend(cfg, "sdpa")).eval()
    sdpa_model.load_state_dict(flash_model.state_dict())
    ids = torch.randint(cfg.vocab_size, (2, 11))
    args = (ids, ids) if cfg.arch == "encoder_decoder" else (ids,)
    logits, ref_logits = flash_model(*args), sdpa_model(*args)
    torch.testing.assert_close(logits, ref_logits, atol=FWD_ATOL, rtol=0)
    logits.square().mean().backward()
    ref_logits.square().mean().backward()
    ref_params = dict(sdpa_model.named_parameters())
    for name, p in flash_model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, atol=GRAD_ATOL, rtol=0, msg=name)


def test_flash_causal_forward_skips_the_blocks_above_the_diagonal(monkeypatch):
    """T = S = 8 in 2 x 2 tiles: 4 + 3 + 2 + 1 = 10 tiles on or below the diagonal, not 16."""
    import attnlab.components.flash as flash_module

    calls, real = [], flash_module._modify_scores

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(flash_module, "_modify_scores", counting)
    q = torch.randn(1, 1, 8, 4, requires_grad=True)
    out, _ = flash_attention(q, q, q, is_causal=True, block_q=2, block_k=2)
    assert len(calls) == 10
    out.sum().backward()
    assert len(calls) == 20  # the backward recomputes the same 10 tiles


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_flash_model_decodes_from_a_cache_like_sdpa(preset):
    """Prefill then decode through a left-padded KV cache (T != S, padding mask) as with sdpa."""
    torch.manual_seed(8)
    cfg = PRESETS[preset]()
    models = {b: build_model(_with_backend(cfg, b)).eval() for b in ("flash", "sdpa")}
    models["sdpa"].load_state_dict(models["flash"].state_dict())
    key_valid = torch.ones(2, 9, dtype=torch.bool)
    key_valid[1, :2] = False  # row 1 is left-padded
    ids = torch.randint(cfg.vocab_size, (2, 6))
    logits = {}
    for backend, model in models.items():
        cache = ModelCache.for_decoder(model, key_valid)
        with torch.no_grad():
            steps = [model(ids[:, :4], cache=cache, slots=torch.arange(4))[:, -1]]
            for slot in (4, 5):
                steps.append(
                    model(ids[:, slot : slot + 1], cache=cache, slots=torch.tensor([slot]))[:, -1]
                )
        logits[backend] = torch.stack(steps)
    torch.testing.assert_close(logits["flash"], logits["sdpa"], atol=FWD_ATOL, rtol=0)


def test_capture_attention_on_a_flash_model_equals_the_sdpa_models_maps(monkeypatch):
    """viz.capture on a flash model: every layer's maps, and the eager path is never called."""
    from attnlab.viz.capture import capture_attention

    torch.manual_seed(9)
    cfg = PRESETS["t5-tiny"]()  # encoder self, decoder self and cross attention, T5 bias
    flash_model = build_model(_with_backend(cfg, "flash")).eval()
    sdpa_model = build_model(_with_backend(cfg, "sdpa")).eval()
    sdpa_model.load_state_dict(flash_model.state_dict())
    src, tgt = torch.randint(cfg.vocab_size, (2, 7)), torch.randint(cfg.vocab_size, (2, 5))
    with torch.no_grad(), capture_attention(sdpa_model) as expected:
        sdpa_model(src, tgt)

    def no_eager(*args, **kwargs):
        raise AssertionError("the eager path was called")

    monkeypatch.setitem(BACKENDS, "eager", no_eager)
    with torch.no_grad(), capture_attention(flash_model) as maps:
        flash_model(src, tgt)
    assert set(maps.weights) == set(expected.weights) == {"encoder_self", "decoder_self", "cross"}
    for kind, layers in expected.weights.items():
        for i, w in layers.items():
            torch.testing.assert_close(maps.weights[kind][i], w, atol=FWD_ATOL, rtol=0)


def test_flash_bfloat16_inputs_accumulate_in_float32():
    """bf16 in, bf16 out and gradients, computed in fp32: near fp32 SDPA within bf16 rounding."""
    torch.manual_seed(10)
    q, k, v = _leaves((1, 2, 9, 8), (1, 1, 9, 8), (1, 1, 9, 8), dtype=torch.bfloat16)
    out, _ = flash_attention(q, k, v, is_causal=True, block_q=4, block_k=4)
    assert out.dtype == torch.bfloat16
    ref = _reference(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=0)
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16


# --- the function forms: score_mod / mask_mod (FlexAttention's) read tile by tile -------------


def _doc_ids(T):
    """Two rows of packed documents (lengths 4, 9 and 7, 6)."""
    row0 = torch.repeat_interleave(torch.arange(2), torch.tensor([4, T - 4]))
    row1 = torch.repeat_interleave(torch.arange(2), torch.tensor([7, T - 7]))
    return torch.stack([row0, row1])  # (B, T)


def _mask_forms(name, T):
    """(mask_mod, dense bool mask from masks.py's builders, or written out for documents)."""
    from attnlab.components import masks

    if name == "causal":
        return masks.causal_mask_mod(), masks.causal_mask(T)
    if name == "sliding_window":
        return masks.sliding_window_mask_mod(5), masks.sliding_window_mask(T, 5)
    if name == "prefix_lm":
        lens = torch.tensor([3, 8])
        return masks.prefix_lm_mask_mod(lens), masks.prefix_lm_mask(T, lens)
    ids = _doc_ids(T)
    same = (ids[:, :, None] == ids[:, None, :]) & _ref_causal(T, T)  # (B, T, T)
    return masks.document_mask_mod(ids), same[:, None]


def _position_forms(name, H, T):
    """(scheme, score_mod, dense (H, T, T) bias from `score_bias`)."""
    from attnlab.components.positions import ALiBi, T5Bias

    torch.manual_seed(1)
    scheme = ALiBi(H) if name == "alibi" else T5Bias(H, 8, max_distance=10, bidirectional=False)
    if name == "t5_bias":
        torch.nn.init.normal_(scheme.relative_attention_bias.weight, std=1.0)
    pos = torch.arange(T)
    return scheme, scheme.score_mod(pos, pos, bound=T), scheme.score_bias(pos, pos)


@pytest.mark.parametrize("position", ["alibi", "t5_bias"])
@pytest.mark.parametrize("mask_name", ["causal", "sliding_window", "prefix_lm", "document"])
def test_flash_score_mod_and_mask_mod_equal_the_dense_eager_path(position, mask_name):
    """Forward within 1e-5; q, k, v and the T5 table's gradients within 1e-4 (GQA, odd T)."""
    B, H, K, T, D = 2, 4, 2, 13, 8  # 13 is no multiple of the block sizes 4 and 3
    scheme, score_mod, dense_bias = _position_forms(position, H, T)
    mask_mod, dense_mask = _mask_forms(mask_name, T)
    q, k, v = _leaves((B, H, T, D), (B, K, T, D), (B, K, T, D))
    learned = [p for p in scheme.parameters() if p.requires_grad]  # T5's table; none for ALiBi
    out, _ = flash_attention(q, k, v, mask_mod, score_mod, block_q=4, block_k=3)
    ref, _ = eager_attention(q, k, v, mask=dense_mask, bias=dense_bias)
    torch.testing.assert_close(out, ref, atol=FWD_ATOL, rtol=0)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v, *learned], d_out)
    ref_grads = torch.autograd.grad(ref, [q, k, v, *learned], d_out)
    assert len(grads) == (4 if position == "t5_bias" else 3)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=GRAD_ATOL, rtol=0)


def test_flash_score_mod_gradient_goes_through_a_nonlinear_score_mod():
    """dS reaches Q K^T through the score_mod's own derivative (a tanh soft-cap, as Gemma 2)."""
    B, H, T, D = 1, 2, 10, 8
    q, k, v = _leaves((B, H, T, D), (B, H, T, D), (B, H, T, D))
    cap = torch.tensor(2.0, requires_grad=True)

    def soft_cap(score, b, h, i, j):
        return cap * torch.tanh(score / cap)

    soft_cap.tensors = (cap,)
    out, _ = flash_attention(q, k, v, bias=soft_cap, is_causal=True, block_q=3, block_k=4)
    s = cap * torch.tanh((q @ k.transpose(-2, -1)) * D**-0.5 / cap)
    ref = s.masked_fill(~_ref_causal(T, T), float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(out, ref, atol=FWD_ATOL, rtol=0)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v, cap], d_out)
    ref_grads = torch.autograd.grad(ref, [q, k, v, cap], d_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=GRAD_ATOL, rtol=0)


def test_flash_takes_a_block_mask_skips_its_empty_tiles_and_builds_nothing_quadratic(monkeypatch):
    """A BlockMask is read through its mask_mod, tiles it hides are skipped, no T x S index.

    Sliding window 4 over T = 11 in 4 x 4 tiles (the BlockMask's blocks too): 5 of the 9 tiles
    hold a visible key (the diagonal and the one below it), forward and backward alike.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    import attnlab.components.flash as flash_module
    from attnlab.components.masks import sliding_window_mask, sliding_window_mask_mod

    B, H, T, D = 2, 2, 11, 4
    mod = sliding_window_mask_mod(4)
    blocks = create_block_mask(mod, None, None, T, T, device="cpu", BLOCK_SIZE=4)
    sizes, real = [], flash_module._tile_indices

    def recording(*args):
        idx = real(*args)
        sizes.append(torch.broadcast_shapes(*(t.shape for t in idx))[-2:].numel())
        return idx

    monkeypatch.setattr(flash_module, "_tile_indices", recording)
    q, k, v = _leaves((B, H, T, D), (B, H, T, D), (B, H, T, D))
    out, _ = flash_attention(q, k, v, mask=blocks, block_q=4, block_k=4)
    assert len(sizes) == 5 and max(sizes) <= 4 * 4
    ref = _reference(q, k, v, mask=sliding_window_mask(T, 4))
    torch.testing.assert_close(out, ref, atol=FWD_ATOL, rtol=0)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], d_out)
    assert len(sizes) == 10
    ref_grads = torch.autograd.grad(ref, [q, k, v], d_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=GRAD_ATOL, rtol=0)
    # Blocks larger than the tiles (flex's default 128): a tile is skipped only if its block is.
    big = create_block_mask(mod, None, None, T, T, device="cpu")
    out, _ = flash_attention(q, k, v, mask=big, block_q=4, block_k=4)
    torch.testing.assert_close(out, ref, atol=FWD_ATOL, rtol=0)


def test_flash_t5_score_mod_with_a_cache_prefill_equals_eager():
    """T != S: the last 5 of 13 positions, causal, the T5 table's gradient within 1e-4."""
    from attnlab.components.positions import T5Bias

    torch.manual_seed(2)
    B, H, T, S, D = 2, 2, 5, 13, 8
    t5 = T5Bias(H, 8, max_distance=10, bidirectional=False)
    q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
    q, k, v = _leaves((B, H, T, D), (B, 1, S, D), (B, 1, S, D))  # MQA
    table = t5.relative_attention_bias.weight
    mod = t5.score_mod(q_pos, k_pos, bound=S)
    out, _ = flash_attention(q, k, v, bias=mod, is_causal=True, block_q=2, block_k=4)
    ref, _ = eager_attention(q, k, v, bias=t5.score_bias(q_pos, k_pos), is_causal=True)
    torch.testing.assert_close(out, ref, atol=FWD_ATOL, rtol=0)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v, table], d_out)
    ref_grads = torch.autograd.grad(ref, [q, k, v, table], d_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=GRAD_ATOL, rtol=0)
