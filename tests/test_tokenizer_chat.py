"""The user's own special tokens, and chat templates rendered as `transformers` renders them."""

import copy
import json

import pytest
import torch

from attnlab.checkpoint import open_checkpoint, save_checkpoint, save_pretrained
from attnlab.models.build import build_model
from attnlab.models.presets import PRESETS
from attnlab.tokenizer import (
    CHAT_TOKENS,
    DEFAULT_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    Tokenizer,
    train_bpe_tokenizer,
    train_char_tokenizer,
)

CORPUS = ["def f(x):\n    return x * 2\n" * 20, "the quick brown fox jumps over it\n" * 30]
CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Signature of f?"},
    {"role": "assistant", "content": "def f(x):"},
    {"role": "user", "content": "And g?\nWith two lines."},
]
# A template in the style of the Hub's (ChatML, with bos_token and a loop variable).
CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    "{% if tools is not none %}TOOLS{% endif %}{{ eos_token if messages | length > 3 }}"
)


@pytest.fixture(scope="module")
def chat_bpe() -> Tokenizer:
    return train_bpe_tokenizer(CORPUS, vocab_size=320, special_tokens=CHAT_TOKENS)


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_user_special_tokens_follow_the_fixed_ones_and_encode_as_single_ids(kind):
    extra = ["<|endoftext|>", *CHAT_TOKENS]
    if kind == "bpe":
        tok = train_bpe_tokenizer(CORPUS, vocab_size=320, special_tokens=extra)
    else:
        tok = train_char_tokenizer(CORPUS, special_tokens=extra)
    ids = [tok.token_id(t) for t in SPECIAL_TOKENS + extra]
    assert ids == list(range(len(SPECIAL_TOKENS) + len(extra)))
    text = "<|user|>\ndef f(x):<|end|>\n<|endoftext|>"
    got = tok.encode(text)
    assert got[0] == tok.token_id("<|user|>") and got[-1] == tok.token_id("<|endoftext|>")
    assert tok.token_id("<|end|>") in got
    assert tok.decode(got, skip_special=False) == text
    assert tok.decode(got) == "\ndef f(x):\n"  # specials are skipped on request
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE  # the markers bring attnlab's format


@pytest.mark.parametrize("bad", [["<eos>"], ["<|end|>", "<|end|>"], [""]])
def test_duplicate_or_empty_special_tokens_are_rejected(bad):
    with pytest.raises(ValueError, match="special token"):
        train_bpe_tokenizer(CORPUS, vocab_size=320, special_tokens=bad)
    with pytest.raises(ValueError, match="special token"):
        train_char_tokenizer(CORPUS, special_tokens=bad)


def test_vocab_size_must_leave_room_for_the_user_specials():
    with pytest.raises(ValueError, match="vocab_size >= 264, got 263"):
        train_bpe_tokenizer(CORPUS, vocab_size=263, special_tokens=["<|endoftext|>"])


def test_default_template_writes_attnlab_chat_format(chat_bpe):
    text = chat_bpe.apply_chat_template(CHAT[1:3], add_generation_prompt=False)
    assert text == "<|user|>\nSignature of f?<|end|>\n<|assistant|>\ndef f(x):<|end|>\n"
    prompt = chat_bpe.apply_chat_template(CHAT[1:2])
    assert prompt == "<|user|>\nSignature of f?<|end|>\n<|assistant|>\n"


def test_a_changed_template_renders_at_once(chat_bpe):
    """Templates compile once per text: the next render after a change uses the new text."""
    tok = copy.deepcopy(chat_bpe)
    before = tok.apply_chat_template(CHAT[1:2])
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert tok.apply_chat_template(CHAT[1:2]) == "[Signature of f?]"
    tok.chat_template = chat_bpe.chat_template
    assert tok.apply_chat_template(CHAT[1:2]) == before


def test_a_tokenizer_without_template_or_markers_says_what_to_do():
    tok = train_bpe_tokenizer(CORPUS, vocab_size=300)
    with pytest.raises(ValueError, match="special_tokens=CHAT_TOKENS"):
        tok.apply_chat_template(CHAT)
    with pytest.raises(ValueError, match="message 0 must be a dict with 'role' and 'content'"):
        train_bpe_tokenizer(CORPUS, 320, CHAT_TOKENS).apply_chat_template([{"role": "user"}])


@pytest.mark.hf
@pytest.mark.parametrize("template", [DEFAULT_CHAT_TEMPLATE, CHATML], ids=["default", "chatml"])
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_renders_as_transformers_renders_it(chat_bpe, template, gen):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer(chat_bpe.backend, template)
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=chat_bpe.backend,
        chat_template=template,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    want = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=gen) == want
    ids = theirs.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode(ours.apply_chat_template(CHAT, add_generation_prompt=gen)) == list(ids)


@pytest.mark.hf
def test_saved_template_is_read_by_transformers_and_by_from_file(tmp_path, chat_bpe):
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer(chat_bpe.backend, CHATML)
    tok.save(tmp_path / "tokenizer.json")
    tok.save_config(tmp_path / "tokenizer_config.json")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    want = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    again = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert again.chat_template == CHATML
    assert again.apply_chat_template(CHAT) == want == tok.apply_chat_template(CHAT)


def test_template_from_a_newer_hf_directory_and_a_named_list(tmp_path, chat_bpe):
    chat_bpe.save(tmp_path / "tokenizer.json")
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert Tokenizer.from_file(tmp_path).chat_template == CHATML
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_file(tmp_path).apply_chat_template(CHAT) == "You write Python."


def test_checkpoint_keeps_the_chat_template_beside_tokenizer_json(tmp_path, chat_bpe):
    cfg = PRESETS["gpt2-tiny"]()
    torch.manual_seed(0)
    model = build_model(cfg)
    tok = Tokenizer(chat_bpe.backend, CHATML)
    save_pretrained(tmp_path / "ckpt", model, cfg, tokenizer=tok)
    assert (
        json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())["chat_template"]
        == CHATML
    )
    loaded = open_checkpoint(tmp_path / "ckpt")
    assert loaded.tokenizer.chat_template == CHATML
    assert loaded.tokenizer.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)
    # Without a template nothing extra is written (older checkpoints look the same).
    save_pretrained(tmp_path / "plain", model, cfg, tokenizer=train_bpe_tokenizer(CORPUS, 300))
    assert not (tmp_path / "plain" / "tokenizer_config.json").exists()


def test_markers_alone_bring_the_default_template(tmp_path, chat_bpe):
    # A tokenizer.json saved without its config (the training data cache) keeps the format.
    chat_bpe.save(tmp_path / "tokenizer.json")
    assert Tokenizer.from_file(tmp_path).chat_template == DEFAULT_CHAT_TEMPLATE
    assert train_bpe_tokenizer(CORPUS, 300).chat_template is None


@pytest.mark.hf
def test_hf_export_keeps_the_chat_template(tmp_path, chat_bpe):
    transformers = pytest.importorskip("transformers")
    from attnlab.interop.hf.auto import save_tokenizer

    tok = Tokenizer(chat_bpe.backend, CHATML)
    save_tokenizer(tok, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    want = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert want == tok.apply_chat_template(CHAT)


def test_training_checkpoint_keeps_the_chat_template(tmp_path, chat_bpe):
    from tests.test_checkpoint import rng_state, trained_pair

    model, optimizer, run = trained_pair()
    tok = Tokenizer(chat_bpe.backend, CHATML)
    path = save_checkpoint(
        tmp_path / "step_1", model, optimizer, run, {"step": 1}, rng_state(), tok
    )
    assert (path / "tokenizer_config.json").is_file()
    assert open_checkpoint(path).tokenizer.chat_template == CHATML


# A template that reads `tools`, after Qwen2.5's (a system block listing them, earlier calls as
# <tool_call> JSON, tool results as user turns inside <tool_response>).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The forecast.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
]


@pytest.mark.hf
def test_tools_reach_the_template_as_transformers_passes_them(chat_bpe):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer(chat_bpe.backend, TOOLS_TEMPLATE)
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=chat_bpe.backend, chat_template=TOOLS_TEMPLATE
    )
    want = theirs.apply_chat_template(
        TOOL_CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(TOOL_CHAT, tools=TOOLS) == want
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in want and "<tools>" in want
    assert ours.takes_tools and not chat_bpe.takes_tools  # DEFAULT_CHAT_TEMPLATE: no tools
