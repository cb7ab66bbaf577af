"""SmolLM2-135M-Instruct (Q4_1 GGUF) through attnlab against transformers' GGUF loader.

Slow tier: the real file (tests/realmodel.py finds it; skipped when absent, failed under CI).
One attnlab model and one transformers model per module. Figures: docs/real-models.md.
"""

import copy

import numpy as np
import pytest
import torch

from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.quantize.int4 import Int4Linear
from attnlab.quantize.int8 import Int8Linear
from tests.realmodel import open_smollm2, smollm2_gguf

T = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytestmark = [pytest.mark.slow, pytest.mark.hf]

PROMPTS = [
    "What is the capital of France?",
    "def fibonacci(n):\n    ",
    "The three laws of thermodynamics are",
    "Écris une phrase en français sur les chats. 日本語も少し。",
    "<|im_start|>user\nList three prime numbers above 100.<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingConfig(temperature=0.0)
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def dense():
    return open_smollm2()


@pytest.fixture(scope="module")
def reference():
    path = smollm2_gguf()
    model = T.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = T.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def kept():
    """The Q4_1 matrices kept as Int4Linear and the int8 head, on their fp32 reference paths
    for the test (the fused CPU kernels run in bf16), restored afterwards: the model is shared."""
    loaded = open_smollm2(scheme="int4")
    modules = [m for m in loaded.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    before = [m.use_kernel for m in modules]
    for m in modules:
        m.use_kernel = False
    yield loaded
    for m, flag in zip(modules, before):
        m.use_kernel = flag


def ids_of(loaded, text):
    return torch.tensor([loaded.tokenizer.encode(text)])


DENSE_GREEDY: dict[str, list[int]] = {}  # the fp32 model's continuations, shared by the tests


def dense_greedy(dense, text):
    if text not in DENSE_GREEDY:
        DENSE_GREEDY[text] = greedy(dense, text)
    return DENSE_GREEDY[text]


def greedy(loaded, text):
    eos = loaded.tokenizer.token_id("<eos>")
    with torch.no_grad():
        config = GenerationConfig(NEW_TOKENS, GREEDY, stop_tokens=(eos,))
        return generate(loaded.model, [loaded.tokenizer.encode(text)], config)[0]


def test_config_and_tokenizer_from_the_metadata(dense, reference):
    cfg = dense.config
    assert (cfg.n_layers, cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads) == (30, 576, 9, 3)
    assert (cfg.rope.theta, cfg.max_seq_len, cfg.vocab_size) == (100000.0, 8192, 49152)
    tok, ref = dense.tokenizer, reference[1]
    texts = [*PROMPTS, "x = 12345 + 0.5  # ünïcødé 🙂\n\tif a != b: return [1, 2]"]
    for text in texts:
        assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"], text
    assert (tok.token_id("<bos>"), tok.token_id("<eos>"), tok.token_id("<pad>")) == (1, 2, 2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_whitespace_before_digits_follows_smollm2s_published_pre_tokenizer(dense):
    """Where whitespace runs precede a digit, transformers' GGUF loader (which ignores the
    smollm rule) gives other ids; the reference is SmolLM2's published tokenizer.json pipeline,
    Digits(individual_digits) then ByteLevel, over the file's own vocabulary and merges."""
    from tokenizers import Tokenizer, pre_tokenizers

    published = Tokenizer.from_str(dense.tokenizer.backend.to_str())
    published.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    for text in ["12345  007", "a  1", "x\n\n2", "total:\t\t 42"]:
        assert dense.tokenizer.encode(text) == published.encode(text).ids, text


def test_logits_equal_transformers_gguf_loader(dense, reference):
    for text in PROMPTS:
        ids = ids_of(dense, text)
        with torch.no_grad():
            gap = (dense.model(ids) - reference[0](ids).logits).abs().max().item()
        assert gap < 1e-4, (text, gap)


def test_greedy_generation_equals_transformers(dense, reference):
    model, _ = reference
    lengths = []
    for text in PROMPTS[1:3]:  # the code and the prose prompts run all 64 tokens
        ours = dense_greedy(dense, text)
        lengths.append(len(ours))
        ids = ids_of(dense, text)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2)
        assert ours == out[0, ids.shape[1] :].tolist(), text
    assert max(lengths) == NEW_TOKENS


def test_kept_int4_equals_its_dequantized_twin(dense, kept):
    """The kept model is the file's weights: its 210 Q4_1 matrices, and the tied head (a Q8_0
    embedding in this file) rounded per row to int8 (the embedding itself stays fp32)."""
    assert sum(isinstance(m, Int4Linear) for m in kept.model.modules()) == 210
    assert isinstance(kept.model.head, Int8Linear)
    twin = copy.deepcopy(dense)
    w = dense.model.embed.weight.detach()
    scales = w.abs().amax(dim=1, keepdim=True) / 127  # symmetric per row
    twin.model.head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    twin.model.head.weight.data = (w / scales).round().clamp(-127, 127) * scales
    for text in PROMPTS:
        ids = ids_of(dense, text)
        with torch.no_grad():
            assert (kept.model(ids) - twin.model(ids)).abs().max().item() < 1e-4, text
    text = PROMPTS[1]  # the reference path dequantizes every matrix per token: one prompt
    ours = greedy(kept, text)
    assert len(ours) == NEW_TOKENS and ours == greedy(twin, text)


def test_q4_1_export_keeps_every_tensor_and_the_metadata(tmp_path):
    """gguf -> gguf at q4_1: the 210 Q4_1 matrices, the Q8_0 token_embd and the F32 norms are
    the source's bytes, and its general.* keys (license, languages, ...) are carried."""
    import gguf

    from attnlab.interop.convert import convert

    path = smollm2_gguf()
    out = convert("gguf", path, "gguf", tmp_path / "out.gguf", gguf_type="q4_1")
    ref, ours = gguf.GGUFReader(path), gguf.GGUFReader(out)
    ref_t = {t.name: t for t in ref.tensors}
    assert {t.name for t in ours.tensors} == ref_t.keys()
    for t in ours.tensors:
        assert t.tensor_type == ref_t[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(ref_t[t.name].data)), t.name
    general = [k for k in ref.fields if k.startswith("general.")]
    for key in general:
        assert ours.fields[key].contents() == ref.fields[key].contents(), key
    assert abs(out.stat().st_size - path.stat().st_size) < 1_000_000  # 98.4 MB, not 181.5


def test_hf_export_stops_a_chat_answer_at_im_end(dense, tmp_path):
    """convert --to hf writes the eos (<|im_end|>) into config.json and generation_config.json:
    transformers' greedy chat answer on the directory stops there, with attnlab's tokens."""
    from attnlab.interop.convert import convert

    out = convert("gguf", smollm2_gguf(), "hf", tmp_path / "hf")
    model = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = dense.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ours, ids = dense_greedy(dense, text), ids_of(dense, text)
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert ours[-1] == 2 and len(ours) < NEW_TOKENS  # <|im_end|>
    assert theirs[0, ids.shape[1] :].tolist() == ours


def test_a_long_json_string_fits_in_few_of_smollm2s_tokens(dense):
    """Why check_room lets a 500-character string through at max_tokens 10 (issue 42's case):
    SmolLM2 writes '"' + 500 '#' + '"' in 9 tokens (it has a token of 80 '#'), which the
    schema's matcher (llguidance, the reference) accepts; refusing it would refuse a request
    that can be finished. Cut at fewer, the reply says so (finish_reason "length")."""
    from attnlab.inference.constraints import Constraint, accepts, check_room, min_tokens

    tok = dense.tokenizer
    schema = Constraint.json_schema({"type": "string", "minLength": 500})
    text = '"' + "#" * 500 + '"'
    special, pieces = set(tok.backend.get_added_tokens_decoder()), {}  # piece of text -> id
    for i in range(tok.vocab_size):
        piece = tok.decode([i])
        if piece and piece in text and i not in special:
            pieces.setdefault(piece, i)
    best = {0: []}  # fewest tokens writing text[:end], end by end
    for end in range(1, len(text) + 1):
        ways = [
            best[start] + [pieces[text[start:end]]] for start in best if text[start:end] in pieces
        ]
        if ways:
            best[end] = min(ways, key=len)
    tokens = best[len(text)]
    assert tok.decode(tokens) == text and len(tokens) == 9
    assert accepts(schema, tok, tokens)
    assert min_tokens(schema, tok) <= 9
    check_room(schema, tok, 9, "max_tokens")  # feasible: not refused
    with pytest.raises(ValueError, match="cannot be finished"):
        check_room(schema, tok, min_tokens(schema, tok) - 1, "max_tokens")
