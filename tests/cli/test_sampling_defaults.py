"""A chat reply that sets no sampler takes the checkpoint's own defaults, else llama.cpp's
(issue 42: SmolLM2 answered "Bâteille Rous" for the capital of France at temperature 1 with no
truncation): `generate --chat`, `chat` and `serve`'s chat completions; a plain continuation and
a completion keep SamplingConfig's (OpenAI's) defaults."""

import pytest

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.__main__ import main
from attnlab.inference.sampling import SamplingConfig, chat_sampling
from attnlab.serve.protocol import Settings, sampling_params
from tests.serve.server_helpers import write_checkpoint

# llama.cpp's defaults (common/common.h, common_params_sampling): the reference.
LLAMA_CPP = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("defaults") / "tiny")


def generated(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.slow  # five generations of 24 tokens (about 3 s)
def test_generate_chat_samples_at_llama_cpps_defaults(ckpt, capsys):
    argv = ["generate", "--ckpt", str(ckpt), "--chat", "--prompt", "hello cat", "--seed", "3"]
    argv += ["--max-new-tokens", "24", "--ignore-eos", "--device", "cpu"]
    explicit = [a for k, v in LLAMA_CPP.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    plain = ["--temperature", "1", "--top-k", "none", "--top-p", "none", "--min-p", "none"]
    default = generated(argv, capsys)
    assert default == generated([*argv, *explicit], capsys)
    assert default != generated([*argv, *plain], capsys)
    # A flag given wins over the default (here: greedy), and a plain continuation keeps
    # SamplingConfig's defaults (temperature 1, no filter).
    assert generated([*argv, "--temperature", "0"], capsys) != default
    continuation = [a for a in argv if a != "--chat"]
    assert generated(continuation, capsys) == generated([*continuation, *plain], capsys)


@pytest.mark.slow  # transformers' import and a model saved (about 3 s)
def test_an_hf_generation_config_gives_its_own_defaults(tmp_path):
    """generation_config.json's sampler, read as transformers reads it; none where it does not
    sample (do_sample false: transformers decodes greedily and ignores the values)."""
    transformers = pytest.importorskip("transformers")
    from tests.interop.gguf.files import tiny_hf_llama

    tiny_hf_llama(320).save_pretrained(tmp_path)
    own = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.9, repetition_penalty=1.05)
    transformers.GenerationConfig(**own).save_pretrained(tmp_path)
    reference = transformers.GenerationConfig.from_pretrained(tmp_path)
    sampling = open_checkpoint(tmp_path).sampling
    assert sampling == {k: getattr(reference, k) for k in own if k != "do_sample"}
    assert chat_sampling(sampling) == SamplingConfig(**sampling, min_p=LLAMA_CPP["min_p"])
    # do_sample left out: greedy in transformers (which will not save this file itself)
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "eos_token_id": 2}')
    assert not transformers.GenerationConfig.from_pretrained(tmp_path).do_sample
    assert open_checkpoint(tmp_path).sampling == {}


def test_a_gguf_files_general_sampling_keys_give_its_own_defaults(tmp_path):
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from tests.interop.gguf.files import byte_level_tokenizer, tiny_hf_llama, write_gguf

    keys = gguf.Keys.General
    own = {keys.SAMPLING_TEMP: 0.5, keys.SAMPLING_TOP_K: 30, keys.SAMPLING_MIN_P: 0.125}
    path = write_gguf(tmp_path / "m.gguf", tiny_hf_llama(320), byte_level_tokenizer(), sampling=own)
    assert open_checkpoint(path).sampling == dict(temperature=0.5, top_k=30, min_p=0.125)


def test_a_chat_completion_that_sets_nothing_samples_at_the_chat_defaults():
    settings = Settings("m", context=64, vocab_size=100)
    chat = sampling_params({}, settings, logprobs=None, prompt_logprobs=False, chat=True)
    assert chat.sampling() == SamplingConfig(**LLAMA_CPP)
    some = {"temperature": 0.3}  # each field left out keeps its default
    chat = sampling_params(some, settings, logprobs=None, prompt_logprobs=False, chat=True)
    assert chat.sampling() == SamplingConfig(**(LLAMA_CPP | some))
    completion = sampling_params({}, settings, logprobs=None, prompt_logprobs=False, chat=False)
    assert completion.sampling() == SamplingConfig(top_p=1.0, min_p=0.0)  # temperature 1
    own = Settings("m", 64, 100, chat_sampling=chat_sampling({"temperature": 0.2}))
    chat = sampling_params({}, own, logprobs=None, prompt_logprobs=False, chat=True)
    assert chat.sampling() == SamplingConfig(**(LLAMA_CPP | {"temperature": 0.2}))
