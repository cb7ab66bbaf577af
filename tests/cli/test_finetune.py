"""`attnlab finetune` end to end: SFT and DPO from a small base checkpoint, resume, errors."""

import argparse
import copy
import json
import random
import shutil
import string
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.adapters.lora import lora_modules
from attnlab.checkpoint import open_checkpoint, save_checkpoint
from attnlab.cli.__main__ import main
from attnlab.cli.eval import evaluate_checkpoint
from attnlab.cli.finetune import add_parser, configs_from_args
from attnlab.finetune import data
from attnlab.finetune.config import FinetuneDataConfig
from attnlab.finetune.run import build_finetune, load_examples
from attnlab.finetune.tasks import SFTTask
from attnlab.interop.peft import load_prompt_learning
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.tokenizer import CHAT_TOKENS, DEFAULT_CHAT_TEMPLATE, Tokenizer, train_char_tokenizer
from attnlab.training.config import RunConfig


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_jsonl(path: Path, examples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """A 1-layer Llama-style base (random weights) with a character tokenizer, and the data:
    'up abc:' -> 'ABC' (sft); chosen 'ABC' over the reversed 'cba' (dpo)."""
    root = tmp_path_factory.mktemp("finetune")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdef") for _ in range(rng.randint(2, 5))) for _ in range(120)]
    sft = [{"prompt": f"up {w}:", "response": w.upper()} for w in words]
    dpo = [{"prompt": f"up {w}:", "chosen": w.upper(), "rejected": w[::-1]} for w in words]
    tok = train_char_tokenizer([e["prompt"] + e["chosen"] + e["rejected"] for e in dpo])
    cfg = replace(get_preset("llama-tiny"), vocab_size=tok.vocab_size, n_layers=1, max_seq_len=32)
    torch.manual_seed(0)
    save_checkpoint(root / "base", build_model(cfg), None, RunConfig(model=cfg), {}, tokenizer=tok)
    return {
        "root": root,
        "ckpt": root / "base",
        "sft": write_jsonl(root / "sft.jsonl", sft),
        "dpo": write_jsonl(root / "dpo.jsonl", dpo),
        "reward": root / "dpo.jsonl",
        "grpo": write_jsonl(root / "grpo.jsonl", [{"prompt": e["prompt"]} for e in dpo]),
    }


def args(base: dict, task: str, out: Path, *extra: str) -> list[str]:
    return [
        "finetune",
        "--ckpt",
        str(base["ckpt"]),
        "--task",
        task,
        "--data.source",
        str(base[task]),
        "--data.eval_examples=8",
        "--data.max_new_tokens=8",
        "--train.out_dir",
        str(out),
        "--train.progress=false",
        "--train.context=24",
        "--train.batch_size=8",
        "--train.lr=3e-3",
        "--train.min_lr=3e-4",
        "--train.log_every=1",
        "--train.device=cpu",
        *extra,
    ]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_sft_runs_end_to_end_and_the_loss_falls(base, tmp_path, capsys):
    out = tmp_path / "sft"
    assert main(args(base, "sft", out, "--train.steps=30", "--train.eval_every=15")) == 0
    text = capsys.readouterr().out
    assert "task: sft" in text and "trained 30 steps" in text and "val_exact_match" in text
    before = dict(  # the base's metrics, printed before the first step
        kv.split() for kv in text.split("before fine-tuning: ")[1].splitlines()[0].split(", ")
    )
    assert float(before["val_exact_match"]) == 0.0  # random weights
    rows = records(out)
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = rows[0]["train_loss"], rows[-1]["train_loss"]
    assert last < 0.7 * first, (first, last)
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [15, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert all(0.0 <= r["val_exact_match"] <= 1.0 for r in evals)
    saved = json.loads((out / "checkpoints" / "step_000030" / "config.json").read_text())
    assert saved["data"]["task"] == "sft" and saved["base"] == str(base["ckpt"].resolve())
    assert evaluate_checkpoint(str(out), device="cpu") == pytest.approx(
        {k: v for k, v in evals[-1].items() if k.startswith("val_")}, abs=1e-6
    )  # attnlab eval: the same metrics as the run's last evaluation


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_sft_with_packing_runs(base, tmp_path):
    out = tmp_path / "packed"
    extra = ("--train.steps=4", "--train.eval_every=4", "--data.packing=true")
    assert main(args(base, "sft", out, *extra)) == 0
    assert "val_exact_match" in records(out)[-1]


@pytest.mark.slow
def test_dpo_runs_end_to_end_and_learns_the_preference(base, tmp_path, capsys):
    out = tmp_path / "dpo"
    extra = ("--train.steps=30", "--train.eval_every=15", "--dpo.beta=0.5")
    assert main(args(base, "dpo", out, *extra)) == 0
    text = capsys.readouterr().out
    assert "trained 30 steps" in text
    rows = records(out)
    assert rows[0]["train_loss"] == pytest.approx(0.6931, abs=1e-3)  # policy = reference: log 2
    assert "before fine-tuning: val_loss 0.6931, val_reward_margin 0.0000" in text
    assert rows[-1]["train_loss"] < 0.5
    evals = [r for r in rows if "val_loss" in r]
    assert evals[-1]["val_reward_margin"] > evals[0]["val_reward_margin"] > 0
    assert evals[-1]["val_preference_accuracy"] >= 0.9
    assert main(["eval", "--ckpt", str(out), "--device", "cpu"]) == 0
    printed = dict(line.split() for line in capsys.readouterr().out.splitlines())
    assert float(printed["val_reward_margin"]) == pytest.approx(
        evals[-1]["val_reward_margin"], abs=1e-4
    )
    assert float(printed["val_preference_accuracy"]) == evals[-1]["val_preference_accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("precompute", [False, True])
def test_resume_continues_exactly(base, tmp_path, precompute):
    """3 steps, then --resume to 6, equals 6 steps in one go: the same losses and weights
    (with the reference's log-probs computed at each step, or once before training)."""
    common = ("--train.schedule=constant", "--train.warmup=0", "--train.eval_every=3")
    common += ("--train.ckpt_every=3", f"--dpo.precompute_reference={precompute}")
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(args(base, "dpo", whole, "--train.steps=6", *common)) == 0
    assert main(args(base, "dpo", split, "--train.steps=3", *common)) == 0
    assert main(args(base, "dpo", split, "--train.steps=6", "--resume", *common)) == 0
    assert [r["step"] for r in records(split)] == [1, 2, 3, 4, 5, 6]
    assert [r["train_loss"] for r in records(split)] == [r["train_loss"] for r in records(whole)]
    a = load_file(str(whole / "checkpoints" / "step_000006" / "model.safetensors"))
    b = load_file(str(split / "checkpoints" / "step_000006" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bad_jsonl_line_is_one_clear_error(base, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "up ab:", "response": "AB"}\n{"prompt": "up cd:"}\n')
    argv = args(base, "sft", tmp_path / "out", "--train.steps=1")
    argv[argv.index("--data.source") + 1] = str(bad)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab finetune: error: ") and len(err.splitlines()) == 1
    assert str(bad) in err and "2" in err.replace(str(bad), "") and "'response'" in err


def test_pairs_per_prompt_off_the_builtin_pairs_is_one_clear_error(base, tmp_path, capsys):
    argv = args(base, "sft", tmp_path / "out", "--train.steps=1", "--data.pairs_per_prompt=3")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab finetune: error: ") and len(err.splitlines()) == 1
    assert "data.pairs_per_prompt" in err and "--task dpo" in err
    assert not (tmp_path / "out").exists()


def test_builtin_spec_with_a_jsonl_source_is_one_clear_error(base, tmp_path, capsys):
    argv = args(base, "reward", tmp_path / "out", "--train.steps=1", "--data.builtin=spec")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab finetune: error: ") and "\n" not in err
    assert "data.builtin='spec' chooses the built-in" in err


def test_a_prefix_on_a_reward_head_is_one_clear_error(base, tmp_path, capsys):
    argv = args(base, "reward", tmp_path / "out", "--train.steps=1", "--peft.method=prefix")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab finetune: error: --peft.method prefix") and "\n" not in err


def test_an_unknown_task_is_one_clear_error(base, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args(base, "sft", tmp_path / "out")[:3] + ["--task", "summarize"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--task: invalid choice: 'summarize'" in err and len(err.strip().splitlines()) == 1


def test_a_base_that_is_not_a_decoder_is_one_clear_error(base, tmp_path, capsys):
    cfg = get_preset("bert-tiny")
    tok = train_char_tokenizer(["abc"])
    path = tmp_path / "bert"
    save_checkpoint(path, build_model(cfg), None, RunConfig(model=cfg), {}, tokenizer=tok)
    argv = args(base, "sft", tmp_path / "out", "--train.steps=1")
    argv[argv.index("--ckpt") + 1] = str(path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is an encoder model; --task sft fine-tunes a decoder LM" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_lora_flags_reach_add_lora_and_only_adapters_train(base, tmp_path, capsys):
    """--lora.* put attnlab.adapters.lora adapters on the targets; DPO's reference is then the
    policy with its adapters off (the first loss is log 2: B = 0); the checkpoint stores the
    adapters alone (as peft does) and the base they sit on is the base checkpoint's."""
    out = tmp_path / "lora"
    extra = ("--train.steps=3", "--train.eval_every=3", "--lora.rank=4", "--lora.alpha=8")
    assert main(args(base, "dpo", out, *extra, "--lora.targets", "q_proj, v_proj")) == 0
    text = capsys.readouterr().out
    assert "trained: LoRA rank 4 on q_proj, v_proj" in text
    assert records(out)[0]["train_loss"] == pytest.approx(0.6931, abs=1e-4)
    before = load_file(str(base["ckpt"] / "model.safetensors"))
    adapters = load_file(str(out / "checkpoints" / "step_000003" / "model.safetensors"))
    assert len(adapters) == 4 and all(k.split(".")[-2] in ("q_proj", "v_proj") for k in adapters)
    assert all(k.endswith(("lora_A", "lora_B")) for k in adapters)
    kept = open_checkpoint(out, keep_adapters=True).model.state_dict()
    renamed = {k.replace("q_proj.base.", "q_proj.").replace("v_proj.base.", "v_proj."): v
               for k, v in kept.items() if "lora_" not in k}  # fmt: skip
    assert renamed.keys() == before.keys()
    assert all(torch.equal(renamed[k], before[k]) for k in before)
    assert all(v.shape[0] == 4 for k, v in adapters.items() if k.endswith("lora_A"))
    assert any(
        not torch.equal(v, torch.zeros_like(v)) for k, v in adapters.items() if "lora_B" in k
    )


def test_a_lora_run_names_its_base_and_a_moved_or_changed_base_is_one_line(base, tmp_path, capsys):
    """A LoRA run stores the adapters and points at its base (path and sha256, as peft names
    its base); a base moved away or changed since is refused in one line naming it, never
    combined with the adapters; a checkpoint written before (base weights inside, no sha256)
    still opens to the same model."""
    own = tmp_path / "base"
    shutil.copytree(base["ckpt"], own)
    b = {**base, "ckpt": own}
    out = tmp_path / "lora"
    extra = ("--train.steps=2", "--train.eval_every=2", "--lora.rank=4")
    assert main(args(b, "sft", out, *extra)) == 0
    step = out / "checkpoints" / "step_000002"
    run = json.loads((step / "config.json").read_text())
    assert run["base"] == str(own.resolve()) and len(run["base_sha256"]) == 64
    adapters = (step / "model.safetensors").stat().st_size
    assert adapters < (own / "model.safetensors").stat().st_size / 10
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        want = open_checkpoint(out).model(ids)
    # written the old way: the base's weights inside, no sha256; it opens to the same logits
    old = tmp_path / "old"
    shutil.copytree(step, old)
    kept = open_checkpoint(out, keep_adapters=True).model
    save_file({k: v.contiguous() for k, v in kept.state_dict().items()}, old / "model.safetensors")
    (old / "config.json").write_text(json.dumps({**run, "base_sha256": ""}))
    with torch.no_grad():
        torch.testing.assert_close(open_checkpoint(old).model(ids), want, rtol=0, atol=0)
    weights = load_file(str(own / "model.safetensors"))
    save_file({k: v + 1e-3 for k, v in weights.items()}, own / "model.safetensors")
    capsys.readouterr()
    argv = ["generate", "--ckpt", str(out), "--prompt", "up ab:", "--max-new-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "has changed since the run" in err and repr(str(own.resolve())) in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    shutil.rmtree(own)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "which is not there" in err and 'set "base"' in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_a_lora_checkpoint_reopens_merged_for_eval_and_generate(base, tmp_path, capsys):
    """attnlab eval and generate open a LoRA run's checkpoint with the adapters merged: a plain
    model whose logits equal base + (alpha / r) B A computed here by hand."""
    out = tmp_path / "lora_sft"
    extra = ("--train.steps=4", "--train.eval_every=4", "--lora.rank=4", "--lora.alpha=8")
    assert main(args(base, "sft", out, *extra, "--lora.targets=q_proj,v_proj")) == 0
    last = [r for r in records(out) if "val_loss" in r][-1]
    loaded = open_checkpoint(out)
    assert not any("lora" in k for k in loaded.model.state_dict())  # merged: a plain model
    adapters = load_file(str(out / "checkpoints" / "step_000004" / "model.safetensors"))
    by_hand = load_file(str(base["ckpt"] / "model.safetensors"))  # the run stores no base
    for k in by_hand:
        m = k.removesuffix(".weight")
        if m + ".lora_B" in adapters:  # alpha / r = 8 / 4
            by_hand[k] = by_hand[k] + 2.0 * adapters[m + ".lora_B"] @ adapters[m + ".lora_A"]
    plain = build_model(loaded.config)
    plain.load_state_dict(by_hand, strict=False)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(loaded.model(ids), plain.eval()(ids), atol=1e-5, rtol=0)
    got = evaluate_checkpoint(str(out), device="cpu")
    assert got == pytest.approx({k: v for k, v in last.items() if k.startswith("val_")}, abs=1e-5)
    capsys.readouterr()
    argv = ["generate", "--ckpt", str(out), "--prompt", "up ab:", "--max-new-tokens", "4"]
    assert main([*argv, "--temperature", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("up ab:")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["prefix", "prompt"])
def test_prefix_and_prompt_tuning_train_only_the_prefix_and_reopen(base, tmp_path, capsys, method):
    """--peft.method prefix|prompt: the loss falls with the base frozen (its weights in the
    checkpoint unchanged), the run reopens as the PromptLearningLM it trained (the same eval
    metrics), generates, and exports to the PEFT format."""
    out = tmp_path / method
    # a prefix learns at a large learning rate (Lester et al. use 0.3)
    extra = ("--train.steps=12", "--train.eval_every=12", "--train.lr=0.3", "--train.min_lr=0.03")
    peft_flags = (f"--peft.method={method}", "--peft.num_virtual_tokens=4")
    if method == "prefix":
        peft_flags += ("--peft.prefix_projection=16",)
    assert main(args(base, "sft", out, *extra, *peft_flags)) == 0
    assert f"trained: {method} tuning, 4 virtual tokens" in capsys.readouterr().out
    rows = records(out)
    losses = [r["train_loss"] for r in rows]
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    saved = load_file(str(out / "checkpoints" / "step_000012" / "model.safetensors"))
    assert saved and not any(k.startswith("decoder.") for k in saved)  # the prefix alone
    before = load_file(str(base["ckpt"] / "model.safetensors"))
    loaded = open_checkpoint(out)
    assert type(loaded.model).__name__ == "PromptLearningLM"
    frozen = loaded.model.decoder.state_dict()
    assert all(torch.equal(frozen[k], v) for k, v in before.items())
    last = {k: v for k, v in rows[-1].items() if k.startswith("val_")}
    assert evaluate_checkpoint(str(out), device="cpu") == pytest.approx(last, abs=1e-5)
    capsys.readouterr()
    argv = ["generate", "--ckpt", str(out), "--prompt", "up ab:", "--max-new-tokens", "4"]
    assert main([*argv, "--temperature", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("up ab:")
    assert (
        main(["convert", "--from", "attnlab", str(out), "--to", "peft", str(tmp_path / "adapter")])
        == 0
    )
    frozen = copy.deepcopy(loaded.model.decoder)  # the base, on which the prefix loads again
    again = load_prompt_learning(frozen, loaded.config, tmp_path / "adapter")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(again.eval()(ids), loaded.model(ids), atol=1e-5, rtol=0)


def test_prefix_tuning_with_lora_is_one_clear_error(base, tmp_path, capsys):
    argv = args(base, "sft", tmp_path / "x", "--peft.method=prefix", "--lora.rank=4")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "leave out --lora.rank" in err and "Traceback" not in err


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_open_checkpoint_opens_a_lora_run_merged_or_kept_and_dpo_starts_from_it(
    base, tmp_path, capsys
):
    """The one loader opens a LoRA run (adapters.lora sits below it): merged by default (a
    plain model, logits those of the adapters left on), or with the adapters kept when asked;
    attnlab.open_finetuned is gone. A DPO run from that LoRA SFT run (and `attnlab eval` of
    it, whose reference is that run) opens it the same way."""
    sft = tmp_path / "lora_sft"
    extra = ("--train.steps=2", "--train.eval_every=2", "--lora.rank=4")
    assert main(args(base, "sft", sft, *extra)) == 0
    import attnlab

    assert not hasattr(attnlab, "open_finetuned") and "open_finetuned" not in attnlab.__all__
    merged = open_checkpoint(sft)
    assert not any("lora" in k for k in merged.model.state_dict())
    kept = open_checkpoint(sft, keep_adapters=True)
    adapters = lora_modules(kept.model)
    assert sorted(adapters) == ["blocks.0.self_attn.q_proj", "blocks.0.self_attn.v_proj"]
    assert not any(m.merged for m in adapters.values())
    assert any(m.lora_B.abs().max() > 0 for m in adapters.values())  # trained: B moved off 0
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged.model(ids), kept.model(ids), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="LoRA fine-tuning run, but int8") as e:
        open_checkpoint(sft, scheme="int8")
    assert "\n" not in str(e.value)
    dpo = tmp_path / "dpo_from_lora_sft"
    argv = args(base, "dpo", dpo, "--train.steps=2", "--train.eval_every=2")
    argv[argv.index("--ckpt") + 1] = str(sft)
    assert main(argv) == 0
    assert "val_preference_accuracy" in evaluate_checkpoint(str(dpo), device="cpu")


@pytest.mark.slow
def test_builtin_data_come_from_finetune_data(base, tmp_path, capsys):
    """--data.source builtin: the train and val splits of finetune.data's instructions (sft)
    and of the preference pairs made from them (dpo), capped by data.max_examples."""
    built = data.build_instructions(max_examples=12)
    for task, splits in (("sft", built), ("dpo", data.build_preferences(built))):
        d = FinetuneDataConfig(task=task, source="builtin", max_examples=12)
        assert load_examples(d) == (splits.splits["train"], splits.splits["val"])
    d = FinetuneDataConfig(task="dpo", source="builtin", max_examples=12, pairs_per_prompt=3)
    splits = data.build_preferences(built, pairs_per_prompt=3).splits
    assert load_examples(d) == (splits["train"], splits["val"]) and len(splits["train"]) > 24
    tok = train_char_tokenizer([string.printable])
    cfg = replace(get_preset("llama-tiny"), vocab_size=tok.vocab_size, n_layers=1, max_seq_len=320)
    ckpt = tmp_path / "wide"
    save_checkpoint(ckpt, build_model(cfg), None, RunConfig(model=cfg), {}, tokenizer=tok)
    for task in ("sft", "dpo"):
        argv = args(base, task, tmp_path / task, "--train.steps=1", "--data.max_examples=12")
        argv[argv.index("--data.source") + 1] = "builtin"
        argv[argv.index("--ckpt") + 1] = str(ckpt)
        argv += ["--train.context=320", "--data.eval_examples=4", "--train.batch_size=2"]
        assert main(argv) == 0
        assert f"task: {task} on builtin: 12 training, 4 held-out" in capsys.readouterr().out


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.hf
def test_sft_from_an_hf_directory(base, tmp_path, capsys):
    """The base may be an HF checkpoint directory (a GPT-2 saved by transformers, with a
    tokenizer.json beside it): converted on opening, then fine-tuned like any decoder."""
    T = pytest.importorskip("transformers")
    from attnlab.interop.hf.auto import save_tokenizer

    tok = Tokenizer.from_file(base["ckpt"])
    torch.manual_seed(0)
    config = T.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=tok.vocab_size, n_positions=32)
    hf_dir = tmp_path / "gpt2"
    T.GPT2LMHeadModel(config).save_pretrained(hf_dir)
    save_tokenizer(tok, hf_dir)
    argv = args(base, "sft", tmp_path / "out", "--train.steps=8", "--train.eval_every=8")
    argv[argv.index("--ckpt") + 1] = str(hf_dir)
    assert main(argv) == 0
    assert "base: " + str(hf_dir) in capsys.readouterr().out
    rows = records(tmp_path / "out")
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and "val_exact_match" in rows[-1]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_a_config_file_sets_the_sections_and_flags_win(base, tmp_path):
    config = tmp_path / "ft.yaml"
    config.write_text(
        "train:\n  steps: 2\n  lr: 0.002\ndpo:\n  beta: 0.25\ndata:\n  eval_examples: 4\n"
    )
    out = tmp_path / "out"
    argv = args(base, "dpo", out, "--config", str(config), "--train.eval_every=2")
    assert main(argv + ["--train.lr=0.001"]) == 0
    saved = json.loads((out / "checkpoints" / "step_000002" / "config.json").read_text())
    assert saved["train"]["steps"] == 2 and saved["dpo"]["beta"] == 0.25
    assert saved["train"]["lr"] == 0.001  # the flag wins over the file
    assert saved["data"]["task"] == "dpo" and saved["lora"]["rank"] == 0


@pytest.mark.parametrize("order", [("lr", "min_lr"), ("min_lr", "lr")])
def test_a_low_lr_with_its_min_lr_is_taken_in_either_order(order):
    """--train.lr below the default min_lr, with --train.min_lr below it too (as the error for
    the lr alone advises): both are applied, whichever comes first on the command line."""
    parser = argparse.ArgumentParser()
    add_parser(parser)
    values = {"lr": "1e-5", "min_lr": "1e-6"}
    flags = [f"--train.{k}={values[k]}" for k in order]
    configs = configs_from_args(parser.parse_args(["--ckpt", "x", *flags]))
    assert (configs["train"].lr, configs["train"].min_lr) == (1e-5, 1e-6)
    with pytest.raises(ValueError, match="set --train.min_lr too"):  # the lr alone: still named
        configs_from_args(parser.parse_args(["--ckpt", "x", "--train.lr=1e-5"]))


# --- task heads: classify and tag -------------------------------------------------------------


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict:
    """A 1-layer BERT-style encoder base (random weights), a character tokenizer, and data a
    small model learns in a few dozen steps: the label of a text is the letter group of its
    first word (classify); an all-capitals word is B-UP, any other O (tag)."""
    root = tmp_path_factory.mktemp("heads")
    rng = random.Random(1)

    def word(letters: str) -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(2, 4)))

    texts = [[word("abcdefxyz") for _ in range(rng.randint(2, 4))] for _ in range(160)]
    groups = ["abc" if i % 2 else "xyz" for i in range(len(texts))]
    classify = [{"text": " ".join([word(g), *w]), "label": g} for g, w in zip(groups, texts)]
    tag = []
    for w in texts:
        caps = [rng.random() < 0.4 for _ in w]
        tokens = [x.upper() if c else x for x, c in zip(w, caps)]
        tag.append({"tokens": tokens, "tags": ["B-UP" if c else "O" for c in caps]})
    tok = train_char_tokenizer([string.ascii_letters + " "])
    cfg = replace(get_preset("bert-tiny"), vocab_size=tok.vocab_size, n_layers=1, max_seq_len=32)
    torch.manual_seed(0)
    save_checkpoint(root / "bert", build_model(cfg), None, RunConfig(model=cfg), {}, tokenizer=tok)
    return {
        "ckpt": root / "bert",
        "classify": write_jsonl(root / "classify.jsonl", classify),
        "tag": write_jsonl(root / "tag.jsonl", tag),
    }


def head_args(heads: dict, task: str, out: Path, *extra: str) -> list[str]:
    argv = args(heads, task, out, "--train.steps=40", "--train.eval_every=40", *extra)
    return argv + ["--data.eval_examples=16", "--train.lr=1e-2", "--train.warmup=0"]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_classify_learns_above_the_majority_and_eval_reports_it(heads, tmp_path, capsys):
    """--task classify: a fresh sequence head on the encoder base, trained in full; accuracy
    on the held-out lines well above the majority class, and attnlab eval reports the same."""
    out = tmp_path / "classify"
    assert main(head_args(heads, "classify", out)) == 0
    assert "task: classify on " in capsys.readouterr().out
    last = records(out)[-1]
    assert last["val_accuracy"] >= 0.9 and last["val_majority"] <= 0.7, last
    saved = json.loads((out / "checkpoints" / "step_000040" / "config.json").read_text())
    assert saved["model"]["head"]["labels"] == ["abc", "xyz"]
    got = evaluate_checkpoint(str(out), device="cpu")
    assert got == pytest.approx({k: last[k] for k in got}, abs=1e-6)


@pytest.mark.slow
def test_tag_learns_entities_with_lora_and_the_head_trains(heads, tmp_path):
    """--task tag with LoRA: the adapters and the new token head train (the head in full, as
    peft's modules_to_save), the encoder's own weights stay the base's; entity F1 (seqeval)
    is high on held-out lines."""
    out = tmp_path / "tag"
    extra = ("--lora.rank=4", "--lora.targets=q_proj,k_proj,v_proj,o_proj,up_proj,down_proj")
    assert main(head_args(heads, "tag", out, *extra)) == 0
    last = records(out)[-1]
    assert last["val_f1"] >= 0.9, last
    after = load_file(str(out / "checkpoints" / "step_000040" / "model.safetensors"))
    before = load_file(str(heads["ckpt"] / "model.safetensors"))
    assert {k for k in after if "lora_" not in k} == {"classifier.weight", "classifier.bias"}
    opened = open_checkpoint(out, keep_adapters=True).model.state_dict()
    body = {k.replace(".base.", "."): v for k, v in opened.items() if "lora_" not in k}
    kept = [k for k in body if k in before]
    assert kept and all(torch.equal(body[k], before[k]) for k in kept)
    assert evaluate_checkpoint(str(out), device="cpu")["val_f1"] == pytest.approx(last["val_f1"])


def test_tag_on_a_decoder_base_is_one_clear_error(base, heads, tmp_path, capsys):
    argv = head_args(heads, "tag", tmp_path / "out")
    argv[argv.index("--ckpt") + 1] = str(base["ckpt"])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "task 'tag' needs a base model with arch in ['encoder']" in err
    assert str(base["ckpt"]) in err and len(err.splitlines()) == 1


# --- chat: the tokenizer's special tokens and template, generate --chat -------------------------


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_train_takes_special_tokens_for_the_chat_markers(tmp_path, kind):
    """attnlab train --data.special_tokens: each marker is one id that the tokenizer never
    splits, and "chat" brings the default chat template, saved with the checkpoint."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 40)
    argv = ["train", "--data.source", str(corpus), "--data.tokenizer", kind]
    argv += ["--data.special_tokens", "<|endoftext|>, chat", "--data.bpe_vocab_size=300"]
    argv += ["--data.cache_dir", str(tmp_path / "cache"), "--train.out_dir", str(tmp_path / "run")]
    argv += ["--train.steps=1", "--train.batch_size=2", "--train.context=16"]
    argv += ["--train.eval_every=1", "--train.eval_batches=1", "--train.sample_tokens=4"]
    argv += ["--train.progress=false", "--train.device=cpu", "--model.n_layers=1"]
    assert main(argv) == 0
    tok = open_checkpoint(tmp_path / "run").tokenizer
    markers = ["<|endoftext|>", *CHAT_TOKENS]
    ids = [tok.token_id(m) for m in markers]
    assert None not in ids and len(set(ids)) == 5
    assert tok.encode("a<|user|>b<|end|>") == [*tok.encode("a"), ids[2], *tok.encode("b"), ids[4]]
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE


def test_train_special_tokens_with_a_tokenizer_file_is_one_clear_error(tmp_path, capsys):
    argv = ["train", "--data.tokenizer", str(tmp_path / "tok.json"), "--data.special_tokens=chat"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "data.special_tokens='chat' applies to a tokenizer trained here" in err
    assert len(err.splitlines()) == 1


CHAT_SFT = [
    {"prompt": "up ab:", "response": "AB"},
    {"prompt": "up cde:", "response": "CDE"},
    {"prompt": "up f:", "response": "F"},
    {"prompt": "up bad:", "response": "BAD"},
]


@pytest.mark.slow
def test_generate_chat_uses_the_template_and_stops_at_its_end_of_turn(tmp_path, capsys):
    """A model that learnt four chat examples by heart (SFT through the tokenizer's template):
    generate --chat writes the prompt as the template's user turn, stops at <|end|> and prints
    the reply alone; without --chat the same words are plain text to continue."""
    tok = train_char_tokenizer(["up abcdef: ABCDEF\n"], special_tokens=CHAT_TOKENS)
    cfg = replace(get_preset("llama-tiny"), vocab_size=tok.vocab_size, n_layers=2, max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(cfg)
    task = SFTTask(CHAT_SFT, CHAT_SFT, tok, batch_size=4, context=48, max_new_tokens=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        batch = task.train_batch(gen)
        loss = task.loss_sum(model, batch) / task.n_targets(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert task.evaluate(model.eval(), 1, "cpu")["val_exact_match"] == 1.0
    ckpt = tmp_path / "chat"
    save_checkpoint(ckpt, model, None, RunConfig(model=cfg), {}, tokenizer=tok)
    common = ["generate", "--ckpt", str(ckpt), "--temperature", "0", "--device", "cpu"]
    for ex in CHAT_SFT:
        assert main([*common, "--chat", "--prompt", ex["prompt"], "--max-new-tokens", "12"]) == 0
        assert capsys.readouterr().out == ex["response"] + "\n"
    assert main([*common, "--prompt", "up cde:", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("up cde:")


def test_generate_chat_without_a_template_is_one_clear_error(base, capsys):
    argv = ["generate", "--ckpt", str(base["ckpt"]), "--chat", "--prompt", "hi", "--device=cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "has no chat template" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_qlora_on_an_int8_base_trains_and_reopens(base, tmp_path, capsys):
    """QLoRA: LoRA on the int8 checkpoint `attnlab quantize` writes. Only the adapters train;
    the checkpoint reopens with its adapters unmerged on the int8 Linears (read from the base
    the run recorded), and attnlab eval reports the run's last metrics."""
    int8 = tmp_path / "int8"
    assert (
        main(["quantize", "--ckpt", str(base["ckpt"]), "--scheme", "int8", "--out", str(int8)]) == 0
    )
    out = tmp_path / "qlora"
    argv = args(base, "sft", out, "--train.steps=4", "--train.eval_every=4", "--lora.rank=4")
    argv[argv.index("--ckpt") + 1] = str(int8)
    assert main(argv) == 0
    text = capsys.readouterr().out
    lora_params = 4 * (64 + 64) + 4 * (64 + 32)  # q: A (4, 64), B (64, 4); v: A, B (32, 4)
    assert f"trained: LoRA rank 4 on q_proj,v_proj, {lora_params:,} parameters" in text
    loaded = open_checkpoint(out)
    adapters = lora_modules(loaded.model)
    assert sorted(adapters) == ["blocks.0.self_attn.q_proj", "blocks.0.self_attn.v_proj"]
    assert all(type(m.base).__name__ == "Int8Linear" and not m.merged for m in adapters.values())
    last = [r for r in records(out) if "val_loss" in r][-1]
    got = evaluate_checkpoint(str(out), device="cpu")
    assert got == pytest.approx({k: v for k, v in last.items() if k.startswith("val_")}, abs=1e-5)


@pytest.mark.slow
def test_builtin_classify_holds_out_every_package_among_the_first_examples():
    """The built-in classification examples come grouped by package; the held-out ones are
    put in a seeded order, so the first eval_examples are not all one class (they were)."""
    train, val = load_examples(
        FinetuneDataConfig(task="classify", source="builtin", max_examples=80)
    )
    built = data.build_classification(max_per_class=10).splits
    assert train == built["train"] and sorted(map(str, val)) == sorted(map(str, built["val"]))
    assert len({ex["label"] for ex in val[:24]}) >= 6


@pytest.mark.slow
def test_generate_refuses_a_fine_tuned_tagger_in_one_line(heads, tmp_path, capsys):
    out = tmp_path / "tag"
    assert main(head_args(heads, "tag", out, "--train.steps=1", "--data.eval_before=false")) == 0
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(out), "--prompt", "ab", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a token classifier (2 labels) with no LM head" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_a_head_on_a_quantized_base_trains_qlora_or_is_one_clear_error(heads, tmp_path, capsys):
    """QLoRA with a task head: the int8 body is the base's as it is (codes and scales; they
    were once copied into float weights without a word), the adapters and the float head
    train, and attnlab eval reopens it with the same accuracy. Without --lora.rank the int8
    weights could not train: one clear error."""
    int8 = tmp_path / "int8"
    assert (
        main(["quantize", "--ckpt", str(heads["ckpt"]), "--scheme", "int8", "--out", str(int8)])
        == 0
    )
    capsys.readouterr()
    argv = head_args(heads, "classify", tmp_path / "full", "--train.steps=2")
    argv[argv.index("--ckpt") + 1] = str(int8)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"the base checkpoint {str(int8)!r} is quantized" in err and "torch.int8" in err
    assert "give --lora.rank" in err and len(err.splitlines()) == 1
    out = tmp_path / "qlora"
    argv = head_args(heads, "classify", out, "--lora.rank=2", "--train.steps=4")
    argv[argv.index("--ckpt") + 1] = str(int8)
    assert main(argv + ["--train.eval_every=4"]) == 0
    base = load_file(str(int8 / "model.safetensors"))
    after = load_file(str(out / "checkpoints" / "step_000004" / "model.safetensors"))
    assert all(t.is_floating_point() for t in after.values())  # no int8 body: the base's
    opened = open_checkpoint(out).model.state_dict()  # QLoRA: the adapters kept unmerged
    q = "encoder.blocks.0.self_attn.q_proj"
    assert opened[f"{q}.base.weight"].dtype == torch.int8
    for leaf in ("weight", "scales"):
        assert torch.equal(opened[f"{q}.base.{leaf}"], base[f"{q}.{leaf}"])
    assert after[f"{q}.lora_B"].abs().max() > 0 and after["classifier.weight"].is_floating_point()
    last = records(out)[-1]
    got = evaluate_checkpoint(str(out), device="cpu")
    assert got == pytest.approx({k: last[k] for k in got}, abs=1e-6)


@pytest.mark.slow
def test_a_head_run_with_lora_resumes_exactly(heads, tmp_path):
    """classify with LoRA: 3 steps, then --resume to 6, equals 6 steps in one go (the same
    losses and weights: the head and adapters are built the same way before loading)."""
    common = ("--train.schedule=constant", "--train.eval_every=3", "--train.ckpt_every=3")
    common += ("--lora.rank=2", "--data.eval_before=false")
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(head_args(heads, "classify", whole, *common, "--train.steps=6")) == 0
    assert main(head_args(heads, "classify", split, *common, "--train.steps=3")) == 0
    assert main(head_args(heads, "classify", split, *common, "--train.steps=6", "--resume")) == 0
    assert [r["train_loss"] for r in records(split)] == [r["train_loss"] for r in records(whole)]
    a = load_file(str(whole / "checkpoints" / "step_000006" / "model.safetensors"))
    b = load_file(str(split / "checkpoints" / "step_000006" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_lora_bias_norms_and_mean_pooling_reach_the_run_and_reopen(heads, tmp_path, capsys):
    """--lora.bias all --lora.modules_to_save norm --head.pooling mean: the header says so,
    the biases and LayerNorms move beside the adapters while the adapted weights stay the
    base's, and attnlab eval reopens the mean-pooled head with the same accuracy."""
    out = tmp_path / "extras"
    extra = ("--lora.rank=2", "--lora.bias=all", "--lora.modules_to_save=norm")
    argv = head_args(heads, "classify", out, *extra, "--head.pooling=mean", "--train.steps=4")
    assert main(argv + ["--train.eval_every=4"]) == 0
    text = capsys.readouterr().out
    assert "bias all, modules_to_save norm, mean-pooled head" in text
    saved = json.loads((out / "checkpoints" / "step_000004" / "config.json").read_text())
    assert saved["model"]["head"]["pooling"] == "mean" and saved["lora"]["bias"] == "all"
    before = load_file(str(heads["ckpt"] / "model.safetensors"))
    after = load_file(str(out / "checkpoints" / "step_000004" / "model.safetensors"))
    q = "encoder.blocks.0.self_attn.q_proj"
    assert f"{q}.base.weight" not in after  # frozen: the base's
    opened = open_checkpoint(out, keep_adapters=True).model.state_dict()
    assert torch.equal(opened[f"{q}.base.weight"], before[f"{q}.weight"])
    assert not torch.equal(after[f"{q}.base.bias"], before[f"{q}.bias"])
    norm = "encoder.embed_norm.weight"
    assert not torch.equal(after[norm], before[norm])
    last = records(out)[-1]
    got = evaluate_checkpoint(str(out), device="cpu")
    assert got == pytest.approx({k: last[k] for k in got}, abs=1e-6)


@pytest.mark.parametrize(("extra", "copied"), [((), False), (("--lora.bias=all",), True)])
def test_dpo_keeps_a_frozen_reference_when_base_weights_train_beside_lora(base, extra, copied):
    """DPO's reference under LoRA is the policy with its adapters off, unless biases or whole
    modules train too (they stay on with the adapters off): then a frozen copy, as without
    LoRA."""
    parser = argparse.ArgumentParser()
    add_parser(parser)
    argv = args(base, "dpo", Path("unused"), "--lora.rank=2", *extra)[1:]
    parsed = parser.parse_args(argv)
    model, task, _ = build_finetune(configs_from_args(parsed), parsed.ckpt)
    assert (task.reference is not None) == copied
    if copied:
        assert task.reference is not model and not lora_modules(task.reference)
        assert all(not p.requires_grad for p in task.reference.parameters())


# --- the reward model and GRPO --------------------------------------------------------------------
def uppercase_share(prompts, completions, **fields):
    """A reward the tiny base can reach in a few steps: the share of upper-case characters."""
    return [sum(ch.isupper() for ch in c) / max(len(c), 1) for c in completions]


def not_a_number(prompts, completions, **fields):
    return ["high"] * len(completions)


@pytest.mark.slow
def test_reward_model_then_grpo_from_it_with_lora(base, tmp_path, capsys):
    """--task reward learns the pairs (held-out pairwise accuracy 1.0; `attnlab eval` agrees);
    then GRPO with LoRA, rewarded by that model (RLHF), raises the held-out reward."""
    rm = tmp_path / "rm"
    extra = ("--train.steps=30", "--train.eval_every=30")
    assert main(args(base, "reward", rm, *extra)) == 0
    last = records(rm)[-1]
    assert last["val_accuracy"] == 1.0 and last["val_margin"] > 1.0
    assert evaluate_checkpoint(str(rm), device="cpu")["val_accuracy"] == 1.0
    out = tmp_path / "grpo"
    extra = ("--train.steps=10", "--train.eval_every=10", "--train.batch_size=4")
    extra += (f"--grpo.reward={rm}", "--grpo.max_completion_length=8", "--lora.rank=4")
    assert main(args(base, "grpo", out, "--train.lr=1e-2", *extra)) == 0
    text = capsys.readouterr().out
    assert "4 prompts x 4 completions" in text and "LoRA rank 4" in text
    before = float(text.split("before fine-tuning: ")[-1].split("val_reward ")[1].split()[0])
    assert records(out)[-1]["val_reward"] > before + 1.0


@pytest.mark.slow
def test_a_reward_function_that_returns_no_number_stops_in_one_line(base, tmp_path, capsys):
    reward = "--grpo.reward=tests.cli.test_finetune:not_a_number"
    argv = args(base, "grpo", tmp_path / "out", "--train.steps=1", "--data.eval_examples=1", reward)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab finetune: error: the reward function ") and "\n" not in err
    assert "tests.cli.test_finetune:not_a_number returned 'high'" in err


@pytest.mark.slow
def test_grpo_resumes_exactly(base, tmp_path):
    """GRPO samples inside its batches from a seed the run's generator draws: 2 steps, then
    --resume to 4, equal 4 steps in one go (the same losses and weights)."""
    common = ("--train.schedule=constant", "--train.warmup=0", "--train.eval_every=2")
    common += ("--train.ckpt_every=2", "--train.batch_size=2", "--data.eval_examples=2")
    common += ("--grpo.reward=tests.cli.test_finetune:uppercase_share", "--grpo.beta=0.1")
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(args(base, "grpo", whole, "--train.steps=4", *common)) == 0
    assert main(args(base, "grpo", split, "--train.steps=2", *common)) == 0
    assert main(args(base, "grpo", split, "--train.steps=4", "--resume", *common)) == 0
    assert [r["train_loss"] for r in records(split)] == [r["train_loss"] for r in records(whole)]
    a = load_file(str(whole / "checkpoints" / "step_000004" / "model.safetensors"))
    b = load_file(str(split / "checkpoints" / "step_000004" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_help_says_what_finetune_and_convert_do():
    """`attnlab --help` (the COMMANDS summaries) names every fine-tuning task and the ways to
    train (it said "SFT or DPO" once heads had come), and convert's peft output."""
    from attnlab.cli.__main__ import COMMANDS
    from attnlab.finetune.run import FINETUNE_TASKS

    summary = COMMANDS["finetune"]
    assert all(task in summary.lower() for task in FINETUNE_TASKS), summary
    assert "LoRA" in summary and "QLoRA" in summary and "full" in summary
    assert "peft" in COMMANDS["convert"] and "GGUF" in COMMANDS["convert"]
