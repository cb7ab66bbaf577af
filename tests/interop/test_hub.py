"""Hub models by name (`--ckpt hf:ORG/NAME[@REV]`, `attnlab download`), against a loopback Hub
(tests/interop/hub_server.py on 127.0.0.1) serving tiny models transformers wrote: downloaded,
opened, logits and beam search equal to transformers'; unknown repos, revisions and offline
misses are one line."""

import pytest
import torch

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.__main__ import main
from attnlab.inference.config import GenerationConfig
from attnlab.interop.hub import ALLOW_PATTERNS, download, parse_hub_name
from attnlab.tokenizer import Tokenizer
from tests.hf_tokenizer_files import gpt2_files, t5_files
from tests.interop.helpers import ATOL, TINY_LLAMA, max_diff
from tests.interop.hub_server import HubServer

T = pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")
pytestmark = pytest.mark.hf

TUTORIAL_PROMPT = "translate English to German: The house is wonderful."


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """{repo: directory}: a tiny Llama with a GPT-2 style tokenizer (and a pickled file the
    download must leave out), and a tiny T5 with a Unigram tokenizer, under the tutorial's name."""
    llama = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    gpt2_files(llama)
    vocab = Tokenizer.from_pretrained(llama).vocab_size
    T.LlamaForCausalLM(T.LlamaConfig(**TINY_LLAMA | {"vocab_size": vocab})).save_pretrained(llama)
    (llama / "pytorch_model.bin").write_bytes(b"pickled weights: never fetched")
    (llama / "README.md").write_text("a model card")
    t5 = tmp_path_factory.mktemp("tiny-t5")
    t5_files(t5)
    vocab = Tokenizer.from_pretrained(t5).vocab_size
    config = T.T5Config(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        vocab_size=vocab,
        initializer_factor=5.0,  # sharp enough that 4 beams find another text than greedy
        decoder_start_token_id=0,  # as the Hub's t5-small config.json
    )
    T.T5ForConditionalGeneration(config).save_pretrained(t5)
    return {"org/tiny-llama": llama, "google-t5/t5-small": t5}


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    """The loopback Hub with `repos` (tiny-llama also under the tag v1), an empty cache."""
    with HubServer() as server:
        server.add("org/tiny-llama", repos["org/tiny-llama"], revisions=("main", "v1"))
        server.add("google-t5/t5-small", repos["google-t5/t5-small"])
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        yield server


def test_hf_name_downloads_only_what_attnlab_reads_and_opens_equal_to_transformers(hub, repos):
    loaded = open_checkpoint("hf:org/tiny-llama")
    assert sorted(p.name for p in loaded.path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]  # no pytorch_model.bin, no README.md
    assert all(any(p.match(a) for a in ALLOW_PATTERNS) for p in loaded.path.iterdir())
    hf = T.AutoModelForCausalLM.from_pretrained(repos["org/tiny-llama"]).eval()
    hf_tok = T.AutoTokenizer.from_pretrained(repos["org/tiny-llama"])
    text = "The house is wonderful. Attention is all you need"
    ids = torch.tensor([loaded.tokenizer.encode_with_specials(text)])
    assert ids[0].tolist() == hf_tok(text)["input_ids"]
    with torch.no_grad():
        assert max_diff(loaded.model(ids), hf(ids).logits) <= ATOL


def test_a_second_open_reads_the_cache_and_offline_needs_no_server(hub, monkeypatch):
    first = download("org/tiny-llama")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    assert open_checkpoint("hf:org/tiny-llama").path == first
    assert hub.requests == []


def test_a_revision_is_a_tag_a_branch_or_a_commit(hub):
    by_tag = open_checkpoint("hf:org/tiny-llama@v1").path
    assert by_tag.name == hub.repos["org/tiny-llama"]["refs"]["v1"]  # the snapshot's commit
    assert open_checkpoint(f"hf:org/tiny-llama@{by_tag.name}").path == by_tag


@pytest.mark.parametrize(
    "spec, message",
    [
        ("hf:org/no-such-model", r"^hf:org/no-such-model: no such model repository on http"),
        ("hf:org/tiny-llama@v9", r"^hf:org/tiny-llama has no revision 'v9' on http"),
        ("hf:org/tiny-llama@", r"is not a Hub model name: write hf:ORG/NAME"),
        ("hf:a//b", r"not a valid repository name"),
    ],
)
def test_unknown_repos_and_revisions_are_one_line(hub, spec, message):
    with pytest.raises(ValueError, match=message) as e:
        open_checkpoint(spec)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("code", ["RepoNotFound", None])
def test_a_hub_without_the_file_tree_names_the_request_that_failed(hub, code, capsys):
    """The revision request answered, the file-tree request 404 (with the Hub's RepoNotFound
    code, or a bare 404): not "no such model repository", nor "cannot be reached"."""
    hub.broken["tree"] = (404, code)
    sha = hub.repos["org/tiny-llama"]["refs"]["v1"]
    said = f"listing the files of org/tiny-llama at {sha} failed (404 {code or 'Not Found'})"
    with pytest.raises(ValueError) as e:
        open_checkpoint("hf:org/tiny-llama@v1")
    assert str(e.value).startswith(f"hf:org/tiny-llama@v1: {said} although http")
    assert "\n" not in str(e.value)
    assert any(r.startswith("GET /api/models/org/tiny-llama/revision/v1") for r in hub.requests)
    assert main(["download", "org/tiny-llama"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"attnlab download: error: hf:org/tiny-llama: {said}")


def test_offline_without_the_model_cached_says_what_to_do(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ValueError,
        match="not in the cache .* HF_HUB_OFFLINE is set: run "
        "`attnlab download org/tiny-llama --revision v1`",
    ) as e:
        open_checkpoint("hf:org/tiny-llama@v1")
    assert "\n" not in str(e.value)
    assert hub.requests == []  # offline means offline


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_download_command_fetches_once_and_errors_in_one_line(hub, capsys):
    assert main(["download", "org/tiny-llama", "--revision", "v1"]) == 0
    out = capsys.readouterr().out
    assert "hf:org/tiny-llama@v1: in " in out and "--ckpt hf:org/tiny-llama@v1" in out
    assert main(["download", "org/nope"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("attnlab download: error: hf:org/nope: no such model repository")


@pytest.mark.slow
def test_the_tutorials_t5_command_equals_transformers_beam_search(hub, repos, capsys):
    """`attnlab generate --ckpt hf:google-t5/t5-small --prompt "translate English to German:
    The house is wonderful." --num-beams 4`, as written, on a tiny random T5 with a Unigram
    tokenizer served under that name: the text of transformers' beam search on the same files."""
    argv = ["generate", "--ckpt", "hf:google-t5/t5-small", "--prompt", TUTORIAL_PROMPT]
    assert main([*argv, "--num-beams", "4"]) == 0
    printed = capsys.readouterr().out
    directory = repos["google-t5/t5-small"]
    hf = T.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    hf_tok = T.AutoTokenizer.from_pretrained(directory)
    max_new = GenerationConfig().max_new_tokens  # the command's --max-new-tokens default
    inputs = hf_tok(TUTORIAL_PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, num_beams=4, max_new_tokens=max_new, do_sample=False)
        greedy = hf.generate(**inputs, num_beams=1, max_new_tokens=max_new, do_sample=False)
    out, greedy = out[0].tolist(), greedy[0].tolist()
    assert out != greedy  # the search matters on this model
    ours = Tokenizer.from_pretrained(directory)
    if ours.token_id("<unk>") not in out:  # else attnlab writes U+FFFD where HF writes nothing
        assert ours.decode(out) == hf_tok.decode(out, skip_special_tokens=True)
    assert printed == ours.decode(out) + "\n"
    assert len(set(out)) > 3  # a real continuation, not an empty or one-token one


def test_parse_hub_name():
    assert parse_hub_name("hf:google-t5/t5-small") == ("google-t5/t5-small", None)
    assert parse_hub_name("hf:org/m@v1.0") == ("org/m", "v1.0")
    assert parse_hub_name("org/m") == ("org/m", None)
