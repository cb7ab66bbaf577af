"""LoRA against `peft` on tiny HF models (GPT-2, Llama, BERT): outputs and adapter gradients from
the same adapter weights, a peft-trained adapter loaded into attnlab, and attnlab's adapter
loaded by peft. The HF bases are built from configs (nothing downloads) and converted with
attnlab's HF converters."""

import json

import pytest
import torch

from attnlab.adapters.lora import add_lora, lora_modules
from attnlab.interop.hf import load_hf
from attnlab.interop.peft import hf_placements, load_peft, save_peft

T = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.hf

VOCAB = 128
ATOL = 1e-5
FAMILIES = {  # (HF class, config, peft target_modules: every Linear of the blocks)
    "gpt2": (
        "GPT2LMHeadModel",
        T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64),
        ["c_attn", "c_proj", "c_fc"],  # c_attn is q, k, v fused; c_proj is in attn and mlp
    ),
    "llama": (
        "LlamaForCausalLM",
        T.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        ),
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "bert": (
        "BertForMaskedLM",
        T.BertConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        ),
        ["query", "key", "value", "dense"],  # "dense" includes the MLM head's transform
    ),
}


def make_base(family, tmp_path_factory):
    """(family, HF base directory, attnlab config)."""
    cls, config, _ = FAMILIES[family]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(family)
    getattr(T, cls)(config).save_pretrained(path)
    return family, path, load_hf(path)[1]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def base(request, tmp_path_factory):
    return make_base(request.param, tmp_path_factory)


def hf_model(family, path):
    return getattr(T, FAMILIES[family][0]).from_pretrained(path).eval()


def ids(B=2, T=10, seed=1):
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def peft_model(family, path, r=4, alpha=8):
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=FAMILIES[family][2])
    return peft.get_peft_model(hf_model(family, path), config).eval()


def peft_lora(model) -> dict[str, tuple]:
    """{HF module path: (lora_A Linear, lora_B Linear)} of a PeftModel."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
            out[name.removeprefix("base_model.model.")] = (m.lora_A["default"], m.lora_B["default"])
    return out


def randomize_B(model, seed=2):
    """A non-zero B in every peft adapter (peft starts B at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, B in peft_lora(model).values():
            B.weight.copy_(torch.randn(B.weight.shape, generator=g) * 0.1)


def test_outputs_and_gradients_equal_peft_from_the_same_adapter(base, tmp_path):
    family, path, cfg = base
    theirs = peft_model(family, path)
    randomize_B(theirs)
    theirs.save_pretrained(tmp_path)
    ours = load_hf(path)[0]
    names = load_peft(ours, cfg, tmp_path)
    x = ids()
    out_theirs, out_ours = theirs(input_ids=x).logits, ours(x)
    assert (out_theirs - out_ours).abs().max() <= ATOL
    w = torch.randn(out_ours.shape, generator=torch.Generator().manual_seed(3))
    n_tokens = x.numel()  # a loss per token, summed over V: gradients of order one
    ((out_theirs * w).sum() / n_tokens).backward()
    ((out_ours * w).sum() / n_tokens).backward()
    # peft's A feeds every one of our modules cut from its HF module (c_attn: q, k and v), so
    # its gradient is the sum of theirs; B's rows are split among them.
    places = hf_placements(cfg, names)
    largest = []
    for module, (A, B) in peft_lora(theirs).items():
        members = [n for n in names if places[n].module == module]
        assert members, module
        grad_A = sum(ours.get_submodule(n).lora_A.grad for n in members)
        assert (grad_A - A.weight.grad).abs().max() <= ATOL, module
        for n in members:
            grad_B = B.weight.grad[places[n].rows]
            assert (ours.get_submodule(n).lora_B.grad - grad_B).abs().max() <= ATOL, n
        largest.append(A.weight.grad.abs().max().item())
    assert min(largest) > 1e-6 and max(largest) > 0.1  # the comparisons are not between zeros


def lm_loss(family, model, x):
    labels = x if family != "bert" else x.masked_fill(torch.rand(x.shape) < 0.5, -100)
    return model(input_ids=x, labels=labels).loss


def train_three_steps(family: str, theirs) -> None:
    """Three AdamW steps of peft's model on its LM loss (its trainable parameters only)."""
    opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        loss = lm_loss(family, theirs, ids(B=4, T=16, seed=10 + step))
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_an_adapter_trained_by_peft_loads_into_attnlab(base, tmp_path):
    family, path, cfg = base
    torch.manual_seed(0)
    theirs = peft_model(family, path).train()
    train_three_steps(family, theirs)
    theirs.eval().save_pretrained(tmp_path)
    assert all(B.weight.abs().max() > 0 for _, B in peft_lora(theirs).values())
    ours = load_hf(path)[0]
    load_peft(ours, cfg, tmp_path)
    with torch.no_grad():
        x = ids(seed=3)
        assert (theirs(input_ids=x).logits - ours(x)).abs().max() <= ATOL
        assert (load_hf(path)[0](x) - ours(x)).abs().max() > 1e-3  # the adapter matters


@pytest.mark.parametrize("targets", [("q", "v"), ("q", "k", "v", "o", "mlp")])
def test_attnlab_adapter_loads_into_peft(base, tmp_path, targets):
    family, path, cfg = base
    ours = load_hf(path)[0]
    add_lora(ours, targets, rank=4, alpha=8)
    with torch.no_grad():
        for m in lora_modules(ours).values():
            m.lora_B.normal_(0.0, 0.1)
    save_peft(ours, cfg, tmp_path, base_model_name_or_path=str(path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(path)
    theirs = peft.PeftModel.from_pretrained(hf_model(family, path), tmp_path).eval()
    x = ids(seed=4)
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - ours(x)).abs().max() <= ATOL
    if family == "gpt2" and targets == ("q", "v"):
        # q and v are one adapter of rank 2r on c_attn: A (2r, C), B (3C, 2r), k's rows zero
        assert config["r"] == 8 and config["lora_alpha"] == 16 and config["fan_in_fan_out"]
        assert config["target_modules"] == ["c_attn"]
        A, B = peft_lora(theirs)["transformer.h.0.attn.c_attn"]
        assert A.weight.shape == (8, 64) and B.weight.shape == (192, 8)
        assert not B.weight[64:128].any()


def test_llama_loaded_in_the_interleaved_rope_layout_takes_a_peft_adapter(
    tmp_path_factory, tmp_path
):
    """q_proj/k_proj rows are permuted on load (layout "interleaved"); B's rows follow."""
    family, path, _ = make_base("llama", tmp_path_factory)
    theirs = peft_model(family, path)
    randomize_B(theirs)
    theirs.save_pretrained(tmp_path)
    ours, cfg = load_hf(path, layout="interleaved")
    load_peft(ours, cfg, tmp_path)
    rows = hf_placements(cfg, ["blocks.0.self_attn.q_proj"])["blocks.0.self_attn.q_proj"].rows
    assert not torch.equal(rows, torch.arange(len(rows)))  # a real permutation
    x = ids(seed=5)
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - ours(x)).abs().max() <= ATOL


NORMS = {"gpt2": "ln_1", "llama": "input_layernorm", "bert": "LayerNorm"}  # HF norm names


def extras(model) -> int:
    """The trainable parameters that are not LoRA's A and B."""
    return sum(
        p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n
    )


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize(
    ("bias", "save"), [("all", ()), ("lora_only", ()), ("none", "norm"), ("none", "embed")]
)
def test_trained_biases_and_norms_load_into_peft(base, tmp_path, bias, save):
    """bias / modules_to_save: peft loads our adapter with the same trained weights beside it
    (the same logits) and, reopened to train, trains as many of them as we do."""
    family, path, cfg = base
    ours = load_hf(path)[0]
    if save == "embed" and family != "llama":  # GPT-2's and BERT's embedding is tied
        add_lora(ours, ("q", "v"), 4, 8, modules_to_save=save)
        with pytest.raises(ValueError, match="is tied to .* would train a copy of one"):
            save_peft(ours, cfg, tmp_path)
        return
    add_lora(ours, ("q", "k", "v", "o", "mlp"), 4, 8, bias=bias, modules_to_save=save)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in ours.parameters():
            if p.requires_grad:  # B away from zero, every trained bias and norm moved
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    save_peft(ours, cfg, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    theirs = peft.PeftModel.from_pretrained(hf_model(family, path), tmp_path, is_trainable=True)
    x = ids(seed=7)
    with torch.no_grad():
        assert (theirs.eval()(input_ids=x).logits - ours(x)).abs().max() <= ATOL
        assert (load_hf(path)[0](x) - ours(x)).abs().max() > 1e-3
    if family == "llama" and not save:  # Llama has no biases: nothing beside the adapters
        assert extras(ours) == 0 and config["bias"] == "none"
    else:
        assert extras(ours) > 0 and config["bias"] == bias
    assert extras(theirs) == extras(ours)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_an_adapter_trained_by_peft_with_biases_and_norms_loads_into_attnlab(base, tmp_path, bias):
    family, path, cfg = base
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=FAMILIES[family][2],
        bias=bias,
        modules_to_save=[NORMS[family]] if bias == "all" else None,
    )
    theirs = peft.get_peft_model(hf_model(family, path), config).train()
    train_three_steps(family, theirs)
    theirs.eval().save_pretrained(tmp_path)
    ours = load_hf(path)[0]
    load_peft(ours, cfg, tmp_path)
    with torch.no_grad():
        x = ids(seed=3)
        assert (theirs(input_ids=x).logits - ours(x)).abs().max() <= ATOL


HEADS = {  # a task head on the base: (HF class, its config, peft target_modules)
    "bert-sequence": ("BertForSequenceClassification", FAMILIES["bert"][1], ["query", "value"]),
    "bert-token": ("BertForTokenClassification", FAMILIES["bert"][1], ["query", "value"]),
    "gpt2-sequence": ("GPT2ForSequenceClassification", FAMILIES["gpt2"][1], ["c_attn"]),
}


def make_head_base(name, tmp_path_factory):
    """(HF class name, HF classifier directory (3 labels), attnlab config)."""
    cls, config, _ = HEADS[name]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(name)
    fields = {k: v for k, v in config.to_dict().items() if k not in ("id2label", "label2id")}
    config = type(config).from_dict({**fields, "num_labels": 3, "pad_token_id": 0})
    getattr(T, cls)(config).save_pretrained(path)
    return cls, path, load_hf(path)[1]


@pytest.mark.parametrize(
    ("name", "head_trains"),
    [
        ("bert-sequence", False),
        ("bert-sequence", True),
        ("bert-token", True),
        ("gpt2-sequence", True),
    ],
)
def test_a_classifier_adapter_loads_into_peft_with_its_head(name, head_trains, tmp_path_factory):
    """A classifier's adapter (SEQ_CLS / TOKEN_CLS) carries its head as peft's modules_to_save
    (peft adds classifier / score to them and reads their weights back: without them it
    raised KeyError 'base_model.model.classifier.weight'), frozen or trained (as `attnlab
    finetune --lora.rank` trains it)."""
    cls, path, cfg = make_head_base(name, tmp_path_factory)
    ours = load_hf(path)[0]
    add_lora(ours, ("q", "v"), rank=4, alpha=8)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for m in lora_modules(ours).values():
            m.lora_B.normal_(0.0, 0.1, generator=g)
        for head in ("pooler", "classifier", "head"):  # what `finetune --lora.rank` trains
            if hasattr(ours, head):
                getattr(ours, head).requires_grad_(head_trains)
                getattr(ours, head).weight.add_(torch.randn(getattr(ours, head).weight.shape,
                                                            generator=g))  # fmt: skip
    out = tmp_path_factory.mktemp("adapter")
    save_peft(ours, cfg, out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["task_type"] == ("TOKEN_CLS" if "token" in name else "SEQ_CLS")
    theirs = peft.PeftModel.from_pretrained(getattr(T, cls).from_pretrained(path), out).eval()
    x = ids(seed=9)
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - ours(x)).abs().max() <= ATOL
        assert (load_hf(path)[0](x) - ours(x)).abs().max() > 1e-3


def test_a_classifier_adapter_trained_by_peft_loads_into_attnlab(tmp_path_factory, tmp_path):
    cls, path, cfg = make_head_base("bert-sequence", tmp_path_factory)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=HEADS["bert-sequence"][2],
                             task_type="SEQ_CLS")  # fmt: skip
    torch.manual_seed(0)
    theirs = peft.get_peft_model(getattr(T, cls).from_pretrained(path), config).train()
    opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        loss = theirs(input_ids=ids(B=4, seed=10 + step), labels=torch.tensor([0, 1, 2, 1])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    theirs.eval().save_pretrained(tmp_path)
    ours = load_hf(path)[0]
    load_peft(ours, cfg, tmp_path)
    with torch.no_grad():
        x = ids(seed=3)
        assert (theirs(input_ids=x).logits - ours(x)).abs().max() <= ATOL
        assert (load_hf(path)[0](x) - ours(x)).abs().max() > 1e-3  # the head trained too


def test_rslora_adapters_go_both_ways_with_peft(tmp_path, tmp_path_factory):
    """On GPT-2, rsLoRA (use_rslora: alpha / sqrt(r)): peft's adapter loads into attnlab with
    the same logits, and attnlab's, saved again (GPT-2's q and v become one adapter of rank 2r,
    whose alpha must then be re-derived with sqrt), loads back into peft with the same logits."""
    family, path, cfg = make_base("gpt2", tmp_path_factory)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=FAMILIES[family][2], use_rslora=True)
    theirs = peft.get_peft_model(hf_model(family, path), config).eval()
    randomize_B(theirs)
    theirs.save_pretrained(tmp_path / "peft")
    ours = load_hf(path)[0]
    load_peft(ours, cfg, tmp_path / "peft")
    assert {m.scale for m in lora_modules(ours).values()} == {8 / 2}  # alpha / sqrt(4)
    x = ids(seed=5)
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - ours(x)).abs().max() <= ATOL
    mine = load_hf(path)[0]
    add_lora(mine, ("q", "v"), rank=4, alpha=8, rslora=True)
    with torch.no_grad():
        for m in lora_modules(mine).values():
            m.lora_B.normal_(0.0, 0.1)
    save_peft(mine, cfg, tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(hf_model(family, path), tmp_path / "ours").eval()
    with torch.no_grad():
        assert (back(input_ids=x).logits - mine(x)).abs().max() <= ATOL
