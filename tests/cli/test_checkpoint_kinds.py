"""Every command that takes a checkpoint opens every kind of checkpoint: a LoRA fine-tuning run,
a quantized (int8) checkpoint, a classifier, and an HF directory. Each command either does its
work or refuses in one line that names the checkpoint and says why (generate on a classifier,
embodied on anything not trained on scenes).

The checkpoints are made by the commands themselves (train, finetune, quantize, convert) from a
1-layer model, once per module; each case then runs one command on one kind.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnlab.checkpoint import open_checkpoint, save_pretrained
from attnlab.cli.__main__ import main
from attnlab.cli.serve import open_served
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.tokenizer import train_char_tokenizer

pytestmark = pytest.mark.slow  # the checkpoints are made by 4 commands first (about 4 s)

KINDS = ("lora", "prefix", "int8", "classifier", "hf")
WORDS = ["ab", "cab", "bead", "face", "dab", "fed", "add", "deaf", "bad", "cafe"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """{kind: checkpoint directory}, and "corpus" (the base's text)."""
    root = tmp_path_factory.mktemp("kinds")
    torch.set_num_threads(1)
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"up {w}: {w.upper()}\n" for w in WORDS) * 20)
    base = root / "base"
    train = ["train", "--preset", "llama-tiny", "--data.source", str(corpus)]
    train += ["--data.tokenizer=char", "--data.cache_dir", str(root / "cache")]
    train += ["--model.n_layers=1", "--model.max_seq_len=64", "--train.steps=1"]
    train += ["--train.batch_size=2", "--train.context=32", "--train.eval_every=1"]
    train += ["--train.eval_batches=1", "--train.sample_tokens=0", "--train.progress=false"]
    assert main([*train, "--train.device=cpu", "--train.out_dir", str(base)]) == 0
    sft = root / "sft.jsonl"
    sft.write_text(
        "".join(json.dumps({"prompt": f"up {w}:", "response": w.upper()}) + "\n" for w in WORDS)
    )
    lora = root / "lora"
    finetune = ["finetune", "--ckpt", str(base), "--task", "sft", "--data.source", str(sft)]
    finetune += ["--lora.rank=2", "--train.steps=1", "--train.eval_every=1", "--train.lr=1e-2"]
    finetune += ["--data.eval_before=false", "--data.eval_examples=2", "--data.max_new_tokens=2"]
    finetune += ["--train.batch_size=2", "--train.context=32", "--train.progress=false"]
    assert main([*finetune, "--train.device=cpu", "--train.out_dir", str(lora)]) == 0
    prefix = root / "prefix"
    peft = ["--peft.method=prefix", "--peft.num_virtual_tokens=2"]
    finetune = [a for a in finetune if not a.startswith("--lora.")]
    assert main([*finetune, *peft, "--train.device=cpu", "--train.out_dir", str(prefix)]) == 0
    int8 = root / "int8"
    assert main(["quantize", "--ckpt", str(base), "--scheme", "int8", "--out", str(int8)]) == 0
    hf = root / "hf"
    assert main(["convert", "--from", "attnlab", str(base), "--to", "hf", str(hf)]) == 0
    cfg = replace(get_preset("bert-tiny"), n_layers=1)
    tok = train_char_tokenizer(corpus.read_text().splitlines())
    cfg = replace(cfg, vocab_size=tok.vocab_size)
    clf = save_pretrained(root / "classifier", build_model(cfg, n_labels=3).eval(), cfg, tok)
    return {
        "lora": lora,
        "prefix": prefix,
        "int8": int8,
        "classifier": clf,
        "hf": hf,
        "corpus": corpus,
        "root": root,
    }


def argv_of(command: str, kind: str, ckpts: dict) -> list[str]:
    """The command line of `command` on checkpoint `kind`."""
    ckpt, out = str(ckpts[kind]), str(ckpts["root"] / f"out_{command}_{kind}")
    text = "up ab: AB"
    return {
        "eval": ["eval", "--ckpt", ckpt, "--batches", "1", "--device", "cpu"],
        "generate": ["generate", "--ckpt", ckpt, "--prompt", "up ab:", "--max-new-tokens", "2"]
        + ["--temperature", "0", "--device", "cpu"],
        "viz": ["viz", "attention", "--ckpt", ckpt, "--text", text, "--out", out],
        "lab heads": ["lab", "heads", "--ckpt", ckpt, "--fast", "--out", out]
        + ["--data.source", str(ckpts["corpus"])],
        "analyze rank": ["analyze", "rank", "--ckpt", ckpt, "--text", text, "--n", "8"]
        + ["--d-k", "4", "--heads", "1"],
        "convert": ["convert", "--from", "hf" if kind == "hf" else "attnlab", ckpt]
        + ["--to", "attnlab" if kind == "hf" else "hf", out],
        "check": ["check", "--model", ckpt, "--reference", ckpt, "--input", "1 2 3"],
        "quantize": ["quantize", "--ckpt", ckpt, "--scheme", "int8", "--out", out],
        "embodied": ["embodied", "--ckpt", ckpt, "--seed", "1", "--out", out],
    }[command]


# (command, kind): the one line it refuses with (a part of it), or None where it works.
REFUSALS = {
    ("eval", "classifier"): "is a sequence classifier (3 labels)",
    ("eval", "hf"): "holds no training run to evaluate",
    ("generate", "classifier"): "is a sequence classifier (3 labels) with no LM head",
    ("lab heads", "classifier"): "take a causal LM (DecoderLM), got EncoderForClassification",
    ("convert", "int8"): "holds quantized weights",
    ("quantize", "int8"): "is already quantized (int8)",
    **{("embodied", kind): "not on scenes ('vqa' or 'vla')" for kind in KINDS},
    **{
        (command, "prefix"): f"is a prefix-tuning run (a frozen base and a learned prefix): {what}"
        for command, what in [
            ("viz", "viz draws a plain model's attention"),
            ("lab heads", "the heads experiments take a plain causal LM"),
            ("analyze rank", "analyze takes a plain model"),
            ("convert", "its prefix has no place in a model format: convert --to peft writes it"),
            ("check", "check takes a plain model"),
            ("quantize", "quantize its base checkpoint instead"),
        ]
    },
}
COMMANDS = ("eval", "generate", "viz", "lab heads", "analyze rank", "convert", "check")
COMMANDS += ("quantize", "embodied")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_opens_every_checkpoint_kind(ckpts, command, kind, capsys):
    capsys.readouterr()
    code = main(argv_of(command, kind, ckpts))
    err = capsys.readouterr().err.strip()
    refusal = REFUSALS.get((command, kind))
    if refusal is None:
        assert code == 0, err
    else:
        assert code == 2, f"expected a refusal ({refusal!r}), got exit {code}"
        assert len(err.splitlines()) == 1 and err.startswith(f"attnlab {command.split()[0]}: ")
        assert refusal in err and str(ckpts[kind]) in err, err


@pytest.mark.parametrize("kind", KINDS)
def test_serve_opens_every_checkpoint_kind(ckpts, kind):
    """attnlab serve's loading: every decoder kind opens (a LoRA run merged), a classifier (an
    encoder's) is refused in one line, a prefix-tuning run opens with its prefix."""
    if kind == "prefix":
        assert type(open_served(str(ckpts[kind])).model).__name__ == "PromptLearningLM"
        return
    if kind == "classifier":
        with pytest.raises(ValueError, match="attnlab serve needs a decoder-only") as e:
            open_served(str(ckpts[kind]))
        assert "\n" not in str(e.value) and str(ckpts[kind]) in str(e.value)
        return
    loaded = open_served(str(ckpts[kind]))
    assert loaded.tokenizer is not None and loaded.config.arch == "decoder"
    assert not any("lora" in name for name in loaded.model.state_dict())


def test_a_lora_run_opens_as_its_merged_weights(ckpts):
    """The LoRA run every command opens is the base plus (alpha / r) B A, computed here by hand
    from the base checkpoint's tensors and the run's adapters (not through their own merge)."""
    from safetensors.torch import load_file

    loaded = open_checkpoint(ckpts["lora"])
    saved = load_file(str(loaded.path / "model.safetensors"))
    base = load_file(str(Path(loaded.run["base"]) / "model.safetensors"))
    scale = 16.0 / 2  # LoraConfig's alpha over --lora.rank
    state = loaded.model.state_dict()
    adapted = [k.removesuffix(".lora_A") for k in saved if k.endswith(".lora_A")]
    assert adapted and all(k.endswith(("lora_A", "lora_B")) for k in saved)  # no base stored
    for m in adapted:
        by_hand = base[m + ".weight"] + scale * saved[m + ".lora_B"] @ saved[m + ".lora_A"]
        torch.testing.assert_close(state[m + ".weight"], by_hand, rtol=0, atol=1e-6)
        assert not torch.equal(by_hand, base[m + ".weight"])  # one step moved B off 0
