"""The KV cache changes the cost of decoding, never its result.

    (1) prefill + decode steps against a ModelCache give the logits of one full forward over the
        whole sequence, for every family x attention kind x position scheme x sliding window,
        with left-padded batches (a padded row is compared with a forward on that row alone)
    (2) greedy decoding picks the same tokens with and without the cache
    (3) cross-attention keys/values are projected once per source, whatever the number of steps;
        self-attention projects only the new token at each decode step
    (4) decode_step compiles with torch.compile and gives the eager logits

Shapes stay tiny (d_model 32, 2 layers, T <= 12); `derandomize` makes every run draw the same
examples, and each example seeds torch from a drawn integer.
"""

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.components.kv_cache import ModelCache
from attnlab.inference.beam import beam_search
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate, stream_tokens
from attnlab.inference.sampling import SamplingConfig
from attnlab.inference.steps import decode_step, left_pad, prefill
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig, RopeConfig
from attnlab.models.presets import get_preset
from tests.compile_helpers import needs_compiler

FAMILIES = ["decoder", "encoder_decoder"]
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}  # with 4 query heads
POSITIONS = ["learned", "sinusoidal", "rope_half", "rope_interleaved", "alibi", "t5_bias"]
MAX_T = 12  # prompt + new tokens; also the learned/sinusoidal table size
VOCAB = 23
ATOL = 1e-5
GREEDY = SamplingConfig(temperature=0.0)

PROPERTY = settings(
    max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: reproducible, and no threads spinning against each other on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(
    family: str, position: str, kind: str = "gqa", window: int | None = None, backend: str = "sdpa"
) -> ModelConfig:
    return ModelConfig(
        arch=family,
        d_model=32,
        n_layers=2,
        vocab_size=VOCAB,
        max_seq_len=MAX_T,
        d_ff=32,
        attention=AttentionConfig(
            n_heads=4, n_kv_heads=KV_HEADS[kind], sliding_window=window, backend=backend
        ),
        position="rope" if position.startswith("rope") else position,
        rope=RopeConfig(layout="interleaved" if position == "rope_interleaved" else "half"),
        # Few buckets, so distances up to MAX_T reach T5's log-spaced buckets too.
        t5_num_buckets=8,
        t5_max_distance=10,
    )


@st.composite
def cases(draw):
    """kind, window, backend, prompt lengths (1-3 rows), new tokens, source lengths, seed."""
    n_new = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, MAX_T - n_new), min_size=1, max_size=3))
    total = max(lengths) + n_new
    window = draw(st.one_of(st.none(), st.integers(1, total - 1)))  # shorter than the sequence
    src_lengths = draw(st.lists(st.integers(1, 8), min_size=len(lengths), max_size=len(lengths)))
    return dict(
        kind=draw(st.sampled_from(sorted(KV_HEADS))),
        window=window,
        backend=draw(st.sampled_from(["sdpa", "eager"])),
        lengths=lengths,
        n_new=n_new,
        src_lengths=src_lengths,
        seed=draw(st.integers(0, 2**16)),
    )


def build(family: str, position: str, case: dict):
    torch.manual_seed(case["seed"])
    cfg = tiny_config(family, position, case["kind"], case["window"], case["backend"])
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(case["seed"])
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in case["lengths"]]
    new = torch.randint(0, VOCAB, (len(prompts), case["n_new"]), generator=g)  # (B, N)
    src = src_mask = None
    if family == "encoder_decoder":  # right-padded sources of different lengths
        src_lengths = case["src_lengths"]
        src = torch.randint(0, VOCAB, (len(prompts), max(src_lengths)), generator=g)  # (B, M)
        src_mask = torch.arange(src.shape[1])[None, :] < torch.tensor(src_lengths)[:, None]
    return model, prompts, new, src, src_mask


def full_forward(model, ids: list[int], src_row) -> torch.Tensor:
    """Logits (T, V) of one row alone, no padding anywhere, no cache."""
    x = torch.tensor([ids])
    if src_row is None:
        return model(x)[0]
    return model(src_row[None], x)[0]


def source_row(src, src_mask, b):
    return None if src is None else src[b, src_mask[b]]  # the real source tokens of row b


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(case=cases())
@torch.no_grad()
def test_cached_prefill_and_decode_equal_the_full_forward(family, position, case):
    model, prompts, new, src, src_mask = build(family, position, case)
    ids, mask = left_pad(prompts)  # (B, T0)
    B, T0 = ids.shape
    N = new.shape[1]
    memory = None if src is None else model.encode(src, src_mask)
    key_valid = torch.cat([mask, mask.new_ones(B, N)], dim=1)  # (B, T0 + N)
    cache = ModelCache.for_decoder(
        getattr(model, "decoder", model), key_valid, cross=memory is not None
    )
    steps = [prefill(model, ids, cache, memory, src_mask)]  # (B, T0, V)
    for i in range(N):  # teacher-forced: feed the drawn tokens one at a time
        slot = torch.tensor([T0 + i])
        steps.append(decode_step(model, new[:, i : i + 1], slot, cache, src_mask)[:, None])
    cached = torch.cat(steps, dim=1)  # (B, T0 + N, V)
    for b, p in enumerate(prompts):
        ref = full_forward(model, p + new[b].tolist(), source_row(src, src_mask, b))
        got = cached[b, T0 - len(p) :]  # the real positions of a left-padded row
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(case=cases())
@torch.no_grad()
def test_greedy_tokens_are_the_same_with_and_without_the_cache(family, position, case):
    model, prompts, _, src, src_mask = build(family, position, case)
    N = case["n_new"]
    got = generate(model, prompts, GenerationConfig(N, GREEDY), source=src, source_mask=src_mask)
    for b, p in enumerate(prompts):
        seq = list(p)
        for _ in range(N):  # the definition: argmax of a full forward over everything so far
            seq.append(int(full_forward(model, seq, source_row(src, src_mask, b))[-1].argmax()))
        assert got[b] == seq[len(p) :], (b, p)


class CallCounter:
    """Forward hooks on Linear layers: calls and the token count T of each call."""

    def __init__(self, modules):
        self.calls = {m: [] for m in modules}
        self.handles = [m.register_forward_hook(self.hook) for m in modules]

    def hook(self, module, args, out):
        self.calls[module].append(args[0].shape[1])  # (B, T, C): T tokens projected

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("position", ["t5_bias", "sinusoidal"])
def test_cross_attention_keys_and_values_are_projected_once_per_source(position):
    torch.manual_seed(0)
    model = build_model(tiny_config("encoder_decoder", position)).eval()
    blocks = model.decoder.blocks
    cross = [p for b in blocks for p in (b.cross_attn.k_proj, b.cross_attn.v_proj)]
    self_k = [b.self_attn.k_proj for b in blocks]
    src = torch.randint(0, VOCAB, (2, 7))
    src_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    counter = CallCounter(cross + self_k)
    out = generate(model, [[1], [2]], GenerationConfig(6, GREEDY), source=src, source_mask=src_mask)
    counter.remove()
    assert [len(r) for r in out] == [6, 6]
    for proj in cross:
        assert counter.calls[proj] == [7], "cross K/V must come from the cache after the prefill"
    for proj in self_k:  # prefill projects the prompt, then each step only its new token
        assert counter.calls[proj] == [1] + [1] * 5

    counter = CallCounter(cross)  # beam search reorders the cached K/V, never recomputes them
    beam_search(
        model, [[1]], GenerationConfig(6, num_beams=3), source=src[:1], source_mask=src_mask[:1]
    )
    counter.remove()
    assert all(counter.calls[proj] == [7] for proj in cross)


@pytest.mark.slow
@needs_compiler
@torch.no_grad()
def test_decode_step_compiles_and_equals_eager():
    """torch.compile(decode_step): the cache's static shapes mean one compile serves every step.

    Cold (empty inductor cache) this compile took about 35-60 s on 2 shared CPU cores, hence `slow`.
    The token-id check in TokenEmbedding (a host sync) runs in eager mode only: one graph.
    """
    torch.manual_seed(0)
    cfg = replace(
        get_preset("llama-tiny"), d_model=32, n_layers=1, d_ff=64, vocab_size=VOCAB, max_seq_len=16
    )
    model = build_model(cfg).eval()
    prompts = [[1, 2, 3, 4], [5, 6]]
    torch._dynamo.reset()
    compiled = torch.compile(decode_step)
    eager_tokens = generate(model, prompts, GenerationConfig(5, GREEDY))
    streamed = torch.stack(
        list(stream_tokens(model, prompts, GenerationConfig(5, GREEDY), step_fn=compiled)), 1
    )
    assert streamed.tolist() == eager_tokens

    # Logits step by step, compiled vs eager, against two caches filled by the same prefill.
    ids, mask = left_pad(prompts)
    key_valid = torch.cat([mask, mask.new_ones(2, 5)], dim=1)
    caches = [ModelCache.for_decoder(model, key_valid) for _ in range(2)]
    logits = [prefill(model, ids, c)[:, -1] for c in caches]
    with torch._dynamo.config.patch(error_on_recompile=True):  # a new slot is not a new graph
        for i in range(4):
            token = torch.multinomial(torch.softmax(logits[0], -1), 1)  # (B, 1)
            slot = torch.tensor([ids.shape[1] + i])
            logits = [
                compiled(model, token, slot, caches[0]),
                decode_step(model, token, slot, caches[1]),
            ]
            torch.testing.assert_close(logits[0], logits[1], atol=ATOL, rtol=0)
