"""Sparse autoencoders (SAEs) on a hook point: the ReLU + L1 SAE and the TopK SAE, as in SAELens.

An SAE rewrites an activation x (C = d_in) as a sparse sum of F = d_sae learned directions:

    x ─ b_dec ─> @ W_enc + b_enc ─> hidden_pre (F) ─> ReLU or TopK ─> acts (F, mostly 0)
    acts @ W_dec + b_dec ─> x_hat (C)              W_enc (C, F)  W_dec (F, C)

    ReLU SAE (SAELens "standard"; Bricken et al. 2023, "Towards Monosemanticity"): acts =
        relu(hidden_pre); loss = MSE + l1 * mean_tokens ||acts * ||W_dec rows|| ||_1. Weighting
        each feature by its decoder row's norm stops the L1 term being dodged by shrinking acts
        and growing W_dec (SAELens 6's `StandardTrainingSAE.calculate_aux_loss`).
    TopK SAE (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"): acts keeps the k
        largest hidden_pre per token, ReLU'd, and zeroes the rest; the sparsity is k itself. With
        `rescale_acts_by_decoder_norm` (SAELens' training default) hidden_pre is multiplied by the
        decoder row norms before the choice and divided again before decoding, so a drifting
        decoder norm does not change which features win. The auxiliary loss (the paper's AuxK,
        Appendix B.1) makes dead features (not fired for `dead_feature_window` steps) predict the
        residual x - x_hat with the top d_in/2 of them: aux = scale * mean ||acts_dead @ W_dec -
        (x - x_hat)||^2, scale = min(n_dead / (d_in/2), 1).
    MSE, both: sum over C of (x_hat - x)^2, mean over tokens (SAELens' reduction).

Training (`SAETrainer`) is SAELens' `SAETrainer._train_step` for one batch: Adam (betas 0.9,
0.999), the gradient clipped to norm 1, a constant learning rate, the L1 coefficient warmed up
linearly over `l1_warm_up_steps`. SAELens 6 does not renormalise W_dec or project its gradient;
neither does this. Initialisation is SAELens': W_dec kaiming-uniform, rows scaled to norm
`decoder_init_norm`, W_enc = W_dec^T, biases zero (same RNG draws, so one seed gives one SAE).

Files are SAELens' (`save_sae` / `load_sae`): a directory with cfg.json (the fields its
`save_inference_model` writes) and sae_weights.safetensors (W_enc, b_enc, W_dec, b_dec), so
`sae_lens.SAE.load_from_disk` reads what attnlab writes and the other way round.

Splicing (`splice`): while active, the model's point is replaced by the SAE's output with
SAELens' HookedSAETransformer point names under it, `<point>.hook_sae_input`, `.hook_sae_acts_pre`,
`.hook_sae_acts_post`, `.hook_sae_recons`, `.hook_sae_error`, `.hook_sae_output`, readable with
run_with_cache. With the error term (default) the output is x_hat + (x - x_hat): the model
computes what it did, and an edit of the SAE's points (ablating a feature) acts on top of that.

Shapes: N tokens (any leading axes), C d_in, F d_sae.
"""

import json
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from attnlab.components.hooks import HookPoint, hooks, point_named, run_with_cache
from attnlab.inference.steering import Steer

CFG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"  # SAELens' names
ARCHITECTURES = {"relu": "standard", "topk": "topk"}  # attnlab's kind -> SAELens' architecture
POINTS = ("input", "acts_pre", "acts_post", "recons", "error", "output")  # hook_sae_<name>


@dataclass(frozen=True)
class SAEConfig:
    """One SAE's shape, kind and training coefficients (SAELens' config fields, its defaults).

    Attributes:
        d_in: the activation's width (C).  d_sae: the number of features (F).
        kind: "relu" (SAELens "standard", L1 penalty) or "topk".
        k: with topk, the features kept per token.
        l1_coefficient, lp_norm, l1_warm_up_steps: with relu, the sparsity penalty.
        aux_loss_coefficient: with topk, the dead-feature loss's weight.
        rescale_acts_by_decoder_norm: with topk, choose the k on decoder-norm-scaled acts.
        apply_b_dec_to_input: subtract b_dec from x before encoding.
        decoder_init_norm: the norm of W_dec's rows at init (None: kaiming's).
        hook_name, model_name: where the SAE was trained (SAELens' metadata).
    """

    d_in: int
    d_sae: int
    kind: Literal["relu", "topk"] = "topk"
    k: int = 100
    l1_coefficient: float = 1.0
    lp_norm: float = 1.0
    l1_warm_up_steps: int = 0
    aux_loss_coefficient: float = 1.0
    rescale_acts_by_decoder_norm: bool = True
    apply_b_dec_to_input: bool = True
    decoder_init_norm: float | None = 0.1
    hook_name: str = ""
    model_name: str = ""

    def __post_init__(self):
        if self.kind not in ARCHITECTURES:
            raise ValueError(f"SAE kind {self.kind!r}: give one of {list(ARCHITECTURES)}")
        if self.d_in < 1 or self.d_sae < 1:
            raise ValueError(f"SAE d_in={self.d_in}, d_sae={self.d_sae}: give positive sizes")
        if self.kind == "topk" and not 1 <= self.k <= self.d_sae:
            raise ValueError(f"SAE k={self.k}: give 1 <= k <= d_sae ({self.d_sae})")


@dataclass
class SAEOutput:
    """What `SAE.training_forward` returns: the reconstruction, the features, each loss."""

    x_hat: Tensor  # (N, C)
    acts: Tensor  # (N, F)
    hidden_pre: Tensor  # (N, F)
    losses: dict[str, Tensor]  # "mse_loss", and "l1_loss" or "auxiliary_reconstruction_loss"
    loss: Tensor  # their sum


def topk_relu(x: Tensor, k: int) -> Tensor:
    """The k largest entries of each row of x, ReLU'd, in place; zeros elsewhere (SAELens' TopK)."""
    values, indices = torch.topk(x, k=k, dim=-1, sorted=False)
    return torch.zeros_like(x).scatter(-1, indices, values.relu())


class SAE(nn.Module):
    """A sparse autoencoder (the module docstring has the equations).

    Args:
        cfg: its config.
    """

    def __init__(self, cfg: SAEConfig):
        super().__init__()
        self.cfg = cfg
        C, Fs = cfg.d_in, cfg.d_sae
        w_dec = nn.init.kaiming_uniform_(torch.empty(Fs, C))  # SAELens' draw, same RNG use
        if cfg.decoder_init_norm is not None:
            w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True) * cfg.decoder_init_norm
        self.W_dec = nn.Parameter(w_dec)  # (F, C)
        self.W_enc = nn.Parameter(w_dec.T.clone().contiguous())  # (C, F): tied at init
        self.b_enc = nn.Parameter(torch.zeros(Fs))
        self.b_dec = nn.Parameter(torch.zeros(C))
        for name in POINTS:  # plain attributes (components/hooks.py): not in state_dict
            setattr(self, f"hook_sae_{name}", HookPoint())

    def points(self) -> dict[str, HookPoint]:
        """The SAE's own points: {"hook_sae_input": ..., ...} (SAELens' names)."""
        return {f"hook_sae_{n}": getattr(self, f"hook_sae_{n}") for n in POINTS}

    def _rescaled(self) -> bool:
        return self.cfg.kind == "topk" and self.cfg.rescale_acts_by_decoder_norm

    def encode_with_hidden_pre(self, x: Tensor, watched: bool = True) -> tuple[Tensor, Tensor]:
        """(acts, hidden_pre), each (N, F), of x (N, C); `watched=False` skips the points."""
        point = (lambda p: p) if watched else (lambda p: lambda t: t)
        x = point(self.hook_sae_input)(x.float())
        if self.cfg.apply_b_dec_to_input:
            x = x - self.b_dec
        hidden_pre = point(self.hook_sae_acts_pre)(x @ self.W_enc + self.b_enc)  # (N, F)
        if self._rescaled():
            hidden_pre = hidden_pre * self.W_dec.norm(dim=-1)
        if self.cfg.kind == "topk":
            acts = topk_relu(hidden_pre, self.cfg.k)
        else:
            acts = hidden_pre.relu()
        return point(self.hook_sae_acts_post)(acts), hidden_pre

    def encode(self, x: Tensor, watched: bool = True) -> Tensor:
        """(N, F) the feature activations of x (N, C)."""
        return self.encode_with_hidden_pre(x, watched)[0]

    def decode(self, acts: Tensor, watched: bool = True) -> Tensor:
        """(N, C) the reconstruction from acts (N, F)."""
        x_hat = self._times_W_dec(acts) + self.b_dec
        return self.hook_sae_recons(x_hat) if watched else x_hat

    def _times_W_dec(self, acts: Tensor) -> Tensor:
        if self._rescaled():
            acts = acts * (1 / self.W_dec.norm(dim=-1))
        return acts @ self.W_dec  # (N, C)

    def forward(self, x: Tensor, use_error_term: bool = False) -> Tensor:
        """(N, C) the SAE's output for x (N, C): x_hat, or with the error term x_hat + (x - x_hat)
        where the error comes from an unwatched pass (SAELens' `SAE.forward`), so an edit of a
        point changes the output by what it changes x_hat by."""
        x_hat = self.decode(self.encode(x))
        if use_error_term:
            with torch.no_grad():
                clean = self.decode(self.encode(x, watched=False), watched=False)
                x_hat = x_hat + self.hook_sae_error(x.float() - clean)
        return self.hook_sae_output(x_hat)

    def training_forward(
        self, x: Tensor, l1_coefficient: float | None = None, dead: Tensor | None = None
    ) -> SAEOutput:
        """The forward and the loss terms of one training batch (SAELens' `training_forward_pass`).

        Args:
            x: (N, C) activations.
            l1_coefficient: relu: the L1 weight now (warm-up); None: the config's.
            dead: topk: (F,) bool, the features counted dead (None or none dead: no aux loss).
        """
        acts, hidden_pre = self.encode_with_hidden_pre(x)
        x_hat = self.decode(acts)
        mse = F.mse_loss(x_hat, x.float(), reduction="none").sum(-1).mean()  # sum C, mean N
        if self.cfg.kind == "relu":
            coef = self.cfg.l1_coefficient if l1_coefficient is None else l1_coefficient
            weighted = acts * self.W_dec.norm(dim=1)  # (N, F)
            extra = {"l1_loss": (coef * weighted.norm(p=self.cfg.lp_norm, dim=-1)).mean()}
        else:
            extra = {"auxiliary_reconstruction_loss": self.aux_loss(x, x_hat, hidden_pre, dead)}
        losses = {"mse_loss": mse, **extra}
        return SAEOutput(x_hat, acts, hidden_pre, losses, sum(losses.values()))

    def aux_loss(self, x: Tensor, x_hat: Tensor, hidden_pre: Tensor, dead: Tensor | None) -> Tensor:
        """TopK's AuxK loss: the top d_in/2 dead features reconstruct the residual x - x_hat."""
        n_dead = 0 if dead is None else int(dead.sum())  # one sync per step, as SAELens
        if n_dead == 0:
            return x_hat.new_tensor(0.0)
        residual = (x.float() - x_hat).detach()  # (N, C)
        k_aux = x.shape[-1] // 2
        scale = min(n_dead / k_aux, 1.0)  # fewer dead features than k_aux: a smaller loss
        dead_pre = torch.where(dead[None], hidden_pre, -torch.inf)  # (N, F) live ones out
        top = dead_pre.topk(min(k_aux, n_dead), sorted=False)
        aux_acts = torch.zeros_like(hidden_pre).scatter(-1, top.indices, top.values)
        err = (self._times_W_dec(aux_acts) - residual).pow(2).sum(-1).mean()  # no b_dec
        return self.cfg.aux_loss_coefficient * scale * err


def l1_schedule(step: int, cfg: SAEConfig) -> float:
    """The L1 coefficient at `step` (0-based): a linear ramp over l1_warm_up_steps, from 0
    (SAELens' CoefficientScheduler: step 0 uses 0, step s uses l1 * s / warm_up)."""
    if cfg.l1_warm_up_steps <= 0 or step >= cfg.l1_warm_up_steps:
        return cfg.l1_coefficient
    return cfg.l1_coefficient * step / cfg.l1_warm_up_steps


class SAETrainer:
    """SAELens' training step on batches of activations: Adam, clip 1.0, dead-feature counts.

    Args:
        sae: the SAE, trained in place.
        lr, betas: Adam's (SAELens' defaults: 3e-4, (0.9, 0.999)).
        dead_feature_window: steps without firing after which a feature counts as dead.
    """

    def __init__(
        self,
        sae: SAE,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        dead_feature_window: int = 1000,
    ):
        self.sae, self.window, self.step_count = sae, dead_feature_window, 0
        self.optimizer = torch.optim.Adam(sae.parameters(), lr=lr, betas=betas)
        self.since_fired = torch.zeros(sae.cfg.d_sae)  # (F,) steps since each feature fired

    def dead(self) -> Tensor:
        """(F,) bool: the features not fired for more than `dead_feature_window` steps."""
        return self.since_fired > self.window

    def step(self, x: Tensor) -> SAEOutput:
        """One optimizer step on the batch x (N, C); returns its forward and losses."""
        self.sae.train()
        out = self.sae.training_forward(x, l1_schedule(self.step_count, self.sae.cfg), self.dead())
        with torch.no_grad():
            fired = (out.acts != 0).any(0)  # (F,)
            self.since_fired += 1
            self.since_fired[fired] = 0
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.sae.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step_count += 1
        return out


# cfg.json: the fields SAELens' `TrainingSAE.save_inference_model` writes for each architecture.
_INFERENCE_FIELDS = {"standard": (), "topk": ("k", "rescale_acts_by_decoder_norm")}
_TRAINING_DETAILS = {
    "standard": ("decoder_init_norm", "l1_coefficient", "lp_norm", "l1_warm_up_steps"),
    "topk": ("decoder_init_norm", "aux_loss_coefficient"),
}


def save_sae(sae: SAE, path: str | Path) -> Path:
    """Write `sae` as SAELens writes an inference SAE: cfg.json + sae_weights.safetensors.
    A TopK SAE trained with rescaled acts has its decoder norms folded into the encoder first
    (W_dec rows of norm 1; what SAELens' save does), which leaves its outputs unchanged."""
    cfg, arch = sae.cfg, ARCHITECTURES[sae.cfg.kind]
    weights = {n: p.detach().float().clone().contiguous() for n, p in sae.state_dict().items()}
    if sae._rescaled():
        norm = weights["W_dec"].norm(dim=-1)  # (F,)
        weights["b_enc"] = weights["b_enc"] * norm
        weights["W_dec"] = weights["W_dec"] / norm[:, None]
        weights["W_enc"] = weights["W_enc"] * norm[None, :]
    details = {name: getattr(cfg, name) for name in _TRAINING_DETAILS[arch]}
    if arch == "topk":
        details["use_sparse_activations"] = False
    metadata = {"training_architecture": arch, "training_architecture_details": details}
    if cfg.hook_name:
        metadata |= {"hook_name": cfg.hook_name, "model_name": cfg.model_name}
    data = dict(d_in=cfg.d_in, d_sae=cfg.d_sae, dtype="float32", device="cpu")
    data |= dict(apply_b_dec_to_input=cfg.apply_b_dec_to_input, normalize_activations="none")
    data |= {"reshape_activations": "none", "architecture": arch, "metadata": metadata}
    data |= {name: getattr(cfg, name) for name in _INFERENCE_FIELDS[arch]}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / WEIGHTS_FILE))
    (path / CFG_FILE).write_text(json.dumps(data, indent=1))
    return path


def load_sae(path: str | Path) -> SAE:
    """Read an SAE in SAELens' format (written by `save_sae` or SAELens); ValueError naming the
    culprit for a missing file, an architecture other than standard/topk, or unsupported options."""
    path = Path(path)
    for name in (CFG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise ValueError(
                f"{str(path)!r} has no {name}: give an SAE directory in SAELens' format"
            )
    data = json.loads((path / CFG_FILE).read_text())
    arch = data.get("architecture", "standard")
    kinds = {v: k for k, v in ARCHITECTURES.items()}
    if arch not in kinds:
        raise ValueError(f"{str(path)!r}: SAE architecture {arch!r}; attnlab reads {list(kinds)}")
    for name, plain in (("normalize_activations", "none"), ("reshape_activations", "none")):
        if data.get(name, plain) != plain:
            raise ValueError(f"{str(path)!r}: {name}={data[name]!r}; attnlab reads {plain!r} only")
    meta = data.get("metadata") or {}
    given = {f.name for f in fields(SAEConfig)}
    known = {k: v for k, v in data.items() if k in given}
    known |= {k: v for k, v in meta.get("training_architecture_details", {}).items() if k in given}
    hook = {"hook_name": meta.get("hook_name") or "", "model_name": meta.get("model_name") or ""}
    cfg = SAEConfig(**(known | hook | {"kind": kinds[arch]}))
    if cfg.kind == "topk":  # SAELens' inference TopK default, when the file leaves it out
        cfg = replace(
            cfg, rescale_acts_by_decoder_norm=data.get("rescale_acts_by_decoder_norm", False)
        )
    sae = SAE(cfg)
    sae.load_state_dict({k: v.float() for k, v in load_file(str(path / WEIGHTS_FILE)).items()})
    return sae


@contextmanager
def splice(model: nn.Module, sae: SAE, point: str | None = None, use_error_term: bool = True):
    """While active, the activation at `point` (default: the SAE's hook_name) is the SAE's output,
    and the SAE's points are the model's `<point>.hook_sae_*` (module docstring).

    Args:
        model: a model with hook points; point: attnlab's or TransformerLens' name.
        use_error_term: add x - x_hat back (the model's output unchanged); False measures the SAE.
    """
    name = point or sae.cfg.hook_name
    host, _ = point_named(model, name)  # ValueError naming the point if it is not there

    def replace_with_sae(x: Tensor, hook: HookPoint) -> Tensor:
        if x.shape[-1] != sae.cfg.d_in:
            raise ValueError(f"{name} has width {x.shape[-1]}; the SAE reads d_in={sae.cfg.d_in}")
        return sae(x, use_error_term=use_error_term).to(x.dtype)

    host.attached = {f"{name}.{n}": p for n, p in sae.points().items()}
    try:
        with hooks(model, [(name, replace_with_sae)]):
            yield
    finally:
        host.attached = {}


def sae_steers(model: nn.Module, specs: Sequence[Sequence[str]]) -> list[Steer]:
    """Steers from `--sae-steer SAE_DIR FEATURE SCALE` flags: SCALE * W_dec[FEATURE] added at
    the SAE's hook point (SAELens' steering convention). A ValueError naming the culprit for a
    directory that is not an SAE, a feature out of range, or a point this model lacks or whose
    width is not the SAE's."""
    steers = []
    for sae_dir, feature, scale in specs:
        what = f"--sae-steer {sae_dir} {feature} {scale}"
        try:
            f, x = int(feature), float(scale)
        except ValueError:
            raise ValueError(f"{what}: give SAE_DIR FEATURE (an int) SCALE (a number)") from None
        sae = load_sae(sae_dir)
        if not 0 <= f < sae.cfg.d_sae:
            raise ValueError(f"{what}: feature {f} is outside the SAE's 0..{sae.cfg.d_sae - 1}")
        if not sae.cfg.hook_name:
            raise ValueError(f"{what}: the SAE's cfg.json names no metadata.hook_name")
        try:
            point_named(model, sae.cfg.hook_name)
        except ValueError:
            raise ValueError(
                f"{what}: this model has no hook point {sae.cfg.hook_name!r} (the SAE's "
                "metadata.hook_name); give an SAE trained on this model"
            ) from None
        width = _width(model, sae.cfg.hook_name)
        if width != sae.cfg.d_in:
            raise ValueError(
                f"{what}: {sae.cfg.hook_name} has width {width}, the SAE d_in={sae.cfg.d_in}; "
                "give an SAE trained on this model"
            )
        steers.append(Steer(0, sae.W_dec[f].detach(), x, point=sae.cfg.hook_name))
    return steers


@torch.no_grad()
def _width(model: nn.Module, name: str) -> int:
    """The last axis of the activation at `name`, from a forward of one token."""
    device = next(model.parameters()).device
    _, cache = run_with_cache(
        model, torch.zeros(1, 1, dtype=torch.long, device=device), names=[name]
    )
    return cache[name].shape[-1]
