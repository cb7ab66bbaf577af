"""What `attnlab train` and `attnlab finetune` print around a run: the header's accelerators line
and the closing report (a helper of the commands, not a command)."""

from pathlib import Path

from attnlab.training.config import TrainConfig


def accelerators_line(train_cfg: TrainConfig) -> str:
    """The run header's line naming the accelerators (attnlab/accel/) this run turns on."""
    on = [k for k in ("compile", "flat_adamw", "keep_freed_memory") if getattr(train_cfg, k)]
    return "accelerators: " + (", ".join(on) if on else "none")


def final_report(state, run_cfg) -> str:
    """The closing lines: metrics, where the files are, the loss plot, and the last sample.

    The sample is the one the final evaluation drew (same model, same seed): it is labelled with
    its step rather than printed again as if it were new."""
    out = Path(run_cfg.train.out_dir)
    metrics = {k: v for k, v in state.last_eval.items() if k != "sample"}
    lines = [
        f"\ntrained {state.step} steps; " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
        f"checkpoints and metrics in {out}",
    ]
    if (out / "metrics.jsonl").is_file():
        from attnlab.viz.loss import load_metrics, plot_loss

        lines.append(f"loss plot: {plot_loss(load_metrics(out), out / 'loss.png', str(out))}")
    sample = state.last_eval.get("sample")
    if sample is not None:
        lines.append(f"\n--- sample from the evaluation at step {state.step} ---\n{sample}")
    return "\n".join(lines)
