"""Smoke tests of `attnlab generate` on a checkpoint that `attnlab train` wrote (3 steps, tiny)."""

from pathlib import Path

import pytest
import torch

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.__main__ import main
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from tests.data import SHAKESPEARE
from tests.viz.checkpoints import make_checkpoint

PROMPT = "ROMEO:"


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: reproducible, and no threads spinning against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory holding a 3-step checkpoint of a 1-layer, d_model 32 Llama."""
    tmp = tmp_path_factory.mktemp("generate")
    text = SHAKESPEARE.read_text()[:4000]
    (tmp / "tiny.txt").write_text(text)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    code = main(
        [
            "train",
            "--preset",
            "llama-tiny",
            "--data.source",
            str(tmp / "tiny.txt"),
            "--data.cache_dir",
            str(tmp / "cache"),
            "--train.out_dir",
            str(tmp / "run"),
            "--train.progress",
            "false",
            "--train.steps",
            "3",
            "--train.batch_size",
            "2",
            "--train.context",
            "12",
            "--train.eval_batches",
            "1",
            "--train.sample_tokens",
            "0",
            "--train.device",
            "cpu",
            "--model.d_model",
            "32",
            "--model.n_layers",
            "1",
            "--model.d_ff",
            "64",
            "--model.max_seq_len",
            "64",
        ]
    )
    torch.set_num_threads(before)
    assert code == 0
    return tmp / "run"


def checkpoint(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed before
    code = main(["generate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_makes_five_tokens_as_the_library_does(run_dir, capsys):
    code, out, _ = cli(
        capsys,
        "--ckpt",
        str(checkpoint(run_dir)),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "5",
        "--seed",
        "0",
    )
    assert code == 0
    loaded = open_checkpoint(checkpoint(run_dir))
    model, tok = loaded.model, loaded.tokenizer
    eos = tok.token_id("<eos>")
    new = generate(
        model,
        [tok.encode(PROMPT)],
        GenerationConfig(5, SamplingConfig(), stop_tokens=[eos], seed=0),
    )[0]
    assert len(new) == 5 or new[-1] == eos
    assert out == PROMPT + tok.decode(new) + "\n"


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_stream_prints_the_same_text_as_without(run_dir, capsys):
    args = [
        "--ckpt",
        str(run_dir),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "12",
        "--seed",
        "3",
        "--top-k",
        "20",
    ]
    code, plain, _ = cli(capsys, *args)
    assert code == 0
    code, streamed, _ = cli(capsys, *args, "--stream")
    assert code == 0
    assert streamed == plain and streamed.startswith(PROMPT)


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_sampling_flags_come_from_sampling_config(run_dir, capsys):
    """--temperature 0 and --sampling.temperature 0 are one flag: greedy, whatever the seed."""
    base = ["--ckpt", str(run_dir / "checkpoints"), "--prompt", PROMPT, "--max-new-tokens", "5"]
    outs = [
        cli(capsys, *base, flag, "0", "--seed", seed)[1]
        for flag, seed in (("--temperature", "1"), ("--sampling.temperature", "2"))
    ]
    assert outs[0] == outs[1]
    loaded = open_checkpoint(checkpoint(run_dir))
    model, tok = loaded.model, loaded.tokenizer
    greedy = generate(
        model,
        [tok.encode(PROMPT)],
        GenerationConfig(5, SamplingConfig(temperature=0.0), stop_tokens=[tok.token_id("<eos>")]),
    )[0]
    assert outs[0] == PROMPT + tok.decode(greedy) + "\n"


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_the_full_sampler_flags_are_the_librarys(run_dir, capsys):
    """--logit-bias (JSON), the penalties, --min-new-tokens and --ignore-eos: the text that
    `generate` gives with the same settings."""
    loaded = open_checkpoint(checkpoint(run_dir))
    model, tok = loaded.model, loaded.tokenizer
    eos = tok.token_id("<eos>")
    flags = ["--temperature", "0", "--repetition-penalty", "1.5", "--presence-penalty", "1"]
    flags += ["--frequency-penalty", "0.5", "--logit-bias", f'{{"{eos}": 100, "7": 3}}']
    base = ["--ckpt", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "6", *flags]
    sampling = SamplingConfig(
        temperature=0,
        repetition_penalty=1.5,
        presence_penalty=1,
        frequency_penalty=0.5,
        logit_bias={eos: 100, 7: 3},
    )
    for extra, config in (
        (
            ["--min-new-tokens", "3"],
            GenerationConfig(6, sampling, stop_tokens=[eos], min_new_tokens=3),
        ),
        (["--ignore-eos"], GenerationConfig(6, sampling)),
    ):
        code, out, _ = cli(capsys, *base, *extra)
        new = generate(model, [tok.encode(PROMPT)], config)[0]
        assert code == 0 and out == PROMPT + tok.decode(new) + "\n", extra
        assert len(new) == (4 if extra[0] == "--min-new-tokens" else 6)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--logit-bias", '{"x": 1}'], "logit_bias keys must be token ids"),
        (["--logit-bias", '{"99999": 1}'], "logit_bias key 99999 is outside the vocabulary"),
        (["--presence-penalty", "3"], "presence_penalty must be in [-2.0, 2.0], got 3.0"),
        (["--min-new-tokens", "300"], "min_new_tokens must be in [0, max_new_tokens=200]"),
        (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
        (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["--num-beams", "0"], "num_beams must be >= 1, got 0"),
        (["--num-beams", "2", "--stream"], "no streaming"),
        (["--regex", "(cat"], "--regex: invalid regex"),
        (["--regex", "a{900}"], "regex constraint cannot be finished within max_new_tokens=200"),
        (["--json-schema", "/nonexistent.json"], "--json-schema /nonexistent.json: No such"),
    ],
)
def test_bad_values_exit_2_with_the_value_named(run_dir, capsys, flags, message):
    code, _, err = cli(capsys, "--ckpt", str(run_dir), "--prompt", PROMPT, *flags)
    assert code == 2 and message in err


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_beam_search_and_stop_strings(run_dir, capsys):
    code, out, _ = cli(
        capsys,
        "--ckpt",
        str(run_dir),
        "--prompt",
        PROMPT,
        "--num-beams",
        "2",
        "--max-new-tokens",
        "4",
    )
    assert code == 0 and out.startswith(PROMPT)
    code, full, _ = cli(
        capsys, "--ckpt", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12", "--seed", "1"
    )
    new = full[len(PROMPT) : -1]
    stop = new[2:4]  # a string that spans two tokens of this very output
    # "--stop=STR": the string may start with "-"
    code, cut, _ = cli(
        capsys,
        "--ckpt",
        str(run_dir),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "12",
        "--seed",
        "1",
        f"--stop={stop}",
    )
    assert code == 0
    assert cut == PROMPT + new[: new.index(stop) + len(stop)] + "\n"


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_a_note_says_when_the_output_passes_the_trained_context(run_dir, capsys):
    base = ["--ckpt", str(run_dir), "--prompt", "To", "--seed", "0"]
    code, _, err = cli(capsys, *base, "--max-new-tokens", "10")  # 2 + 10 <= context 12
    assert code == 0 and "trained on windows" not in err
    code, _, err = cli(capsys, *base, "--max-new-tokens", "11")  # 13 > 12
    assert code == 0
    assert "trained on windows of 12 tokens; prompt + --max-new-tokens is 13" in err


def test_a_classifier_is_refused_in_one_line(tmp_path, capsys):
    """Issue 18: a BERT classifier opens, and generate says why it cannot continue text."""
    ckpt = make_checkpoint(tmp_path / "clf", "bert-tiny", n_labels=3)
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sequence classifier (3 labels)" in err


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_a_learned_position_table_crops_the_context_with_a_one_line_note(tmp_path, capsys):
    """gpt2-tiny with 16 positions: 30 new tokens no longer fail; the note says the crop."""
    (tmp_path / "tiny.txt").write_text("To be or not. " * 300)
    flags = {
        "--preset": "gpt2-tiny",
        "--data.source": str(tmp_path / "tiny.txt"),
        "--data.cache_dir": str(tmp_path / "cache"),
        "--train.out_dir": str(tmp_path / "run"),
        "--train.progress": "false",
        "--train.steps": "10",
        "--train.batch_size": "2",
        "--train.context": "12",
        "--train.eval_batches": "1",
        "--train.sample_tokens": "0",
        "--train.device": "cpu",
        "--model.d_model": "32",
        "--model.n_layers": "1",
        "--model.max_seq_len": "16",
    }
    assert main(["train", *(x for kv in flags.items() for x in kv)]) == 0
    greedy = ["--temperature", "0"]  # <eos> never came in training: greedy does not pick it
    code, out, err = cli(
        capsys, "--ckpt", str(tmp_path / "run"), "--prompt", "To", "--max-new-tokens", "30", *greedy
    )
    assert code == 0 and out.startswith("To") and len(out) == len("To") + 30 + 1
    notes = [line for line in err.splitlines() if "16 positions" in line]
    assert len(notes) == 1 and notes[0].startswith("note: ")


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_steer_generates_what_the_library_generates_under_steering(run_dir, capsys):
    from attnlab.inference.steering import steering, text_steers

    flags = ["--ckpt", str(checkpoint(run_dir)), "--prompt", PROMPT, "--max-new-tokens", "8"]
    flags += ["--temperature", "0"]
    steer = ["--steer", "0", "the king", "a dog", "30"]
    code, out, _ = cli(capsys, *flags, *steer)
    assert code == 0
    _, plain, _ = cli(capsys, *flags)
    loaded = open_checkpoint(checkpoint(run_dir))
    model, tok = loaded.model, loaded.tokenizer
    config = GenerationConfig(8, SamplingConfig(temperature=0), stop_tokens=[tok.token_id("<eos>")])
    with steering(model, text_steers(model, tok, [steer[1:]])):
        new = generate(model, [tok.encode(PROMPT)], config)[0]
    assert out == PROMPT + tok.decode(new) + "\n"
    assert out != plain  # a scale this large changes the greedy text
    code, _, err = cli(capsys, *flags, "--steer", "7", "a", "b", "1")
    assert code == 2 and "outside this model's 1 blocks" in err


@pytest.mark.slow
def test_constraint_flags(run_dir, tmp_path, capsys):
    """--regex, --choice and --json-schema outputs, with a character tokenizer (the constraint
    itself: tests/inference/test_constraints.py)."""
    import json
    import re

    base = ["--ckpt", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "30"]

    def output(*flags: str) -> str:
        code, out, err = cli(capsys, *base, *flags)
        assert code == 0 and out.startswith(PROMPT), err
        return out[len(PROMPT) : -1]

    assert re.fullmatch("[a-z]{3} [a-z]{2}", output("--regex", "[a-z]{3} [a-z]{2}"))
    assert output("--choice", "yes", "--choice", "no") in ("yes", "no")
    (tmp_path / "s.json").write_text(json.dumps({"type": "boolean"}))
    assert json.loads(output("--json-schema", str(tmp_path / "s.json"))) in (True, False)
    code, _, err = cli(capsys, *base, "--regex", "[0-9]{3}")  # no digit in its vocabulary
    assert code == 2 and "no token of the vocabulary" in err, err
    # cut by --max-new-tokens before the regex is whole: the text, and a note that says so
    regex = [
        "--ckpt",
        str(run_dir),
        "--prompt",
        PROMPT,
        "--regex",
        r"[a-z]+\.",
        "--temperature",
        "0",
    ]
    code, out, err = cli(capsys, *regex, "--max-new-tokens", "5")
    assert code == 0 and re.fullmatch("[a-z]{5}", out[len(PROMPT) : -1]), out
    assert (
        "note: max_new_tokens=5 ended the text before the regex constraint was complete: it "
        "is not a whole match; raise max_new_tokens"
    ) in err.splitlines()
    # whole at the 5th token, with no room left for the end token: no note
    whole = ["--ckpt", str(run_dir), "--prompt", PROMPT, "--regex", "[a-z]{5}"]
    code, out, err = cli(capsys, *whole, "--max-new-tokens", "5")
    assert code == 0 and re.fullmatch("[a-z]{5}", out[len(PROMPT) : -1])
    assert "ended the text" not in err


@pytest.mark.parametrize(
    "flags",
    [["--speculative", "ngram"], ["--speculative", "draft", "--draft-quantize", "int8"]],
    ids=["ngram", "int8-self"],
)
def test_speculative_prints_the_greedy_text_and_its_acceptance(run_dir, capsys, flags):
    args = ["--ckpt", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12"]
    args += ["--temperature", "0", "--verbose"]
    code, plain, err = cli(capsys, *args)
    assert code == 0 and err.splitlines()[-1].startswith("generated in ")
    code, out, err = cli(capsys, *args, *flags, "--num-draft-tokens", "3")
    assert code == 0 and out == plain
    last = err.splitlines()[-1]
    assert last.startswith("speculative: ") and "drafts accepted" in last and "tokens/s" in last


def test_speculative_draft_without_a_draft_model_is_one_line(run_dir, capsys):
    code, _, err = cli(capsys, "--ckpt", str(run_dir), "--prompt", PROMPT, "--speculative", "draft")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "attnlab generate: error: --speculative draft needs a smaller model: --draft-ckpt DIR, "
        "or --draft-quantize int4 for the model's own int4 copy"
    )


@pytest.mark.slow  # compiles a decode step (~30 s)
def test_compile_prints_the_text_of_the_plain_steps(run_dir, capsys):
    """--compile decodes through compile_decode_step: the same greedy text as the eager steps
    (the reference), with one line on stderr saying it compiles."""
    args = ["--ckpt", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12"]
    code, plain, _ = cli(capsys, *args, "--temperature", "0")
    assert code == 0
    code, compiled, err = cli(capsys, *args, "--temperature", "0", "--compile")
    assert code == 0
    assert compiled == plain
    assert err.count("compiling the decode step") == 1
    code, _, err = cli(capsys, *args, "--compile", "--num-beams", "2")
    assert code != 0 and "--compile is for" in err and "Traceback" not in err


def test_kv_cache_dtype_int8_generates_and_refuses_speculative_in_one_line(run_dir, capsys):
    """--kv-cache-dtype int8 / fp8 decode (tests/components/test_quantized_kv_cache.py checks
    the numbers); with --speculative, whose
    caches are the model's own, it is one line."""
    args = ["--ckpt", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12"]
    args += ["--temperature", "0"]
    for dtype in ("int8", "fp8"):
        code, out, _ = cli(capsys, *args, "--kv-cache-dtype", dtype)
        assert code == 0 and out.startswith(PROMPT) and len(out) > len(PROMPT)
    code, _, err = cli(capsys, *args, "--kv-cache-dtype", "int8", "--speculative", "ngram")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "attnlab generate: error: --kv-cache-dtype int8 is for plain decoding: drop it or "
        "--speculative"
    )
