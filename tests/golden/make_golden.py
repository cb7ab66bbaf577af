"""Regenerate the golden tensors in this folder (needs `transformers`; the tests do not).

    python tests/golden/make_golden.py

Writes, next to this file:
- `<family>/config.json` + `<family>/model.safetensors`: a tiny seeded `transformers` model
  (GPT-2; Llama with GQA and RoPE; BERT for masked LM; T5 v1.0) saved with `save_pretrained`,
  every parameter then jittered so that no norm weight is exactly 1 and no bias exactly 0 (a
  converter that drops or swaps one then changes the logits). The weights are stored because HF's
  initialisation is not promised to be stable across versions.
- `<family>/expected.safetensors`: the inputs and the logits `transformers` computed from them
  (eager attention, fp32, eval mode).
- `formulas.safetensors`: position tables from the papers' formulas, written out here in plain
  float64 arithmetic and cross-checked against `transformers` where it implements them:
  the sinusoidal table (Vaswani et al. 2017, §3.5), ALiBi slopes including the rule for a head
  count that is not a power of two (Press et al. 2022, and their reference code's `get_slopes`),
  T5 relative-position buckets (Raffel et al. 2020), RoPE frequencies and angles (Su et al. 2021),
  and the inverse frequencies of HF's linear / dynamic-NTK / YaRN / Llama 3 RoPE scalings.

Only safetensors are written (no pickle). Each file records the torch and transformers versions
in its metadata. The whole folder stays far below 1 MB.
"""

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.t5.modeling_t5 import T5Attention

HERE = Path(__file__).parent
VOCAB = 64
META = {"torch": torch.__version__, "transformers": transformers.__version__}
JITTER = 0.1  # added to every parameter after HF's init

# Tiny configs: d_model 16-32, 2 layers, vocab 64, a wide init so the logits are not all ~0.
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=16,
        n_layer=2,
        n_head=4,
        n_positions=32,
        vocab_size=VOCAB,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "llama": lambda: transformers.LlamaConfig(  # GQA: 4 query heads share 2 key/value heads
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},  # short wavelengths
        initializer_range=0.3,
    ),
    "bert": lambda: transformers.BertConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        initializer_range=0.3,
    ),
    "t5": lambda: transformers.T5Config(  # v1.0: ReLU FFN, tied embeddings (logits * d^-0.5)
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_heads=4,
        vocab_size=VOCAB,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
    ),
}
MODELS = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "bert": "BertForMaskedLM",
    "t5": "T5ForConditionalGeneration",
}


def inputs(family: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Two rows of 8 ids; the second right-padded to 5 real tokens (mask True = real)."""
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    mask = torch.arange(8)[None, :] < torch.tensor([[8], [5]])  # (2, 8)
    out = {"input_ids": ids.masked_fill(~mask, 0), "attention_mask": mask}
    if family == "bert":
        out["token_type_ids"] = (torch.arange(8)[None, :] >= 4).long().expand(2, 8).contiguous()
    if family == "t5":  # our T5 is compared without masks: the decoder reads 6 target ids
        out = {"input_ids": ids, "decoder_input_ids": torch.randint(3, VOCAB, (2, 6), generator=g)}
    return out


@torch.no_grad()
def make_model(family: str, seed: int) -> None:
    """Build, jitter, save (config.json + model.safetensors) and record inputs and logits."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    config._attn_implementation = "eager"
    model = getattr(transformers, MODELS[family])(config).eval()
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(JITTER * torch.randn(p.shape, generator=g))
    x = inputs(family, g)
    hf_args = {k: (v.long() if k == "attention_mask" else v) for k, v in x.items()}
    logits = model(**hf_args).logits.float()

    out = HERE / family
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # safetensors by default
        out.mkdir()
        hf = json.loads((Path(tmp) / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        shutil.copy(Path(tmp) / "model.safetensors", out / "model.safetensors")
    save_file({**x, "logits": logits.contiguous()}, str(out / "expected.safetensors"), META)
    for file in out.iterdir():
        file.chmod(0o644)


# --- the papers' formulas --------------------------------------------------------------------
def sinusoidal(n_positions: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    table = [[0.0] * d_model for _ in range(n_positions)]
    for pos in range(n_positions):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            table[pos][2 * i], table[pos][2 * i + 1] = math.sin(angle), math.cos(angle)
    return torch.tensor(table, dtype=torch.float64)


def alibi_slopes(n: int) -> torch.Tensor:
    """Press et al.: 2^(-8/n), 2^(-16/n), ... for a power of two n; otherwise the slopes of the
    closest power of two below n, then every other slope of twice that count."""

    def power_of_two(k: int) -> list[float]:
        return [2 ** (-8 * (i + 1) / k) for i in range(k)]

    closest = 2 ** int(math.log2(n))
    slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n - closest]
    return torch.tensor(slopes, dtype=torch.float64)


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """theta_i = base^(-2i/d), i = 0 .. d/2 - 1 (Su et al. 2021, eq. 15)."""
    return torch.tensor([theta ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)


def hf_rope(params: dict, max_positions: int, seq_len: int | None = None):
    """HF's inverse frequencies and attention factor for rope_parameters (head_dim 16)."""
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        rope_parameters=dict(params),
    )
    if params["rope_type"] == "default":
        inv_freq, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len)
    return inv_freq.double(), torch.tensor(float(factor), dtype=torch.float64)


# name -> (rope_parameters, max_position_embeddings, seq_len); the tests build the same scaling.
ROPE_SCALINGS = {
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 32, None),
    "dynamic": ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 32, 80),
    "yarn": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        64,
        None,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        256,
        None,
    ),
}


def make_formulas() -> None:
    out: dict[str, torch.Tensor] = {}
    for d in (16, 32):
        out[f"sinusoidal.{d}"] = sinusoidal(100, d)  # (100, d)

    for n in range(1, 17):  # 3, 5, 6, 7, 9, ... take the non-power-of-two rule
        slopes = alibi_slopes(n)
        hf = build_alibi_tensor(torch.ones(1, 2), n, torch.float64)[:, 0, 1]  # slope * position 1
        torch.testing.assert_close(slopes, hf, rtol=3e-7, atol=0)  # HF computes in float32
        out[f"alibi_slopes.{n}"] = slopes

    relative = torch.arange(-150, 151)  # key position - query position
    out["t5_buckets.relative_position"] = relative
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 16)):
            name = f"t5_buckets.{'bi' if bidirectional else 'uni'}.{buckets}.{distance}"
            out[name] = T5Attention._relative_position_bucket(
                relative, bidirectional, buckets, distance
            )

    for theta in (10000.0, 500000.0):
        inv_freq = rope_inv_freq(16, theta)
        hf, _ = hf_rope({"rope_type": "default", "rope_theta": theta}, 32)
        torch.testing.assert_close(inv_freq, hf, rtol=1e-6, atol=0)
        angles = torch.arange(64, dtype=torch.float64)[:, None] * inv_freq  # (64, 8)
        out[f"rope.{int(theta)}.inv_freq"] = inv_freq
        out[f"rope.{int(theta)}.cos"] = angles.cos()  # (64, 8): one column per pair
        out[f"rope.{int(theta)}.sin"] = angles.sin()
    for name, (params, max_positions, seq_len) in ROPE_SCALINGS.items():
        out[f"rope_scaling.{name}.inv_freq"], out[f"rope_scaling.{name}.attention_factor"] = (
            hf_rope(params, max_positions, seq_len)
        )
    save_file({k: v.contiguous() for k, v in out.items()}, str(HERE / "formulas.safetensors"), META)


def main() -> None:
    for seed, family in enumerate(MODELS):
        make_model(family, seed)
    make_formulas()
    size = sum(p.stat().st_size for p in HERE.rglob("*.safetensors"))
    print(f"wrote {HERE} ({size / 1024:.0f} KB of safetensors)")


if __name__ == "__main__":
    main()
