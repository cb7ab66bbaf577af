"""`attnlab convert --from attnlab RUN --to peft DIR`: the adapters of an `attnlab finetune
--lora.rank` run, loaded by `peft` onto the HF export of the run's base, give the run's logits
(a causal LM; a classifier with its head, biases and norms trained beside the adapters); and
the refusals, each one line."""

import json
import string
from dataclasses import replace

import pytest
import torch

from attnlab.adapters.lora import lora_modules
from attnlab.checkpoint import open_checkpoint, save_checkpoint
from attnlab.cli.__main__ import main
from attnlab.cli.convert import write_peft
from attnlab.interop.peft import save_run_peft
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.tokenizer import train_char_tokenizer
from attnlab.training.config import RunConfig

TEXT = string.ascii_lowercase + " :"


def write_base(path, preset: str):
    tok = train_char_tokenizer([TEXT])
    cfg = replace(get_preset(preset), vocab_size=tok.vocab_size, n_layers=1, max_seq_len=32)
    torch.manual_seed(0)
    return save_checkpoint(path, build_model(cfg), None, RunConfig(model=cfg), {}, tokenizer=tok)


def finetune(base, task: str, data: list[dict], out, *extra: str):
    source = out.parent / f"{task}.jsonl"
    source.write_text("".join(json.dumps(e) + "\n" for e in data))
    argv = ["finetune", "--ckpt", str(base), "--task", task, "--data.source", str(source),
            "--train.out_dir", str(out), "--train.steps=3", "--train.eval_every=3",
            "--train.lr=1e-2", "--train.warmup=0", "--train.batch_size=4", "--train.context=24",
            "--train.sample_tokens=0", "--data.eval_before=false", "--train.progress=false",
            "--train.device=cpu", "--data.eval_examples=2", "--data.max_new_tokens=2",
            "--lora.rank=4", *extra]  # fmt: skip
    assert main(argv) == 0
    return out


def convert(*argv: str) -> int:
    return main(["convert", *argv])


@pytest.mark.slow  # two fine-tuning runs of 3 steps
@pytest.mark.hf
@pytest.mark.parametrize("task", ["sft", "classify"])
def test_a_lora_run_converts_to_a_peft_adapter_that_peft_loads(task, tmp_path, capsys):
    T = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    if task == "sft":
        base = write_base(tmp_path / "base", "llama-tiny")
        words = [TEXT[i : i + 3] for i in range(0, 24, 3)]
        data = [{"prompt": f"up {w}:", "response": w[::-1]} for w in words]
        run = finetune(base, task, data, tmp_path / "run", "--lora.targets=q,v,mlp")
    else:
        base = write_base(tmp_path / "base", "bert-tiny")
        data = [{"text": f"{c} {c}{c}", "label": "ab"[i % 2]} for i, c in enumerate(TEXT[:20])]
        extra = ("--lora.targets=q,v", "--lora.bias=all", "--lora.modules_to_save=norm")
        run = finetune(base, task, data, tmp_path / "run", *extra)
    assert convert("--from", "attnlab", str(base), "--to", "hf", str(tmp_path / "hf")) == 0
    assert convert("--from", "attnlab", str(run), "--to", "peft", str(tmp_path / "peft")) == 0
    assert "wrote peft adapter" in capsys.readouterr().out
    again = ("--from", "attnlab", str(run), "--to", "peft", str(tmp_path / "peft"))
    assert convert(*again) == 2  # a non-empty target: one line naming --overwrite
    err = capsys.readouterr().err.strip()
    assert "not empty" in err and "--overwrite" in err and len(err.splitlines()) == 1
    assert convert(*again, "--overwrite") == 0
    hf_class = T.LlamaForCausalLM if task == "sft" else T.BertForSequenceClassification
    hf = hf_class.from_pretrained(tmp_path / "hf", **({} if task == "sft" else {"num_labels": 2}))
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    ours = open_checkpoint(run).model  # merged, as every other command opens it
    x = torch.randint(3, len(TEXT), (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - ours(x)).abs().max() <= 1e-5
    adapters = lora_modules(open_checkpoint(run, keep_adapters=True).model).values()
    assert all(m.lora_B.abs().max() > 0 for m in adapters)  # trained: B moved off zero


def test_convert_to_peft_refuses_what_it_cannot_write(tmp_path):
    """A non-empty target (nothing there touched), a checkpoint without adapters, a source
    that is not an attnlab run."""
    base = write_base(tmp_path / "base", "llama-tiny")
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("keep me\n")
    with pytest.raises(ValueError, match="not empty .* pass --overwrite"):
        save_run_peft(base, target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="holds no LoRA adapters"):
        save_run_peft(base, tmp_path / "new")
    with pytest.raises(ValueError, match="give --from attnlab RUN"):
        write_peft("hf", str(base), str(tmp_path / "new"), overwrite=False)
    assert not (tmp_path / "new").exists()
