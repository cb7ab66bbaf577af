"""LoRA adapters chosen per request (`attnlab serve --lora NAME=DIR`): the per-row module against
LoRALinear, mixed-adapter batches of the batched engine and the server (through the `openai`
client) token-identical to each adapter merged into the base and run alone, and the errors."""

import copy
import json

import openai
import pytest
import torch

from attnlab.adapters.config import LoraConfig
from attnlab.adapters.lora import add_lora, lora_modules, merge_lora
from attnlab.adapters.multi_lora import MultiLoRALinear, adapter_rows
from attnlab.checkpoint import open_checkpoint, save_checkpoint
from attnlab.cli.__main__ import main
from attnlab.cli.serve import adapter_weights, add_served_adapters
from attnlab.finetune.run import FinetuneRun
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.interop.peft import load_peft, save_peft
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.serve.engine import Engine
from attnlab.serve.types import EngineConfig, Request, SamplingParams
from tests.serve.server_helpers import Server, write_checkpoint

# (targets, rank, alpha, rslora) of each adapter: different modules, ranks and scalings
ADAPTERS = {
    "sql": (("q", "v"), 4, 8.0, False),
    "chat": (("q", "k", "v", "o", "mlp"), 8, 4.0, True),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny checkpoint and two random adapters for it, saved in the PEFT format."""
    root = tmp_path_factory.mktemp("multi_lora")
    ckpt = write_checkpoint(root / "tiny")
    loaded = open_checkpoint(ckpt)
    for i, (name, (targets, rank, alpha, rslora)) in enumerate(ADAPTERS.items()):
        model = copy.deepcopy(loaded.model)
        add_lora(model, targets, rank=rank, alpha=alpha, rslora=rslora)
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_B.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(i))
        save_peft(model, loaded.config, root / name)
    return ckpt, {name: root / name for name in ADAPTERS}


def merged(ckpt, path):
    """The reference: the adapter loaded the usual way and merged into the base."""
    loaded = open_checkpoint(ckpt)
    load_peft(loaded.model, loaded.config, path)
    merge_lora(loaded.model)
    return loaded.model


def greedy(model, prompt, n):
    config = GenerationConfig(n, SamplingConfig(temperature=0))
    return generate(model, [list(prompt)], config)[0]


def test_each_row_through_its_own_adapter_equals_lora_linear():
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 12)
    loras = []
    for rank, alpha, rs in [(2, 4.0, False), (5, 3.0, True)]:
        lora = copy.deepcopy(base)
        wrapper = torch.nn.Sequential(lora)
        add_lora(wrapper, ["0"], rank=rank, alpha=alpha, rslora=rs)
        with torch.no_grad():
            wrapper[0].lora_B.normal_()
        loras.append(wrapper[0])
    multi = MultiLoRALinear(base, [(m.lora_A, m.lora_B, m.scale) for m in loras])
    x = torch.randn(3, 4, 16)
    rows = torch.tensor([2, 0, 1])
    with torch.no_grad(), adapter_rows(torch.nn.Sequential(multi), rows):
        got = multi(x)
        for b, i in enumerate(rows.tolist()):
            expected = base(x[b]) if i == 0 else loras[i - 1](x[b])
            assert (got[b] - expected).abs().max() < 1e-6
    assert multi.rows is None  # forgotten after the block: the base alone
    assert torch.equal(multi(x), base(x))


@pytest.mark.slow
def test_a_mixed_adapter_batch_equals_each_adapter_merged_and_alone(served):
    """Requests for the base and both adapters, the same prompts among them (the prefix cache
    must keep their blocks apart), in one continuous batch: token-identical to each adapter
    merged into the base and generated alone."""
    ckpt, dirs = served
    loaded = open_checkpoint(ckpt)
    specs = [f"{n}={d}" for n, d in dirs.items()]
    add_served_adapters(loaded.model, loaded.config, specs, "tiny")
    config = EngineConfig(max_batch=8, block_size=4, max_context=64)
    engine = Engine(loaded.model, None, config)
    prompts = [(5, 6, 7, 8, 9, 10, 11, 12, 13), (20, 21, 22), (5, 6, 7, 8, 9, 10, 11, 12, 14)]
    requests = [
        Request(f"r{a}{p}", prompt, SamplingParams(max_tokens=8, temperature=0.0), adapter=a)
        for p, prompt in enumerate(prompts)
        for a in range(3)
    ]
    events = {r.request_id: [] for r in requests}
    for r in requests:
        engine.submit(r, events[r.request_id].append)
    while engine.step():
        pass
    references = [open_checkpoint(ckpt).model] + [merged(ckpt, d) for d in dirs.values()]
    for r in requests:
        got = [e.token_id for e in events[r.request_id] if e.token_id is not None]
        assert got == greedy(references[r.adapter], r.prompt_ids, 8), r.request_id
    base_tokens = {tuple(greedy(references[0], p, 8)) for p in prompts}
    adapted = {tuple(greedy(references[1], p, 8)) for p in prompts}
    assert base_tokens != adapted  # the adapters change what is generated


@pytest.mark.slow
def test_the_server_lists_adapters_and_a_request_picks_one_by_model(served):
    ckpt, dirs = served
    server = Server(ckpt, Engine, lora=[f"{n}={d}" for n, d in dirs.items()])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        cards = client.models.list().data
        assert [m.id for m in cards] == ["tiny", "sql", "chat"]
        assert [getattr(m, "parent", None) for m in cards] == [None, "tiny", "tiny"]
        prompt = "the cat sat"
        ids = server.tokenizer.encode(prompt)
        for name, path in dirs.items():
            got = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
            assert got.model == name
            expected = greedy(merged(ckpt, path), ids, 6)
            assert got.choices[0].text == server.tokenizer.decode(expected)
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="nope", prompt=prompt, max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and "'sql'" in e.value.body["message"]
    finally:
        server.close()


@pytest.mark.slow  # opens the checkpoint (about 0.5 s each)
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sql", "give NAME=DIR"),
        ("x={here}", "is no LoRA adapter (no adapter_config.json nor config.json): give a peft"),
        ("x={gpt2}", "is it for another base model?"),
    ],
)
def test_a_bad_lora_flag_is_one_line(served, tmp_path, capsys, spec, message):
    ckpt, _ = served
    cfg = get_preset("gpt2-tiny")
    other = build_model(cfg)
    add_lora(other, ("q", "v"), rank=2)
    save_peft(other, cfg, tmp_path / "gpt2")
    spec = spec.format(here=tmp_path, gpt2=tmp_path / "gpt2")
    assert main(["serve", "--ckpt", str(ckpt), "--device", "cpu", "--lora", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and "--lora" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_an_attnlab_lora_run_serves_as_its_peft_export_does(served, tmp_path):
    """--lora DIR may name an `attnlab finetune --lora.rank R` run on the same base: the same
    adapter as its PEFT export; a run on another base (other weights) is refused."""
    ckpt, _ = served
    loaded = open_checkpoint(ckpt)
    model = copy.deepcopy(loaded.model)
    add_lora(model, ("q", "v"), rank=4, alpha=8.0)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0.0, 0.3)
    lora = LoraConfig(rank=4, alpha=8.0, targets="q_proj,v_proj")
    run = FinetuneRun(model=loaded.config, lora=lora)
    save_checkpoint(tmp_path / "run", model, None, run, {})
    save_peft(model, loaded.config, tmp_path / "peft")
    from_run = adapter_weights(loaded.model, loaded.config, tmp_path / "run")
    from_peft = adapter_weights(loaded.model, loaded.config, tmp_path / "peft")
    assert sorted(from_run) == sorted(from_peft)
    for name, (A, B, s) in from_run.items():
        A2, B2, s2 = from_peft[name]
        assert torch.equal(A, A2) and torch.allclose(B, B2) and s == s2
    with torch.no_grad():
        next(loaded.model.parameters()).add_(1.0)  # the served base is another model now
    with pytest.raises(ValueError, match="trained on another base model"):
        adapter_weights(loaded.model, loaded.config, tmp_path / "run")


@pytest.mark.slow  # fine-tunes 2 steps, then serves (about 5 s)
def test_a_lora_run_directory_serves_its_latest_checkpoint(served, tmp_path):
    """--lora NAME=RUN_DIR reads the run's latest checkpoint, as --ckpt RUN_DIR does: its
    completions are those of --lora NAME=RUN_DIR/checkpoints/<latest>, and /v1/models names
    that checkpoint."""
    ckpt, _ = served
    sft = tmp_path / "sft.jsonl"
    words = ["cat", "dog", "mat", "bone", "hello", "world"]
    lines = [json.dumps({"prompt": f"the {w}", "response": f" sat on the {w}."}) for w in words]
    sft.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    finetune = ["finetune", "--ckpt", str(ckpt), "--task", "sft", "--data.source", str(sft)]
    finetune += ["--lora.rank=2", "--train.steps=2", "--train.ckpt_every=1", "--train.lr=1e-2"]
    finetune += ["--train.eval_every=2", "--data.eval_before=false", "--data.eval_examples=1"]
    finetune += ["--data.max_new_tokens=1", "--train.batch_size=2", "--train.context=32"]
    finetune += ["--train.progress=false", "--train.device=cpu", "--train.out_dir", str(run)]
    assert main(finetune) == 0
    steps = run / "checkpoints"
    assert (steps / "step_000001").is_dir()  # the run has two checkpoints; latest names the 2nd
    assert (steps / "latest").read_text().strip() == "step_000002"
    lora = [f"run={run}", f"latest={steps / 'step_000002'}"]
    server = Server(ckpt, lora=lora)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        roots = {m.id: getattr(m, "root", None) for m in client.models.list().data}
        assert roots["run"] == roots["latest"] == str((steps / "step_000002").resolve())
        for prompt in ("the cat", "hello world, hello"):
            texts = [
                client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
                for name in ("run", "latest")
            ]
            assert texts[0].choices[0].text == texts[1].choices[0].text, prompt
    finally:
        server.close()
