"""LoRA's trainable parameters and AdamW state against full fine-tuning (no timing).

Every model is built on the meta device, so nothing is allocated: the counts are exact and the
optimizer's moments have their real sizes (AdamW keeps exp_avg and exp_avg_sq, fp32, per
trainable parameter, and a 4-byte step counter per tensor).

    .venv/bin/python benchmarks/lora_memory.py [--presets gpt2 llama2-7b] [--rank 8]
"""

import argparse

import torch
from _timing import cpu_name

from attnlab.adapters.lora import add_lora, count_parameters
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset


def adamw_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of AdamW's state once it has taken a step (meta tensors: sizes only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    opt.step()
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2", "gpt2-medium", "llama2-7b"])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=["q", "v"])
    args = parser.parse_args()
    print(f"attnlab LoRA memory: torch {torch.__version__}, {cpu_name()} (counts: no timing)")
    print(f"LoRA rank {args.rank} on {','.join(args.targets)} vs full fine-tuning (AdamW, fp32)")
    print(
        f"{'preset':<12} {'params':>15} {'LoRA params':>12} {'%':>7} "
        f"{'AdamW full MiB':>15} {'AdamW LoRA MiB':>15}"
    )
    for name in args.presets:
        with torch.device("meta"):
            full, lora = build_model(get_preset(name)), build_model(get_preset(name))
        add_lora(lora, args.targets, rank=args.rank, alpha=2 * args.rank)
        trainable, total = count_parameters(lora)
        full_b, lora_b = adamw_state_bytes(full), adamw_state_bytes(lora)
        print(
            f"{name:<12} {count_parameters(full)[1]:>15,} {trainable:>12,} "
            f"{100 * trainable / total:>6.3f}% {full_b / 2**20:>15,.1f} {lora_b / 2**20:>15,.2f}"
        )


if __name__ == "__main__":
    main()
