"""The reference checker: every point within tolerance on a faithful port, and on planted bugs
the first diverging point and the right likely cause."""

import pytest
import torch

from attnlab.components.ffn import ACTIVATIONS
from attnlab.components.moe import moe_layers
from attnlab.components.positions.rope import RoPE, rope_angles
from attnlab.interop.check import check
from attnlab.interop.hf import load_hf
from tests.interop.helpers import TINY_LLAMA, VOCAB, padded_batch

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    T.LlamaForCausalLM(T.LlamaConfig(**TINY_LLAMA)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(llama_dir):
    return T.LlamaForCausalLM.from_pretrained(llama_dir).eval()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    torch.manual_seed(0)
    # A wide init: pre-activations of order 1, where exact and tanh GELU differ visibly.
    config = T.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    path = tmp_path_factory.mktemp("bert")
    T.BertForMaskedLM(config).save_pretrained(path)
    return path


BATCH = padded_batch()


def test_faithful_port_matches_everywhere(llama_dir, llama):
    ours, _ = load_hf(llama_dir)
    report = check(ours, llama, *BATCH)
    assert report.ok and report.first_divergence is None and report.cause is None
    assert [p.name for p in report.points] == ["embed", "block.0", "block.1", "norm", "logits"]
    assert all(p.ok for p in report.points)
    assert "every point is within tolerance" in str(report)


def test_norm_eps_changed_in_one_layer(llama_dir, llama):
    ours, _ = load_hf(llama_dir)
    ours.blocks[1].residuals[0].norm.eps = 1e-2
    report = check(ours, llama, *BATCH)
    assert report.first_divergence == "block.1"
    assert report.cause.startswith("norm eps")
    assert "first divergence: block.1" in str(report)


def test_rope_layout_swapped_without_permutation(llama_dir, llama):
    ours, _ = load_hf(llama_dir)  # q/k rows in the half layout ...
    for rope in (m for m in ours.modules() if isinstance(m, RoPE)):  # ... rotated interleaved
        rope.layout = "interleaved"
        rope.cos, rope.sin = rope_angles(
            rope.rotary_dim, rope.cos.shape[0], rope.theta, rope.scaling, "interleaved"
        )
    report = check(ours, llama, *BATCH)
    assert report.first_divergence == "block.0"
    assert report.cause.startswith("RoPE layout")


def test_inverted_mask(llama_dir, llama):
    ours, _ = load_hf(llama_dir)

    def invert(module, args):  # a port that reads the mask as "True = masked"
        return (args[0], ~args[1])

    ours.register_forward_pre_hook(invert)
    report = check(ours, llama, *BATCH)
    assert report.first_divergence == "block.0"
    assert report.cause.startswith("mask polarity")


def test_tanh_gelu_instead_of_exact(bert_dir):
    hf = T.BertForMaskedLM.from_pretrained(bert_dir).eval()
    ours, _ = load_hf(bert_dir)
    for m in ours.modules():
        if getattr(m, "act", None) is ACTIVATIONS["gelu"]:
            m.act = ACTIVATIONS["gelu_tanh"]
    report = check(hf, ours, *BATCH)  # either order: the attnlab side is the one re-run
    assert report.first_divergence == "block.0"
    assert report.cause.startswith("GELU variant")
    assert "GELU tanh -> exact" in str(report)


def test_two_attnlab_models_missing_embedding_scale(llama_dir):
    ours, _ = load_hf(llama_dir)
    reference, _ = load_hf(llama_dir)
    reference.embed.multiplier = 8.0  # sqrt(d_model = 64), as the 2017 Transformer scales
    report = check(ours, reference, *BATCH)
    assert report.first_divergence == "embed"
    assert report.cause.startswith("embedding scale")


def test_report_reads_as_a_table(llama_dir, llama):
    ours, _ = load_hf(llama_dir)
    ours.norm.eps = 0.5
    text = str(check(ours, llama, *BATCH))
    assert "DIVERGES  <- first" in text and "likely cause: norm eps" in text
    assert "diagnostics" in text and "every point matches" in text


def test_gpt2_and_t5_ports_match_and_a_missing_head_rescale_is_found(tmp_path):
    torch.manual_seed(0)
    gpt2 = T.GPT2LMHeadModel(
        T.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, initializer_range=0.2
        )
    ).eval()
    t5 = T.T5ForConditionalGeneration(
        T.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=VOCAB)
    ).eval()
    for name, hf in (("gpt2", gpt2), ("t5", t5)):
        hf.save_pretrained(tmp_path / name)
        ours, _ = load_hf(tmp_path / name)
        assert check(ours, hf, *BATCH).ok
    ours.decoder.head_scale = 1.0  # T5 v1.0 without its d_model^-0.5 before the tied head
    report = check(ours, t5, *BATCH)
    assert [p.name for p in report.points][-3:] == ["decoder.block.1", "decoder.norm", "logits"]
    assert report.first_divergence == "logits"
    assert report.cause.startswith("head rescale")


def test_moe_ports_match_and_planted_routing_bugs_are_named(tmp_path):
    """Mixtral (k = 2 of 4, gates renormalised) and Qwen2-MoE without norm_topk_prob: a faithful
    load matches transformers; routing to one expert too many, or renormalising where the
    reference does not, is found at block.0 and named."""
    torch.manual_seed(0)
    shapes = dict(TINY_LLAMA, num_local_experts=4, num_experts=4, num_experts_per_tok=2)
    mixtral = T.MixtralForCausalLM(T.MixtralConfig(**shapes)).eval()
    qwen = T.Qwen2MoeForCausalLM(
        T.Qwen2MoeConfig(
            **shapes,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            decoder_sparse_step=1,
        )  # fmt: skip
    ).eval()
    for name, hf in (("mixtral", mixtral), ("qwen2_moe", qwen)):
        hf.save_pretrained(tmp_path / name)
        ours, _ = load_hf(tmp_path / name)
        assert check(ours, hf, *BATCH).ok, name
    ours, _ = load_hf(tmp_path / "mixtral")
    for layer in moe_layers(ours):
        layer.k = 3
    report = check(ours, mixtral, *BATCH)
    assert report.first_divergence == "block.0"
    assert report.cause.startswith("experts per token: A routes each token to 3 experts, B to 2")
    ours, _ = load_hf(tmp_path / "qwen2_moe")
    assert not moe_layers(ours)[0].normalize  # read from norm_topk_prob
    for layer in moe_layers(ours):
        layer.normalize = True
    report = check(ours, qwen, *BATCH)
    assert report.first_divergence == "block.0"
    assert report.cause.startswith("top-k renormalisation: A rescales")
