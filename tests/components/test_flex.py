"""The flex backend (components/flex.py) against the dense eager path, the mask_mod forms against
the dense mask builders, and a T5 from `transformers` through the flex path.

References: `eager_attention` with the dense (H, T, S) bias from `score_bias` and the dense masks
from masks.py (or written out here: the document mask); HF T5's logits. FlexAttention compiles
(seconds per shape on CPU), so the shapes are few and tiny and the compiled tests are `slow`.
FlexAttention has no backward on CPU in PyTorch 2.13, so there a flex layer that needs gradients
runs flash.py's tiled forward and recomputing backward on the same mask_mod / score_mod (nothing
compiles: those tests are fast); PyTorch's own flex backward is tested on a GPU.
"""

from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from attnlab.components.backends import eager_attention
from attnlab.components.flex import block_mask, flex_attention_backend
from attnlab.components.masks import (
    causal_mask,
    causal_mask_mod,
    check_mask,
    document_mask_mod,
    permutation_mask,
    permutation_mask_mod,
    prefix_lm_mask,
    prefix_lm_mask_mod,
    sliding_window_mask,
    sliding_window_mask_mod,
)
from attnlab.components.positions import ALiBi, T5Bias
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig
from attnlab.viz.capture import capture_attention

ATOL = 1e-5
# Each distinct shape and mod compiles once; past dynamo's default limit of 8, flex would warn
# and fall back to its unfused form, so these tests would no longer test the compiled kernel.
pytestmark = pytest.mark.filterwarnings("error:flex_attention called without torch.compile")
B, H, T, D = 2, 4, 37, 8  # T is not a multiple of flex's 128-wide blocks


@pytest.fixture(autouse=True, scope="module")
def _room_for_every_compile():
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def qkv(T_=T, S=T, K=H, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_, D, generator=g)
    k, v = torch.randn(2, B, K, S, D, generator=g)
    return q.to(device), k.to(device), v.to(device)


def doc_ids(T_=T):
    """Two rows of packed documents: lengths 10, 20, 7 and 5, 32."""
    row0 = torch.repeat_interleave(torch.arange(3), torch.tensor([10, 20, 7]))
    row1 = torch.repeat_interleave(torch.arange(2), torch.tensor([5, 32]))
    return torch.stack([row0, row1])  # (B, T)


def dense_document_mask(ids):
    """Written out independently of masks.py: same document and not in the future."""
    same = ids[:, :, None] == ids[:, None, :]  # (B, T, T)
    return (same & causal_mask(ids.shape[1]))[:, None]  # (B, 1, T, T)


ORDER = torch.randperm(T, generator=torch.Generator().manual_seed(3))
MASKS = {  # name -> (mask_mod, B or None, dense reference broadcastable to (B, H, T, T))
    "causal": (causal_mask_mod(), None, causal_mask(T)),
    "sliding_window_5": (sliding_window_mask_mod(5), None, sliding_window_mask(T, 5)),
    "prefix_lm_9": (prefix_lm_mask_mod(9), None, prefix_lm_mask(T, 9)),
    "prefix_lm_per_row": (
        prefix_lm_mask_mod(torch.tensor([4, 20])),
        B,
        prefix_lm_mask(T, torch.tensor([4, 20])),
    ),
    "document": (document_mask_mod(doc_ids()), B, dense_document_mask(doc_ids())),
    "permutation_query": (permutation_mask_mod(ORDER), None, permutation_mask(ORDER)),
    "permutation_content": (
        permutation_mask_mod(ORDER, include_self=True),
        None,
        permutation_mask(ORDER) | torch.eye(T, dtype=torch.bool),
    ),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_mask_mods_equal_the_dense_masks(name):
    mod, Bm, dense = MASKS[name]
    grid = create_mask(mod, Bm, None, T, T, device="cpu")  # (Bm or 1, 1, T, T), evaluated densely
    assert torch.equal(grid, dense.expand_as(grid))


def test_mask_mod_offsets_match_cached_masks():
    T_, S = 5, 12  # the last 5 of 12 positions, as with a cache
    grid = create_mask(causal_mask_mod(S - T_), None, None, T_, S, device="cpu")[0, 0]
    assert torch.equal(grid, causal_mask(T_, S))
    grid = create_mask(sliding_window_mask_mod(4, S - T_), None, None, T_, S, device="cpu")[0, 0]
    assert torch.equal(grid, sliding_window_mask(T_, 4, S))


def test_bad_arguments_raise_one_clear_line():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout=0.1"):
        flex_attention_backend(q, k, v, dropout=0.1)
    with pytest.raises(ValueError, match="cannot return attention weights"):
        flex_attention_backend(q, k, v, return_weights=True)
    with pytest.raises(ValueError, match="doc_ids must be"):
        document_mask_mod(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="order must be a permutation"):
        permutation_mask_mod(torch.tensor([0, 0, 1]))
    bm = create_block_mask_cheap(8, 8)
    with pytest.raises(ValueError, match="does not match T=8, S=9"):
        check_mask(bm, 1, 1, 8, 9)
    check_mask(bm, 1, 1, 8, 8)


def create_block_mask_cheap(T_, S):
    return block_mask(causal_mask_mod(S - T_), None, None, T_, S)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MASKS))
def test_flex_masks_equal_dense_eager(name):
    mod, Bm, dense = MASKS[name]
    q, k, v = qkv(K=2)  # GQA: 4 query heads on 2 kv heads
    ref, _ = eager_attention(q, k, v, mask=dense)
    out, _ = flex_attention_backend(q, k, v, mask=block_mask(mod, Bm, None, T, T))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    if name == "permutation_query":  # the first token in the order sees nothing: zeros, as eager
        assert out[:, :, ORDER[0]].abs().max() == 0


@pytest.mark.slow
@pytest.mark.parametrize("D, T_", [(8, 8), (16, 24), (16, 56)])
def test_small_head_dims_equal_eager(D, T_):
    """Head dims and lengths where PyTorch 2.13's compiled CPU kernel gave wrong rows (the last
    batch and head) on an AVX2-only CPU: padded to CPU_MIN_HEAD_DIM features by the backend,
    they give eager's numbers."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, T_, D) for _ in range(3))
    alibi, pos = ALiBi(4), torch.arange(T_)
    ref, _ = eager_attention(q, k, v, bias=alibi.score_bias(pos, pos), is_causal=True)
    out, _ = flex_attention_backend(q, k, v, bias=alibi.score_mod(pos, pos), is_causal=True)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("pos2d", [False, True], ids=["same_rows", "per_row"])
def test_alibi_score_mod_equals_dense_bias(pos2d):
    alibi = ALiBi(H)
    pos = torch.arange(T)
    if pos2d:  # left padding: row 1 starts 3 positions late (the positions go negative first)
        pos = torch.stack([pos, pos - 3])  # (B, T)
    q, k, v = qkv()
    ref, _ = eager_attention(q, k, v, bias=alibi.score_bias(pos, pos), is_causal=True)
    out, _ = flex_attention_backend(q, k, v, bias=alibi.score_mod(pos, pos), is_causal=True)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_t5_score_mod_equals_dense_bias(bidirectional):
    torch.manual_seed(0)
    t5 = T5Bias(H, num_buckets=8, max_distance=20, bidirectional=bidirectional)
    T_, S = 9, T  # the last 9 of 37 positions (a cache prefill): T != S, distances past 20
    q, k, v = qkv(T_=T_, S=S)
    q_pos, k_pos = torch.arange(S - T_, S), torch.arange(S)
    with torch.no_grad():
        bias = t5.score_bias(q_pos, k_pos)
        mod = t5.score_mod(q_pos, k_pos, bound=S)
        ref, _ = eager_attention(q, k, v, bias=bias, is_causal=not bidirectional, scale=1.0)
        out, _ = flex_attention_backend(q, k, v, bias=mod, is_causal=not bidirectional, scale=1.0)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_dense_mask_and_bias_tensors_are_read_as_given():
    """The fallback: a dense bool mask and a dense float bias, as the sdpa/eager backends get."""
    q, k, v = qkv(K=1)  # MQA
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 30:] = False  # row 1 has 7 padding keys
    mask = keep[:, None, None, :]  # (B, 1, 1, S)
    bias = torch.randn(B, H, T, T)
    ref, _ = eager_attention(q, k, v, mask=mask, bias=bias, is_causal=True)
    out, _ = flex_attention_backend(q, k, v, mask=mask, bias=bias, is_causal=True)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def tiny_decoder(position, backend, window=None):
    cfg = ModelConfig(
        arch="decoder",
        d_model=32,
        n_layers=2,
        vocab_size=50,
        max_seq_len=T,
        attention=AttentionConfig(n_heads=H, n_kv_heads=2, backend=backend, sliding_window=window),
        position=position,
    )
    return build_model(cfg).eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "position,window", [("alibi", None), ("t5_bias", None), ("alibi", 6)], ids=str
)
def test_decoder_through_flex_equals_eager(position, window):
    """ALiBi (BLOOM-style: see tests/interop/hf/test_bloom.py) and T5 decoders: same logits."""
    torch.manual_seed(0)
    eager = tiny_decoder(position, "eager", window)
    flex = tiny_decoder(position, "flex", window)
    flex.load_state_dict(eager.state_dict())
    assert flex.positions.bias_form == "score_mod" and eager.positions.bias_form == "tensor"
    ids = torch.randint(0, 50, (B, T))
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[1, :4] = False  # left padding in row 1
    with torch.no_grad():
        for mask in (None, pad):
            ref = eager(ids, attention_mask=mask)
            out = flex(ids, attention_mask=mask)
            keep = slice(None) if mask is None else mask
            torch.testing.assert_close(out[keep], ref[keep], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("position", ["alibi", "t5_bias"])
def test_attention_maps_of_a_flex_model_equal_the_eager_models(position):
    """capture_attention on a flex layer: its score_mod becomes the dense bias eager draws with."""
    torch.manual_seed(0)
    eager = tiny_decoder(position, "eager")
    flex = tiny_decoder(position, "flex")
    flex.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 50, (B, T))
    with torch.no_grad():
        with capture_attention(eager) as want, capture_attention(flex) as got:
            eager(ids)
            flex(ids)
    assert list(got.weights["decoder_self"]) == list(want.weights["decoder_self"]) == [0, 1]
    for layer, probs in want.weights["decoder_self"].items():
        torch.testing.assert_close(got.weights["decoder_self"][layer], probs, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.hf
def test_hf_t5_logits_through_flex(tmp_path):
    transformers = pytest.importorskip("transformers")
    from attnlab.interop.hf import load_hf
    from tests.interop.helpers import ATOL as HF_ATOL
    from tests.interop.helpers import VOCAB, max_diff, padded_batch

    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=VOCAB
    )
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    ours, cfg = load_hf(tmp_path)
    flex = build_model(replace(cfg, attention=replace(cfg.attention, backend="flex"))).eval()
    flex.load_state_dict(ours.state_dict())
    src, src_mask = padded_batch(T=11, seed=5)
    tgt, tgt_mask = padded_batch(T=7, seed=6, lengths=(7, 4, 2))
    with torch.no_grad():
        ref = hf(
            input_ids=src,
            attention_mask=src_mask.long(),
            decoder_input_ids=tgt,
            decoder_attention_mask=tgt_mask.long(),
        ).logits
        out = flex(src, tgt, attention_mask=src_mask, decoder_attention_mask=tgt_mask)
    assert max_diff(out, ref, tgt_mask) <= HF_ATOL


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
def test_alibi_gradients_equal_dense_eager_on_gpu():
    alibi = ALiBi(H).cuda()
    pos = torch.arange(T, device="cuda")
    q, k, v = (t.requires_grad_() for t in qkv(K=2, device="cuda"))
    ref, _ = eager_attention(q, k, v, bias=alibi.score_bias(pos, pos), is_causal=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    out, _ = flex_attention_backend(q, k, v, bias=alibi.score_mod(pos, pos), is_causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=0)


def _captured_tensors(fn):
    """Every tensor a function closes over, following closures of closures (the readers)."""
    found = []
    for cell in fn.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif callable(value) and getattr(value, "__closure__", None):
            found += _captured_tensors(value)
    return found


@pytest.mark.parametrize("scheme", [ALiBi(H), T5Bias(H, bidirectional=False)], ids=type)
def test_score_mod_form_builds_nothing_quadratic(scheme):
    """The prepared score_mod holds O(T + S) numbers per head, never the (H, T, S) bias."""
    S = 64
    scheme.bias_form = "score_mod"
    pos = torch.arange(S)
    terms = scheme.prepare(pos, pos, bound=S)
    assert callable(terms.bias)
    sizes = [t.numel() for t in _captured_tensors(terms.bias)]
    assert sizes and max(sizes) <= H * 2 * S


@pytest.mark.slow
@pytest.mark.parametrize("position", ["alibi", "t5_bias"])
def test_cached_greedy_decoding_through_flex_equals_eager(position):
    from attnlab.inference.config import GenerationConfig
    from attnlab.inference.generate import generate
    from attnlab.inference.sampling import SamplingConfig

    torch.manual_seed(0)
    eager = tiny_decoder(position, "eager")
    flex = tiny_decoder(position, "flex")
    flex.load_state_dict(eager.state_dict())
    prompts, greedy = [[1, 2, 3, 4], [5, 6]], SamplingConfig(temperature=0.0)
    ref = generate(eager, prompts, GenerationConfig(6, greedy, max_total_len=16))
    out = generate(flex, prompts, GenerationConfig(6, greedy, max_total_len=16))
    assert out == ref


@pytest.mark.slow
def test_attention_layer_takes_a_block_mask_in_its_context():
    """A document BlockMask reaches an Attention layer through AttentionContext.mask."""
    from attnlab.components.attention import Attention
    from attnlab.components.context import AttentionContext

    torch.manual_seed(0)
    eager = Attention(32, H, n_kv_heads=2, backend="eager").eval()
    flex = Attention(32, H, n_kv_heads=2, backend="flex").eval()
    flex.load_state_dict(eager.state_dict())
    x = torch.randn(B, T, 32)
    ids = doc_ids()
    blocks = block_mask(document_mask_mod(ids), B, None, T, T)
    with torch.no_grad():
        ref = eager(x, AttentionContext(mask=dense_document_mask(ids)))
        out = flex(x, AttentionContext(mask=blocks))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


# --- training on CPU: the flex backend's backward is flash.py's recomputing one ---------------


@pytest.mark.parametrize(
    "position,mask_name",
    [("alibi", "causal"), ("t5_bias", "document"), ("t5_bias", "sliding_window_5")],
)
def test_flex_gradients_on_cpu_equal_dense_eager(position, mask_name):
    """q, k, v (and T5's table) gradients within 1e-4 of eager with the dense bias and mask."""
    torch.manual_seed(0)
    scheme = ALiBi(H) if position == "alibi" else T5Bias(H, 8, max_distance=20, bidirectional=False)
    pos = torch.arange(T)
    mod, Bm, dense = MASKS[mask_name]
    q, k, v = (t.requires_grad_() for t in qkv(K=2))  # GQA, T = 37 (odd)
    learned = list(scheme.parameters())  # T5's table; none for ALiBi
    ref, _ = eager_attention(q, k, v, mask=dense, bias=scheme.score_bias(pos, pos))
    blocks = block_mask(mod, Bm, None, T, T)
    out, _ = flex_attention_backend(q, k, v, mask=blocks, bias=scheme.score_mod(pos, pos, T))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v, *learned], d_out)
    ref_grads = torch.autograd.grad(ref, [q, k, v, *learned], d_out)
    assert len(grads) == 3 + len(learned)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=0)


def test_flex_dense_bias_gradient_on_cpu_equals_eager():
    """The dense fallback trains too: a learned (B, H, T, S) bias tensor gets dS."""
    q, k, v = (t.requires_grad_() for t in qkv(K=1))
    bias = torch.randn(B, H, T, T, requires_grad=True)
    ref, _ = eager_attention(q, k, v, bias=bias, is_causal=True)
    out, _ = flex_attention_backend(q, k, v, bias=bias, is_causal=True)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, bias))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=0)


@pytest.mark.parametrize("position", ["alibi", "t5_bias"])
def test_flex_decoder_trains_on_cpu_like_its_eager_twin(position):
    """Three AdamW steps: every parameter equals the eager-built twin's within 1e-4."""
    torch.manual_seed(0)
    eager = tiny_decoder(position, "eager").train()
    flex = tiny_decoder(position, "flex").train()
    flex.load_state_dict(eager.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, flex)]
    ids = torch.randint(0, 50, (B, T))
    for _ in range(3):
        for model, opt in zip((eager, flex), opts, strict=True):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    want, got = dict(eager.named_parameters()), dict(flex.named_parameters())
    assert any("relative_attention_bias" in n for n in got) == (position == "t5_bias")
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], atol=1e-4, rtol=0, msg=name)
