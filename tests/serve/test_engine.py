"""The continuous-batching Engine against `attnlab.inference.generate` run on each request alone
(the reference), plus its bookkeeping: blocks back in the pool, the queue bound, faults that stay
with their request, prompt log-probabilities against the model's own log-softmax.

Most tests drive an engine that was never started by calling `step()` until it is idle: the same
code the loop thread runs, deterministic and without sleeps."""

import dataclasses
import random
import threading

import pytest
import torch

import attnlab.serve.engine as engine_module
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.serve.engine import Engine
from attnlab.serve.types import EngineConfig, EngineStopped, QueueFull, Request, SamplingParams

V = 256  # vocabulary of the tiny presets


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return build_model(get_preset("llama-tiny")).eval()


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(1)
    return build_model(get_preset("gpt2-tiny")).eval()


class Collector:
    """on_event callbacks that keep every request's events."""

    def __init__(self):
        self.events = {}

    def __call__(self, rid):
        self.events[rid] = []
        return self.events[rid].append

    def tokens(self, rid):
        return [e.token_id for e in self.events[rid] if e.token_id is not None]

    def reason(self, rid):
        finals = [e.finish_reason for e in self.events[rid] if e.finish_reason is not None]
        assert len(finals) == 1, f"{rid}: {len(finals)} final events"
        assert self.events[rid][-1].finish_reason is not None, "the final event comes last"
        return finals[0]


def mixed_requests(n, seed=0, **params):
    """n requests with prompts of 1-40 tokens and 1-20 new tokens."""
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}",
            tuple(rng.randrange(V) for _ in range(rng.randint(1, 40))),
            SamplingParams(max_tokens=rng.randint(1, 20), **params),
        )
        for i in range(n)
    ]


def run(engine, requests, collector=None, every_step=None):
    """Submit all, step until idle; returns the collector and the most requests run at once."""
    collector = collector or Collector()
    for r in requests:
        engine.submit(r, collector(r.request_id))
    most = 0
    while engine.step():
        most = max(most, engine.stats()["running"])
        if every_step is not None:
            every_step()
    return collector, most


def alone(model, request):
    """The reference: one request through `generate`, as a user would run it."""
    p = request.params
    config = GenerationConfig(
        p.max_tokens,
        p.sampling(),
        stop_tokens=p.stop_token_ids,
        seed=p.seed,
        min_new_tokens=p.min_tokens,
    )
    return generate(model, [list(request.prompt_ids)], config)[0]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_batched_equals_alone(name, request):
    """16 concurrent greedy requests of different prompt and output lengths: token-identical to
    each one run alone, with prompts prefilled in chunks while others decode."""
    model = request.getfixturevalue(name)
    engine = Engine(
        model, None, EngineConfig(max_batch=16, block_size=4, prefill_chunk=16, max_context=128)
    )
    requests = mixed_requests(16, temperature=0.0)
    got, most = run(engine, requests)
    assert most == 16, "all 16 ran in one batch"
    for r in requests:
        assert got.tokens(r.request_id) == alone(model, r), r.request_id
        assert got.reason(r.request_id) == "length"
    assert engine.stats()["generation_tokens_total"] == sum(r.params.max_tokens for r in requests)


def test_seeded_sampling_batched_equals_alone(llama):
    """Temperature and top-p with a per-request seed: the same tokens batched or alone."""
    requests = [
        Request(r.request_id, r.prompt_ids, SamplingParams(r.params.max_tokens, 0.9, 0.8, seed=i))
        for i, r in enumerate(mixed_requests(16, seed=1))
    ]
    got, _ = run(
        Engine(llama, None, EngineConfig(block_size=8, prefill_chunk=32, max_context=128)), requests
    )
    for r in requests:
        assert got.tokens(r.request_id) == alone(llama, r), r.request_id


# Every sampler setting, one per request: the engine batches them into one sampling call.
SAMPLERS = [
    dict(temperature=0.0, repetition_penalty=1.8),
    dict(temperature=0.9, top_k=5),
    dict(temperature=1.2, min_p=0.2),
    dict(temperature=0.8, presence_penalty=1.5, frequency_penalty=0.7),
    dict(temperature=1.0, logit_bias=((7, 5.0), (8, -100.0))),
    dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    dict(temperature=0.0, frequency_penalty=-1.0, logit_bias=((3, 2.0),)),
    dict(temperature=1.0, top_p=0.5, stop_token_ids=(11, 12), min_tokens=6),
]


def test_mixed_samplers_batched_equal_each_alone(llama):
    """8 requests, each with its own sampler (greedy and seeded, every processor): batched in
    one step's sampling call, each gives the tokens `generate` gives it alone."""
    requests = [
        Request(r.request_id, r.prompt_ids[:12], SamplingParams(8, seed=i, **kw))
        for i, (r, kw) in enumerate(zip(mixed_requests(8, seed=6), SAMPLERS))
    ]
    engine = Engine(llama, None, EngineConfig(block_size=8, prefill_chunk=320, max_context=128))
    got, most = run(engine, requests)
    assert most == 8
    for r in requests:
        assert got.tokens(r.request_id) == alone(llama, r), (r.request_id, r.params)


def test_a_batched_sampling_call_that_raises_is_rerun_row_by_row(llama, monkeypatch):
    real = engine_module.filter_logits
    failed = []

    def flaky(logits, *args):
        if logits.shape[0] > 1 and not failed:
            failed.append(True)
            raise RuntimeError("transient")
        return real(logits, *args)

    monkeypatch.setattr(engine_module, "filter_logits", flaky)
    requests = mixed_requests(4, seed=7, temperature=0.0, repetition_penalty=1.5, top_k=10)
    got, _ = run(Engine(llama, None, EngineConfig(block_size=4, max_context=128)), requests)
    assert failed
    for r in requests:
        assert got.tokens(r.request_id) == alone(llama, r)


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"top_k": 20, "presence_penalty": 1}])
def test_a_full_pool_preempts_and_stays_exact(llama, params):
    """A pool of 64 tokens under 8 requests of up to 60: the newest running ones are preempted
    and recomputed (scheduler.py, rule 2), yet every request gets exactly its own tokens (greedy,
    or seeded sampling), each token once, no error; first admissions are FCFS; the pool ends
    empty."""
    requests = [
        dataclasses.replace(r, params=dataclasses.replace(r.params, seed=i))  # seeded: exact
        for i, r in enumerate(mixed_requests(8, seed=2, **params))
    ]
    engine = Engine(llama, None, EngineConfig(block_size=4, n_blocks=16, prefill_chunk=8))
    order = []
    got, most = run(
        engine,
        requests,
        every_step=lambda: order.extend(
            s.id for s in engine.scheduler.running if s.id not in order
        ),
    )
    assert engine.stats()["preemptions_total"] > 0 and most > 1
    assert order == [r.request_id for r in requests], "admitted first come, first served"
    for r in requests:
        assert got.tokens(r.request_id) == alone(llama, r)
        assert got.reason(r.request_id) == "length"
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_request_the_whole_pool_cannot_hold_is_refused(llama):
    """Alone it would need more blocks than the pool has: refused at submit, in one line."""
    engine = Engine(llama, None, EngineConfig(block_size=4, n_blocks=4))
    with pytest.raises(
        ValueError, match=r"room for 17 tokens, more than the whole KV pool holds \(16\)"
    ):
        engine.submit(Request("a", (1,) * 7, SamplingParams(max_tokens=10)), print)
    engine.submit(Request("b", (1,) * 6, SamplingParams(max_tokens=10)), print)  # 16: fits


def test_stop_token_ends_the_request(gpt2):
    """A stop token id ends the request at (and with) that token, reason "stop"."""
    base = Request("a", (5, 6, 7), SamplingParams(max_tokens=12, temperature=0.0))
    full = alone(gpt2, base)
    stop = full[3]
    req = Request("a", base.prompt_ids, SamplingParams(12, 0.0, stop_token_ids=(stop,)))
    got, _ = run(Engine(gpt2, None), [req])
    assert got.tokens("a") == full[: full.index(stop) + 1]
    assert got.reason("a") == "stop"


class Letters:
    """A stand-in tokenizer: token i is the letter 'a' + i % 26."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_string_ends_the_request(gpt2):
    """A stop string (text of two tokens) ends the request with the token completing it."""
    base = Request("a", (9, 8, 7), SamplingParams(max_tokens=12, temperature=0.0))
    full = alone(gpt2, base)
    stop = Letters().decode(full[4:6])
    req = Request("a", base.prompt_ids, SamplingParams(12, 0.0, stop=(stop,)))
    got, _ = run(Engine(gpt2, Letters()), [req])
    text = Letters().decode(full)
    n = next(i for i in range(1, 13) if stop in text[:i])  # tokens until the string appears
    assert got.tokens("a") == full[:n]
    assert got.reason("a") == "stop"


def test_cancellations_leak_no_blocks(llama):
    """Cancel running and waiting requests at different steps: each gets one final "cancelled"
    event, the others finish, and every block is back in the pool."""
    requests = mixed_requests(12, seed=3, temperature=0.0)
    engine = Engine(
        llama, None, EngineConfig(max_batch=4, block_size=4, n_blocks=64, prefill_chunk=8)
    )
    steps = 0

    def cancel_some():
        nonlocal steps
        steps += 1
        if steps in (2, 5, 9):
            for rid in (f"r{steps}", f"r{steps + 1}"):  # running ones and waiting ones
                engine.cancel(rid)

    got, _ = run(engine, requests, every_step=cancel_some)
    cancelled = {"r2", "r3", "r5", "r6", "r9", "r10"}
    for r in requests:
        reason = got.reason(r.request_id)
        if r.request_id in cancelled and reason == "cancelled":
            continue
        assert reason == "length" and got.tokens(r.request_id) == alone(llama, r)
    assert sum(got.reason(r) == "cancelled" for r in cancelled) >= 4
    assert engine.cache.n_free == engine.cache.n_blocks and not engine.cache.tables
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0
    engine.cancel("r0")  # finished already: ignored
    assert engine.step() is False


def test_a_callback_that_raises_cancels_its_request(gpt2):
    """An on_event that raises (the client went away) ends that request as cancelled and
    frees its blocks; the engine goes on."""
    events = []

    def gone(event):
        events.append(event)
        if len(events) == 2:
            raise ConnectionError("client disconnected")

    engine = Engine(gpt2, None, EngineConfig(block_size=4))
    engine.submit(Request("gone", (1, 2, 3), SamplingParams(10, 0.0)), gone)
    other = Request("other", (4, 5), SamplingParams(6, 0.0))
    got, _ = run(engine, [other])
    assert [e.finish_reason for e in events] == [None, None, "cancelled"]
    assert got.tokens("other") == alone(gpt2, other)
    assert engine.cache.n_free == engine.cache.n_blocks


def test_queue_bound_raises_queue_full(gpt2):
    engine = Engine(gpt2, None, EngineConfig(max_queue=2))
    sink = Collector()
    for i in range(2):
        engine.submit(Request(f"q{i}", (1, 2), SamplingParams(2)), sink(f"q{i}"))
    with pytest.raises(QueueFull):
        engine.submit(Request("q2", (1, 2), SamplingParams(2)), sink("q2"))
    while engine.step():
        pass
    engine.submit(Request("q3", (1, 2), SamplingParams(2)), sink("q3"))  # room again


def test_a_failing_request_ends_with_error_and_others_finish(llama, monkeypatch):
    """Three faults in one batch: a prefill that raises, a prompt whose logits are NaN, and a
    sampling call that raises on the 3rd token. Those end with "error" (one line); the others
    give exactly their tokens alone; no block leaks."""
    RAISE, NAN = 250, 251
    decoder = llama

    def pre_hook(module, args):
        if (args[0] == RAISE).any():
            raise RuntimeError("poisoned token\nsecond line")

    def nan_hook(module, args, out):
        return torch.where((args[0] == NAN)[..., None], float("nan"), out)

    real_draw = engine_module.draw
    counts = {}

    def flaky_draw(logits, greedy, generator):
        if generator is not None and generator.initial_seed() == 13:
            counts[13] = counts.get(13, 0) + 1
            if counts[13] == 3:
                raise ValueError("sampling failed")
        return real_draw(logits, greedy, generator)

    monkeypatch.setattr(engine_module, "draw", flaky_draw)
    handles = [
        decoder.embed.register_forward_pre_hook(pre_hook),
        decoder.embed.register_forward_hook(nan_hook),
    ]
    try:
        good = mixed_requests(5, seed=4, temperature=0.0)
        bad = [
            Request("raise", (1, RAISE, 2), SamplingParams(5, 0.0)),
            Request("nan", (NAN,) + (3,) * 9, SamplingParams(5, 0.0)),
            Request("sample", (4, 5, 6), SamplingParams(8, 0.7, seed=13)),
        ]
        # A small pool, so that later requests reuse the failed requests' blocks.
        engine = Engine(llama, None, EngineConfig(block_size=4, n_blocks=40, max_context=128))
        got, _ = run(engine, good[:2] + bad + good[2:])
    finally:
        for h in handles:
            h.remove()
    for r in bad:
        assert got.reason(r.request_id) == "error"
        assert got.events[r.request_id][-1].error and "\n" not in got.events[r.request_id][-1].error
    assert got.events["raise"][-1].error == "RuntimeError: poisoned token"
    assert len(got.tokens("sample")) == 2
    for r in good:
        assert got.tokens(r.request_id) == alone(llama, r)
    assert engine.cache.n_free == engine.cache.n_blocks
    # The NaN request's blocks went back zeroed: requests that reuse them are unharmed.
    again = [Request(r.request_id + "'", (7,) * 30, r.params) for r in good]
    got, _ = run(engine, again)
    for r in again:
        assert got.tokens(r.request_id) == alone(llama, r)


def test_a_batched_step_that_raises_is_rerun_row_by_row(llama):
    """A decode step that fails once for the whole batch: every row re-runs alone and all
    requests still give exactly their tokens."""
    failed = []

    def hook(module, args):
        if args[0].shape[0] > 1 and not failed:
            failed.append(True)
            raise RuntimeError("transient")

    requests = mixed_requests(4, seed=5, temperature=0.0)
    handle = llama.embed.register_forward_pre_hook(hook)
    try:
        got, _ = run(Engine(llama, None, EngineConfig(block_size=4, max_context=128)), requests)
    finally:
        handle.remove()
    assert failed
    for r in requests:
        assert got.tokens(r.request_id) == alone(llama, r)


def test_prompt_logprobs_equal_the_models_log_softmax(gpt2):
    """Prompt log-probabilities (prefilled in chunks of 5) equal log_softmax of a full forward
    without any cache; generated tokens' logprobs and top-k likewise."""
    prompt = tuple(range(3, 20))
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=3, prompt_logprobs=True)
    got, _ = run(Engine(gpt2, None, EngineConfig(prefill_chunk=5)), [Request("p", prompt, params)])
    events = got.events["p"]
    tokens = got.tokens("p")
    with torch.no_grad():
        logp = torch.log_softmax(gpt2(torch.tensor([prompt + tuple(tokens)]))[0], -1)
    want = logp[:-1].gather(1, torch.tensor(prompt[1:] + tuple(tokens))[:, None])[:, 0]
    n = len(prompt)
    assert events[0].prompt_logprobs[0] is None and len(events[0].prompt_logprobs) == n
    torch.testing.assert_close(
        torch.tensor(events[0].prompt_logprobs[1:]), want[: n - 1], atol=1e-5, rtol=0
    )
    assert all(e.prompt_logprobs is None for e in events[1:])
    for i, e in enumerate(events):
        assert e.logprob == pytest.approx(float(want[n - 1 + i]), abs=1e-5)
        top = logp[n - 1 + i].topk(3)
        assert list(e.top_logprobs) == top.indices.tolist()
        assert e.token_id == top.indices[0]  # greedy: the most likely one


def test_prompt_logprobs_only(gpt2):
    """max_tokens=0 with prompt_logprobs (lm-eval's echo scoring): one final event, no token."""
    got, _ = run(
        Engine(gpt2, None),
        [Request("e", (1, 2, 3), SamplingParams(max_tokens=0, prompt_logprobs=True))],
    )
    (event,) = got.events["e"]
    assert event.token_id is None and event.finish_reason == "length"
    assert len(event.prompt_logprobs) == 3


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ((), SamplingParams(), "the prompt is empty"),
        ((1, V), SamplingParams(), f"token id {V} is outside the vocabulary"),
        ((1,), SamplingParams(max_tokens=0), "max_tokens must be >= 1, got 0"),
        ((1,) * 120, SamplingParams(max_tokens=10), "exceeds the model's context of 128"),
        ((1,), SamplingParams(temperature=-1.0), "temperature must be >= 0, got -1.0"),
        ((1,), SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        ((1,), SamplingParams(stop=("x",)), "stop strings need a tokenizer"),
    ],
)
def test_bad_requests_raise_one_line(gpt2, prompt, params, match):
    """Each bad request is refused at submit with a ValueError naming the value."""
    engine = Engine(gpt2, None)
    with pytest.raises(ValueError, match=match):
        engine.submit(Request("x", prompt, params), lambda e: None)
    assert engine.stats()["waiting"] == 0


def test_thread_loop_stop_and_engine_stopped(gpt2):
    """The loop thread serves a request; stop() cancels a long one; submit then raises."""
    engine = Engine(gpt2, None, EngineConfig(max_batch=2))
    done = threading.Event()
    sink = Collector()
    ends = sink("short")

    def on_short(event):
        ends(event)
        if event.finish_reason:
            done.set()

    engine.start()
    engine.submit(Request("short", (1, 2, 3), SamplingParams(4, 0.0)), on_short)
    assert done.wait(10)
    assert len(sink.tokens("short")) == 4
    engine.submit(Request("long", (1,), SamplingParams(120, 0.0)), sink("long"))
    engine.stop(timeout=0.0)
    assert sink.reason("long") in ("cancelled", "length")
    assert engine.cache.n_free == engine.cache.n_blocks
    with pytest.raises(EngineStopped):
        engine.submit(Request("late", (1,), SamplingParams()), sink("late"))


def test_prefix_cache_shares_blocks_of_a_common_prompt(llama):
    """Prompts that start with the same 20 tokens: the later ones share the first one's full
    blocks (counted in the stats), prefill only the rest, and still give exactly their tokens
    alone; every block is free at the end."""
    system = tuple(range(100, 120))
    first = Request("first", system + (1, 2), SamplingParams(4, 0.0))
    others = [
        Request(f"o{i}", system + (i, i + 1, i + 2), SamplingParams(5, 0.0)) for i in range(4)
    ]
    engine = Engine(llama, None, EngineConfig(block_size=8, max_context=128))
    got, _ = run(engine, [first])
    assert engine.stats()["prefix_cache_hits_total"] == 0
    got, _ = run(engine, others, got)
    assert engine.stats()["prefix_cache_hits_total"] == 4 * 16  # two full blocks each
    for r in [first, *others]:
        assert got.tokens(r.request_id) == alone(llama, r)
    assert engine.cache.n_free == engine.cache.n_blocks
    assert all(n == 0 for n in engine.cache.allocator.refs)


def test_prefix_cache_matches_whole_prefixes_only(llama):
    """A prompt whose second block equals a cached one but whose first block differs is no
    hit (keys depend on every token before them); nor is a prompt of exactly one cached block
    (its last token must be computed for the first logits)."""
    a = Request("a", tuple(range(1, 17)) + (50,), SamplingParams(3, 0.0))
    b = Request("b", (99,) * 8 + tuple(range(9, 17)) + (50,), SamplingParams(3, 0.0))
    c = Request("c", tuple(range(1, 9)), SamplingParams(3, 0.0))
    engine = Engine(llama, None, EngineConfig(block_size=8, max_context=128))
    got, _ = run(engine, [a])
    got, _ = run(engine, [b, c], got)
    assert engine.stats()["prefix_cache_hits_total"] == 0
    for r in (a, b, c):
        assert got.tokens(r.request_id) == alone(llama, r)


def test_prefix_cache_forgets_blocks_it_hands_out_again(llama):
    """A small pool: a cached prompt's blocks are taken by other requests, so the prompt must be
    computed again (no stale hit), and it still gives exactly its tokens."""
    a = Request("a", tuple(range(1, 20)), SamplingParams(3, 0.0))
    engine = Engine(llama, None, EngineConfig(block_size=4, n_blocks=12, max_context=128))
    got, _ = run(engine, [a])
    fill = [Request(f"f{i}", (200 + i,) * 30, SamplingParams(10, 0.0)) for i in range(2)]
    got, _ = run(engine, fill, got)
    assert ((), a.prompt_ids[:4]) not in engine.cache.prefixes, "its first block was taken"
    again = Request("a2", a.prompt_ids, a.params)
    got, _ = run(engine, [again], got)
    assert got.tokens("a2") == got.tokens("a") == alone(llama, a)
    assert engine.stats()["prefix_cache_hits_total"] == 0


def test_long_prefill_is_chunked_between_decode_steps(gpt2):
    """A 100-token prompt prefilled 16 tokens a step: it takes 7 steps to its first token, and
    the request already running gets one token in every one of them."""
    engine = Engine(gpt2, None, EngineConfig(prefill_chunk=16))
    got = Collector()
    short = Request("short", (1, 2), SamplingParams(20, 0.0))
    engine.submit(short, got("short"))
    engine.step()
    long = Request("long", tuple(range(1, 101)), SamplingParams(2, 0.0))
    engine.submit(long, got("long"))
    steps = 0
    while not got.events["long"]:
        before = len(got.events["short"])
        engine.step()
        steps += 1
        assert len(got.events["short"]) == before + 1, "the running request waited"
    assert steps == 7  # ceil(100 / 16)
    while engine.step():
        pass
    assert got.tokens("short") == alone(gpt2, short)
    assert got.tokens("long") == alone(gpt2, long)


def test_engine_arguments_are_checked(llama):
    """An encoder-decoder model, a bad setting, or a pool too small for one block is refused
    with a line that says what to do; a model without a position table is bounded by its pool."""
    with pytest.raises(ValueError, match="decoder-only models, got a"):
        Engine(build_model(get_preset("t5-tiny")), None)
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1, got 0"):
        Engine(llama, None, EngineConfig(max_context=64, prefill_chunk=0))
    with pytest.raises(ValueError, match="holds no block of 16 tokens"):
        Engine(llama, None, EngineConfig(kv_cache_memory=100))
    engine = Engine(llama, None, EngineConfig(n_blocks=4, block_size=4))  # no table: the pool
    with pytest.raises(ValueError, match=r"room for 20 tokens, more than the whole KV pool"):
        engine.submit(Request("x", (1,) * 10, SamplingParams(10)), lambda e: None)


def test_the_pool_is_sized_by_its_memory(llama):
    """kv_cache_memory bytes give that many bytes of whole blocks (keys and values of every
    layer: 2 * layers * kv heads * head_dim * 4 bytes a token in fp32); the default is the
    smaller of KV_MEMORY and KV_SHARE of the available memory."""
    from attnlab.components.paged_kv_cache import PagedKVCache
    from attnlab.serve.types import KV_MEMORY, default_kv_memory

    attn, layers = llama.blocks[0].self_attn, len(llama.blocks)
    per_token = 2 * layers * attn.n_kv_heads * attn.head_dim * 4
    assert PagedKVCache.token_bytes(llama) == per_token
    engine = Engine(llama, None, EngineConfig(block_size=4, kv_cache_memory=10 * 4 * per_token + 5))
    assert engine.cache.n_blocks == 10 and engine.cache.capacity == 40
    assert engine.cache.nbytes == 40 * per_token
    assert 0 < default_kv_memory(torch.device("cpu")) <= KV_MEMORY
    assert Engine(llama, None).cache.nbytes <= KV_MEMORY


def test_threaded_loop_with_concurrent_submitters(gpt2):
    """Four threads submit 16 requests while the loop thread runs (the server's situation):
    every request finishes once, with its tokens alone, and the pool ends empty."""
    requests = mixed_requests(16, seed=6, temperature=0.0)
    engine = Engine(gpt2, None, EngineConfig(block_size=8))
    got, finished = Collector(), threading.Semaphore(0)
    sinks = {r.request_id: got(r.request_id) for r in requests}

    def on_event(event):
        sinks[event.request_id](event)
        if event.finish_reason:
            finished.release()

    engine.start()
    submitters = [
        threading.Thread(target=lambda rs=requests[i::4]: [engine.submit(r, on_event) for r in rs])
        for i in range(4)
    ]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join()
    for _ in requests:
        assert finished.acquire(timeout=20)
    engine.stop(timeout=1.0)
    for r in requests:
        assert got.reason(r.request_id) == "length"
        assert got.tokens(r.request_id) == alone(gpt2, r)
    assert engine.stats()["kv_blocks_used"] == 0
    assert engine.stats()["requests_finished_total"] == 16
