"""SmolLM2-135M-Instruct end to end through attnlab's commands (slow tier): chat answers, the
OpenAI client through `serve`, perplexity against `transformers`' GGUF loader, quantization.
The figures are in docs/smollm2.md, with the commands that produced them."""

import pytest

from attnlab.cli.__main__ import main
from tests.cli.test_chat import chat_through_a_terminal, reply_and_figures
from tests.realmodel import open_smollm2, smollm2_gguf

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
# A held-out paragraph (written for this test; no corpus holds it).
HELD_OUT = (
    "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his "
    "father had taught him. There were one hundred and twelve, and on stormy nights he counted "
    "them twice, once going up and once coming down, to be sure the sea had not stolen any. "
    "From the lamp room he could see the harbour, the fishing boats pulled high on the "
    "shingle, and the road that wound inland past the church towards the market town. In "
    "winter the light turned for fourteen hours, and he trimmed the wick, polished the brass "
    "and wrote the weather in a ledger whose first pages were older than the village school. "
    "Nobody had asked him to keep the ledger; he kept it because a record that stops is worse "
    "than one never begun.\n"
)
CPU = ["--device", "cpu"]


def metrics(out: str) -> dict[str, float]:
    """`attnlab eval`'s printed "name value" lines as a dict."""
    return {k: float(v) for k, v in (line.split() for line in out.strip().splitlines())}


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "held_out.txt"
    path.write_text(HELD_OUT, encoding="utf-8")
    return path


def test_generate_chat_names_paris(capsys):
    argv = ["generate", "--ckpt", str(smollm2_gguf()), "--chat", "--prompt", QUESTION]
    assert main([*argv, "--temperature", "0", "--max-new-tokens", "24", *CPU]) == 0
    assert "Paris" in capsys.readouterr().out


def test_chat_in_a_terminal_answers_and_resets():
    flags = ["--temperature", "0", "--max-new-tokens", "24"]
    first, cleared, again = chat_through_a_terminal(
        smollm2_gguf(), [QUESTION, "/reset", QUESTION], flags
    )
    first, again = reply_and_figures(first)[0], reply_and_figures(again)[0]
    assert "Paris" in first and cleared == "(conversation cleared)" and again == first


def test_serve_answers_the_openai_clients_chat_completion():
    openai = pytest.importorskip("openai")
    from tests.serve.server_helpers import Server

    server = Server(smollm2_gguf(), model_name="smollm2")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=24,
            temperature=0,
        )
    finally:
        server.close()
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"  # the template's end of turn


@pytest.fixture(scope="module")
def reference():
    """SmolLM2 opened by transformers' own GGUF loader (fp32, eager attention)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import torch

    path = smollm2_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_eval_perplexity_equals_transformers_on_the_same_tokens(held_out, reference, capsys):
    """attnlab eval --text on the dequantized GGUF against transformers' own GGUF loader,
    fed the same token ids (one window: the paragraph is shorter than the context)."""
    import torch

    assert main(["eval", "--ckpt", str(smollm2_gguf()), "--text", str(held_out), *CPU]) == 0
    ours = metrics(capsys.readouterr().out)
    ids = open_smollm2().tokenizer.encode(HELD_OUT)
    ref = reference
    with torch.no_grad():
        x = torch.tensor([ids])
        loss = ref(x, labels=x).loss.item()
    assert ours["tokens"] == len(ids) - 1
    assert ours["loss"] == pytest.approx(loss, abs=1e-4)
    assert ours["ppl"] == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-4)


@pytest.mark.parametrize(("scheme", "bound"), [("int8", 0.02), ("int4", 0.25)])
def test_quantized_perplexity_moves_within_a_stated_bound(
    scheme, bound, held_out, tmp_path, capsys
):
    """attnlab quantize of the dequantized model: the held-out perplexity changes by less than
    `bound` (relative; the measured changes are in docs/smollm2.md)."""
    gguf, out = str(smollm2_gguf()), str(tmp_path / scheme)
    assert main(["eval", "--ckpt", gguf, "--text", str(held_out), *CPU]) == 0
    base = metrics(capsys.readouterr().out)["ppl"]
    assert main(["quantize", "--ckpt", gguf, "--scheme", scheme, "--out", out]) == 0
    capsys.readouterr()
    assert main(["eval", "--ckpt", out, "--text", str(held_out), *CPU]) == 0
    ppl = metrics(capsys.readouterr().out)["ppl"]
    assert abs(ppl / base - 1) < bound


def test_attention_maps_equal_transformers_in_every_layer(reference):
    """The probabilities viz attention and lab heads read (captured from the eager backend)
    equal transformers' output_attentions on a repeated text, all 30 layers x 9 heads."""
    import torch

    from attnlab.viz.attention_maps import attention_grid, run_attention

    loaded = open_smollm2()
    ids = torch.tensor([loaded.tokenizer.encode("one two three four five six " * 3)])
    ours = attention_grid(run_attention(loaded.model, ids), "decoder_self")  # (L, H, T, T)
    with torch.no_grad():
        theirs = reference(ids, output_attentions=True).attentions
    assert ours.shape == (len(theirs), *theirs[0].shape[1:])
    gap = max((torch.from_numpy(ours[i]) - a[0]).abs().max().item() for i, a in enumerate(theirs))
    assert gap < 1e-4


def test_viz_attention_draws_the_real_models_maps(tmp_path):
    text = "one two three four five six " * 2
    argv = ["viz", "attention", "--ckpt", str(smollm2_gguf()), "--out", str(tmp_path)]
    assert main([*argv, "--text", text, "--layer", "4", "--head", "0"]) == 0
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.suffix == ".png")
