"""components/hooks.py: hook points on every activation of the three families, against
transformers' GPT-2 (hidden states, attention probabilities) and hand-written recomputations."""

import pytest
import torch

from attnlab.components.attention import Attention
from attnlab.components.context import AttentionContext
from attnlab.components.hooks import hook_points, hooks, run_with_cache, run_with_hooks
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset

ATTN_POINTS = ("hook_q", "hook_k", "hook_v", "hook_scores", "hook_pattern", "hook_z", "hook_out")
BLOCK_POINTS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post")


def model_of(preset: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(get_preset(preset)).eval()


def forward(model, preset, ids):
    return model(ids, ids) if preset == "t5-tiny" else model(ids)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "mla-tiny", "bert-tiny", "t5-tiny"])
def test_every_family_lists_its_points(preset):
    model = model_of(preset)
    names = set(hook_points(model))
    stacks = {"bert-tiny": ["encoder."], "t5-tiny": ["encoder.", "decoder."]}.get(preset, [""])
    for stack in stacks:
        assert f"{stack}hook_embed" in names and f"{stack}hook_final_norm" in names
        for p in ATTN_POINTS:
            assert f"{stack}blocks.0.self_attn.{p}" in names
        for p in (*BLOCK_POINTS, "ffn.hook_hidden", "ffn.hook_out"):
            assert f"{stack}blocks.1.{p}" in names
    if preset == "t5-tiny":
        assert {f"decoder.blocks.0.cross_attn.{p}" for p in ATTN_POINTS} <= names
        assert "decoder.blocks.0.hook_resid_cross" in names
    if preset in ("gpt2-tiny", "llama-tiny", "mla-tiny"):
        assert "hook_logits" in names
    assert not model.state_dict().keys() & {f"{n}.fns" for n in names}  # no weights added


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "mla-tiny", "bert-tiny", "t5-tiny"])
def test_looking_at_every_point_leaves_the_forward_bitwise_equal(preset):
    model = model_of(preset)
    ids = torch.randint(3, 100, (2, 9))
    with torch.no_grad():
        plain = forward(model, preset, ids)
        looked, cache = run_with_cache(model, *([ids, ids] if preset == "t5-tiny" else [ids]))
    assert torch.equal(looked, plain)
    assert set(cache) == set(hook_points(model))  # every point ran and was kept
    assert all(not p.fns for p in hook_points(model).values())  # every hook taken off again


def test_names_keep_only_what_is_asked_and_unknown_names_are_one_error():
    model = model_of("gpt2-tiny")
    ids = torch.randint(3, 100, (1, 7))
    _, cache = run_with_cache(model, ids, names=["blocks.1.hook_resid_post"])
    assert list(cache) == ["blocks.1.hook_resid_post"] and cache[
        "blocks.1.hook_resid_post"
    ].shape == (1, 7, model.embed.weight.shape[1])
    _, cache = run_with_cache(model, ids, names=[lambda n: n.endswith("hook_pattern")])
    assert sorted(cache) == [f"blocks.{i}.self_attn.hook_pattern" for i in range(2)]
    with pytest.raises(ValueError, match="no hook point 'blocks.9.hook_resid_post'"):
        run_with_cache(model, ids, names=["blocks.9.hook_resid_post"])


def test_the_residual_stream_adds_up_and_z_is_what_o_proj_reads():
    """Recomputed by hand from the cache: resid_mid = resid_pre + attn_out, resid_post =
    resid_mid + mlp_out (pre-norm, no dropout), attn_out = o_proj(concat heads of z)."""
    model = model_of("llama-tiny")
    ids = torch.randint(3, 100, (2, 8))
    with torch.no_grad():
        logits, c = run_with_cache(model, ids)
        for i, block in enumerate(model.blocks):
            p = f"blocks.{i}."
            attn_out = c[p + "self_attn.hook_out"]
            torch.testing.assert_close(c[p + "hook_resid_mid"], c[p + "hook_resid_pre"] + attn_out)
            torch.testing.assert_close(
                c[p + "hook_resid_post"], c[p + "hook_resid_mid"] + c[p + "ffn.hook_out"]
            )
            z = c[p + "self_attn.hook_z"]  # (B, H, T, D)
            B, H, T, D = z.shape
            manual = block.self_attn.o_proj(z.transpose(1, 2).reshape(B, T, H * D))
            torch.testing.assert_close(attn_out, manual)
            ffn = block.ffn
            hidden = c[p + "ffn.hook_hidden"]
            torch.testing.assert_close(c[p + "ffn.hook_out"], ffn.down_proj(hidden))
        torch.testing.assert_close(logits, model.head(c["hook_final_norm"]))
        torch.testing.assert_close(c["blocks.0.hook_resid_pre"], c["hook_embed"])  # RoPE: no add


def test_a_zeroed_head_equals_removing_its_columns_of_o_proj():
    model = model_of("gpt2-tiny")
    ids = torch.randint(3, 100, (2, 8))
    attn = model.blocks[1].self_attn
    D = attn.head_dim

    def zero_head_2(z, hook):
        z = z.clone()
        z[:, 2] = 0
        return z

    with torch.no_grad():
        edited = run_with_hooks(model, ids, fwd_hooks=[("blocks.1.self_attn.hook_z", zero_head_2)])
        plain = model(ids)
        attn.o_proj.weight[:, 2 * D : 3 * D] = 0  # the reference: head 2 never reaches o_proj
        removed = model(ids)
    assert not torch.allclose(edited, plain)
    torch.testing.assert_close(edited, removed, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flash"])
def test_a_replaced_pattern_is_what_the_heads_read(backend):
    """A uniform causal pattern: each query's output is the mean of the values up to it."""
    torch.manual_seed(1)
    attn = Attention(16, 4, n_kv_heads=2, backend=backend).eval()
    x, ctx = torch.randn(2, 6, 16), AttentionContext(is_causal=True)
    T = 6
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]  # (T, T)

    def flat(pattern, hook):
        return uniform.expand_as(pattern)

    with torch.no_grad():
        out, cache = run_with_cache(attn, x, ctx, names=["hook_v", "hook_z"])
        edited = run_with_hooks(attn, x, ctx, fwd_hooks=[("hook_pattern", flat)])
        v = cache["hook_v"].repeat_interleave(2, dim=1)  # (B, H, T, D): head h reads kv h // 2
        z = uniform @ v  # (B, H, T, D)
        manual = attn.o_proj(z.transpose(1, 2).reshape(2, T, 16))
    torch.testing.assert_close(edited, manual, atol=1e-5, rtol=0)
    assert not torch.allclose(edited, out)


def test_a_bias_added_to_the_scores_equals_the_same_bias_given_to_the_layer():
    torch.manual_seed(2)
    attn = Attention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    bias = torch.randn(1, 4, 5, 5)
    with torch.no_grad():
        want = attn(x, AttentionContext(is_causal=True, positions=_Bias(bias)))
        got = run_with_hooks(
            attn, x, AttentionContext(is_causal=True), fwd_hooks=[("hook_scores", _add(bias))]
        )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _add(bias):
    return lambda scores, hook: scores + bias


class _Bias:
    """Position terms carrying only a score bias (as ALiBi's prepared terms do)."""

    def __init__(self, bias):
        self.bias = bias

    def rotate_qk(self, q, k):
        return q, k


@pytest.mark.hf
@pytest.mark.slow
def test_residual_stream_and_patterns_match_transformers_gpt2(tmp_path):
    T = pytest.importorskip("transformers")
    from attnlab.interop.hf import load_hf

    torch.manual_seed(0)
    cfg = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    hf = T.GPT2LMHeadModel(T.GPT2Config(**cfg, initializer_range=0.2)).eval()
    hf.save_pretrained(tmp_path)
    hf = T.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours, _ = load_hf(tmp_path)
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True, output_attentions=True)
        logits, c = run_with_cache(ours.eval(), ids)
    for i in range(2):  # hidden_states[i]: the input of block i; attentions[i]: its pattern
        torch.testing.assert_close(
            c[f"blocks.{i}.hook_resid_pre"], ref.hidden_states[i], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            c[f"blocks.{i}.self_attn.hook_pattern"], ref.attentions[i], atol=1e-4, rtol=0
        )
    torch.testing.assert_close(c["hook_final_norm"], ref.hidden_states[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)


def test_hooks_come_off_after_an_error():
    model = model_of("gpt2-tiny")
    with pytest.raises(RuntimeError, match="boom"):
        with hooks(model, [(lambda n: True, lambda x, hook: None)]):
            raise RuntimeError("boom")
    assert all(not p.fns for p in hook_points(model).values())


# --- the points TransformerLens has (tests/components/test_tl_names.py checks their values
# against TransformerLens itself; these check the recomputations against the fused path) ----
def _randomised(preset: str):
    model = model_of(preset)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norm weights off one, biases off zero
    return model


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_head_results_sum_to_the_output_and_edit_it(preset):
    model = _randomised(preset)
    ids = torch.randint(3, 100, (2, 7))
    names = ["blocks.0.self_attn.hook_result", "blocks.0.self_attn.hook_out"]
    plain, cache = run_with_cache(model, ids, names=names)
    result, out = cache[names[0]], cache[names[1]]  # (B, T, H, C), (B, T, C)
    bias = model.blocks[0].self_attn.o_proj.bias
    assert torch.allclose(result.sum(2) + (0 if bias is None else bias), out, atol=1e-6)

    # Removing head 1's write through hook_result equals zeroing its z.
    def drop(x, hook):
        x = x.clone()
        x[:, :, 1] = 0
        return x

    def zero_z(z, hook):
        z = z.clone()
        z[:, 1] = 0
        return z

    a = run_with_hooks(model, ids, fwd_hooks=[(names[0], drop)])
    b = run_with_hooks(model, ids, fwd_hooks=[("blocks.0.self_attn.hook_z", zero_z)])
    assert torch.allclose(a, b, atol=1e-5) and not torch.allclose(a, plain, atol=1e-3)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_norm_points_are_the_formula_and_an_edit_goes_through(preset):
    model = _randomised(preset)
    norm = model.blocks[0].residuals[0].norm
    x = torch.randn(2, 5, norm.weight.shape[0])
    plain = norm(x)
    with hooks(norm, [(n, lambda t, h: None) for n in ("hook_scale", "hook_normalized")]):
        assert torch.equal(norm(x), plain)  # only looked at: the fused output is kept
    _, cache = run_with_cache(norm, x)
    bias = getattr(norm, "bias", None)
    rebuilt = cache["hook_normalized"] * norm.weight + (0 if bias is None else bias)
    assert torch.allclose(rebuilt, norm(x), atol=1e-5)
    assert cache["hook_scale"].shape == (2, 5, 1)
    doubled = run_with_hooks(norm, x, fwd_hooks=[("hook_scale", lambda s, h: s * 2)])
    assert torch.allclose(
        doubled - (0 if bias is None else bias),
        (norm(x) - (0 if bias is None else bias)) / 2,
        atol=1e-5,
    )


def test_transformer_lens_names_see_its_layout_and_edit_the_same_activation():
    model = _randomised("llama-tiny")
    ids = torch.randint(3, 100, (1, 6))
    _, cache = run_with_cache(
        model, ids, names=["blocks.1.attn.hook_z", "blocks.1.self_attn.hook_z"]
    )
    assert torch.equal(
        cache["blocks.1.attn.hook_z"], cache["blocks.1.self_attn.hook_z"].transpose(1, 2)
    )

    def tl_zero(z, hook):  # (B, T, H, D)
        assert hook.name == "blocks.1.attn.hook_z" and hook.layer() == 1
        z = z.clone()
        z[:, :, 2] = 0
        return z

    def own_zero(z, hook):  # (B, H, T, D)
        z = z.clone()
        z[:, 2] = 0
        return z

    a = run_with_hooks(model, ids, fwd_hooks=[("blocks.1.attn.hook_z", tl_zero)])
    b = run_with_hooks(model, ids, fwd_hooks=[("blocks.1.self_attn.hook_z", own_zero)])
    assert torch.equal(a, b)
    _, every = run_with_cache(model, ids, naming="transformer_lens")
    assert "blocks.0.attn.hook_rot_q" in every and "blocks.0.self_attn.hook_q" not in every
    with pytest.raises(ValueError, match="no hook point 'blocks.0.attn.hook_nothing'"):
        run_with_cache(model, ids, names=["blocks.0.attn.hook_nothing"])


@pytest.mark.hf
@pytest.mark.slow
def test_encoder_decoder_points_match_transformers_t5(tmp_path):
    """T5 (encoder, decoder, cross attention) against transformers' hidden states and
    attentions on the same randomised weights: each block's stream and pattern, both stacks,
    the cross-attention patterns, and the head results summing to the output."""
    T = pytest.importorskip("transformers")
    from attnlab.interop.hf import save_hf

    model = _randomised("t5-tiny")
    save_hf(model, get_preset("t5-tiny"), tmp_path)
    hf = T.T5ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager")
    src, tgt = torch.randint(3, 100, (2, 9)), torch.randint(3, 100, (2, 5))
    with torch.no_grad():
        ref = hf.eval()(
            input_ids=src, decoder_input_ids=tgt, output_hidden_states=True, output_attentions=True
        )
        logits, c = run_with_cache(model, src, tgt)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
    for stack, hidden, attns in (
        ("encoder", ref.encoder_hidden_states, ref.encoder_attentions),
        ("decoder", ref.decoder_hidden_states, ref.decoder_attentions),
    ):
        L = len(attns)
        for i in range(L):  # hidden[i]: block i's input; the last one is after the final norm
            p = f"{stack}.blocks.{i}"
            torch.testing.assert_close(c[f"{p}.hook_resid_pre"], hidden[i], atol=1e-4, rtol=0)
            torch.testing.assert_close(
                c[f"{p}.self_attn.hook_pattern"], attns[i], atol=1e-5, rtol=0
            )
            result, out = c[f"{p}.self_attn.hook_result"], c[f"{p}.self_attn.hook_out"]
            torch.testing.assert_close(result.sum(2), out, atol=1e-5, rtol=0)
        torch.testing.assert_close(c[f"{stack}.hook_final_norm"], hidden[L], atol=1e-4, rtol=0)
    for i, cross in enumerate(ref.cross_attentions):
        pattern = c[f"decoder.blocks.{i}.cross_attn.hook_pattern"]  # (B, H, T_dec, T_enc)
        torch.testing.assert_close(pattern, cross, atol=1e-5, rtol=0)
