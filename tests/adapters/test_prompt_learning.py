"""Prefix tuning and prompt tuning against `peft` on tiny HF GPT-2 and Llama models (built from
configs; nothing downloads): logits from the same prefix within 1e-5 both ways through the PEFT
format, the KV cache (cached batched greedy equals uncached), and what trains."""

import json
from dataclasses import replace

import pytest
import torch

from attnlab.adapters.prompt_learning import PromptLearningLM
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.interop.hf import load_hf
from attnlab.interop.peft import load_prompt_learning, save_prompt_learning
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.serve.engine import Engine
from attnlab.serve.sequential import SequentialEngine
from attnlab.serve.types import EngineConfig, Request, SamplingParams

T = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, ATOL = 128, 1e-5
FAMILIES = {
    "gpt2": ("GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "llama": (  # GQA: the prefix has the kv heads' width
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
    ),
}
METHODS = [("prefix", 0), ("prefix", 16), ("prompt", 0)]  # (method, prefix_projection)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def base(request, tmp_path_factory):
    cls, kwargs = FAMILIES[request.param]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    config_cls = getattr(T, cls.replace("LMHeadModel", "Config").replace("ForCausalLM", "Config"))
    getattr(T, cls)(config_cls(vocab_size=VOCAB, **kwargs)).save_pretrained(path)
    return request.param, path


def peft_model(family, path, method, projection):
    hf = getattr(T, FAMILIES[family][0]).from_pretrained(path).eval()
    if method == "prefix":
        config = peft.PrefixTuningConfig(
            task_type="CAUSAL_LM",
            num_virtual_tokens=3,
            prefix_projection=bool(projection),
            encoder_hidden_size=projection or None,
        )
    else:
        config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    return peft.get_peft_model(hf, config).eval()


def ids(B=2, n=7, seed=1):
    return torch.randint(3, VOCAB, (B, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.hf
@pytest.mark.parametrize(("method", "projection"), METHODS)
def test_peft_prefix_loads_into_attnlab_and_back_with_the_same_logits(
    base, tmp_path, method, projection
):
    """peft's model (its prefix through the MLP when prefix_projection) saved, loaded here: the
    same logits on the input's tokens; saved here, loaded by peft: the same again."""
    family, path = base
    theirs = peft_model(family, path, method, projection)
    theirs.save_pretrained(tmp_path / "peft")
    model, cfg = load_hf(path)
    ours = load_prompt_learning(model, cfg, tmp_path / "peft").eval()
    x = ids()
    with torch.no_grad():
        expected = theirs(input_ids=x).logits[:, -x.shape[1] :]  # peft: the virtual ones too
        assert (ours(x) - expected).abs().max() <= ATOL
        assert (model(x) - expected).abs().max() > 1e-3  # the prefix matters
    save_prompt_learning(ours, cfg, tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(
        getattr(T, FAMILIES[family][0]).from_pretrained(path).eval(), tmp_path / "ours"
    ).eval()
    with torch.no_grad():
        assert (back(input_ids=x).logits[:, -x.shape[1] :] - expected).abs().max() <= ATOL


@pytest.mark.hf
def test_a_prefix_trained_here_with_its_mlp_equals_peft_given_the_same_mlp(base):
    """The reparametrisation itself: the same embedding and MLP weights in both give the same
    logits (peft's training-mode prefix encoder)."""
    family, path = base
    theirs = peft_model(family, path, "prefix", 16)
    ours = PromptLearningLM(load_hf(path)[0], "prefix", 3, prefix_projection=16).eval()
    encoder = theirs.prompt_encoder["default"]
    with torch.no_grad():
        ours.embedding.weight.copy_(encoder.embedding.weight)
        ours.transform.load_state_dict(encoder.transform.state_dict())
        x = ids(seed=2)
        assert (ours(x) - theirs(input_ids=x).logits).abs().max() <= ATOL


@pytest.mark.hf
def test_llama_in_the_interleaved_rope_layout_takes_peft_prefix(base, tmp_path):
    """Our q/k rows permuted (layout "interleaved"): the keys of the prefix follow them."""
    family, path = base
    if family != "llama":
        pytest.skip("GPT-2 has no RoPE layout")
    theirs = peft_model(family, path, "prefix", 0)
    theirs.save_pretrained(tmp_path)
    model, cfg = load_hf(path, layout="interleaved")
    ours = load_prompt_learning(model, cfg, tmp_path).eval()
    x = ids(seed=3)
    with torch.no_grad():
        assert (ours(x) - theirs(input_ids=x).logits).abs().max() <= ATOL


@pytest.mark.parametrize(("method", "projection"), METHODS)
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_cached_batched_greedy_equals_uncached_row_by_row(preset, method, projection):
    """Generation writes the prefix into the KV cache, then prefills the left-padded prompts
    after it: the tokens equal greedy decoding without a cache, one row at a time."""
    torch.manual_seed(0)
    model = PromptLearningLM(build_model(get_preset(preset)).eval(), method, 3, projection)
    prompts, n = [[5, 6, 7, 8, 9], [11, 12]], 5
    config = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(temperature=0))
    got = generate(model.eval(), prompts, config)
    for prompt, row in zip(prompts, got):
        x = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(n):
                x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert x[0, len(prompt) :].tolist() == row


def test_only_the_prefix_trains_and_padding_changes_nothing():
    """The decoder is frozen; the gradient reaches the prefix (and its MLP) through the cache.
    A right-padded row's logits equal the same row alone."""
    torch.manual_seed(0)
    model = PromptLearningLM(build_model(get_preset("llama-tiny")), "prefix", 4, 8)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        ["embedding.weight"] + [f"transform.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")]
    )
    x = ids(B=2, n=6)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    logits = model(x, attention_mask=mask)
    logits[mask].sum().backward()
    assert model.embedding.weight.grad.abs().max() > 0
    with torch.no_grad():
        alone = model(x[1:, :4])
    assert (logits[1:, :4] - alone).abs().max() < 1e-5


def test_an_adapter_of_another_kind_or_base_is_refused_by_name(tmp_path):
    model, cfg = build_model(get_preset("gpt2-tiny")), get_preset("gpt2-tiny")
    save_prompt_learning(PromptLearningLM(model, "prompt", 2), cfg, tmp_path)
    other = replace(get_preset("llama-tiny"), d_model=32)
    with pytest.raises(ValueError, match="prompt_embeddings is \\(2, 64\\), the model needs"):
        load_prompt_learning(build_model(other), other, tmp_path)
    other = replace(cfg, n_layers=3)
    with pytest.raises(ValueError, match="is for 2 layers, the model has 3"):
        load_prompt_learning(build_model(other), other, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "IA3"}))
    with pytest.raises(ValueError, match="peft_type='IA3', not one of"):
        load_prompt_learning(build_model(cfg), cfg, tmp_path)


def test_the_sequential_server_engine_serves_a_prefix_as_generate_does():
    """`attnlab serve --engine sequential` on a prefix-tuning run: its requests go through
    `fill_cache`, which writes the prefix first, so its tokens are generate's."""
    torch.manual_seed(0)
    model = PromptLearningLM(build_model(get_preset("gpt2-tiny")).eval(), "prefix", 3).eval()
    engine = SequentialEngine(model, None, EngineConfig(max_context=32))
    events = []
    engine.start()
    engine.submit(
        Request("a", (5, 6, 7), SamplingParams(max_tokens=6, temperature=0)), events.append
    )
    engine.stop(30)  # lets the request finish first
    got = [e.token_id for e in events if e.token_id is not None]
    assert (
        got == generate(model, [[5, 6, 7]], GenerationConfig(6, SamplingConfig(temperature=0)))[0]
    )


@pytest.mark.parametrize(("method", "projection"), [("prefix", 0), ("prompt", 0)])
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_the_batched_engine_serves_a_prefix_as_generate_does(preset, method, projection):
    """The continuous-batching engine writes the prefix into each sequence's first blocks (3
    positions: not a whole block of 4), then its prompt in chunks after it: concurrent greedy
    requests are token-identical to generate run on each alone."""
    torch.manual_seed(0)
    model = PromptLearningLM(build_model(get_preset(preset)).eval(), method, 3, projection).eval()
    config = EngineConfig(max_batch=4, block_size=4, prefill_chunk=5, max_context=40)
    engine = Engine(model, None, config)
    prompts = [(5, 6, 7, 8, 9, 10, 11), (12, 13), (5, 6, 7, 8, 9, 10, 11, 12, 13, 14)]
    events = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        request = Request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0))
        engine.submit(request, events[i].append)
    while engine.step():
        pass
    greedy = GenerationConfig(6, SamplingConfig(temperature=0))
    for i, p in enumerate(prompts):
        got = [e.token_id for e in events[i] if e.token_id is not None]
        assert got == generate(model, [list(p)], greedy)[0], i
    with torch.no_grad():  # the prefix matters
        x = torch.tensor([prompts[0]])
        assert (model(x) - model.decoder(x)).abs().max() > 1e-3
