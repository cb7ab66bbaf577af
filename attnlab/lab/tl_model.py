"""A causal LM behind TransformerLens' model and cache interface, for code written for it.

    model = HookedModel.from_checkpoint(CKPT)          # the loading line that changes
    tokens = model.to_tokens("When Mary and John went to the store, John gave a drink to")
    logits, cache = model.run_with_cache(tokens)
    cache["pattern", 0]                                # (B, H, T, S), TransformerLens' names
    resid, labels = cache.accumulated_resid(apply_ln=True, pos_slice=-1, return_labels=True)

`HookedModel` holds an attnlab DecoderLM and its tokenizer; its hooks are attnlab's points under
TransformerLens' names and layouts (components/tl_names.py). `ActivationCache` is the dict of
`run_with_cache` with TransformerLens' readings of the residual stream: `accumulated_resid`,
`decompose_resid`, `stack_head_results`, `apply_ln_to_stack` (the final norm or a block's norm
with its scale frozen at its cached value, LayerNorm centring each component first). The
weights read as TransformerLens lays them out per head (`W_Q` ... `W_O`, `b_*`, and the `QK` /
`OV` circuits as FactoredMatrix), and `generate`, `loss_fn`, `get_token_position`,
`stop_at_layer` and `remove_batch_dim` behave as TransformerLens'. What is here is what
tests/lab/test_tl_model.py checks against TransformerLens (a TransformerBridge on the same
weights); weight processing (`fold_ln`, `center_unembed`, ...) is not: the weights are the
checkpoint's, as the bridge's are.

Shapes: B batch, T positions, C d_model, H heads, L layers, V vocab, N stacked components.
"""

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.checkpoint import open_checkpoint, plain_model
from attnlab.components.hooks import hook_points, hooks, tl_points
from attnlab.components.norms import LayerNorm
from attnlab.components.tl_names import get_act_name
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.lab.factored import FactoredMatrix
from attnlab.lab.patching import check_lm


@dataclass(frozen=True)
class Config:
    """The fields of TransformerLens' `cfg` that analysis code reads."""

    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    n_key_value_heads: int
    d_vocab: int
    n_ctx: int
    normalization_type: str  # "LN" or "RMS"
    device: str = "cpu"


def _pos(x: Tensor, pos_slice: int | slice | None, dim: int = -2) -> Tensor:
    """TransformerLens' Slice on the position axis: an int selects (and drops) one position."""
    if pos_slice is None:
        return x
    index = [slice(None)] * x.dim()
    index[dim] = pos_slice
    return x[tuple(index)]


class ActivationCache(dict):
    """{TransformerLens name: activation} of one run, with its residual-stream readings.

    A key may also be (short name, layer[, layer type]) as `get_act_name` reads it, and a
    negative layer counts from the end: cache["pattern", -1].
    """

    def __init__(self, cache: dict[str, Tensor], model: "HookedModel"):
        super().__init__(cache)
        self.model = model

    def __getitem__(self, key):
        if isinstance(key, tuple):
            layer = key[1]
            if isinstance(layer, int) and layer < 0:
                layer += self.model.cfg.n_layers
            key = get_act_name(key[0], layer, *key[2:])
        return super().__getitem__(key)

    def remove_batch_dim(self) -> "ActivationCache":
        """The cache of a one-row batch without its batch axis, as TransformerLens'."""
        for name, x in self.items():
            if x.shape[0] != 1:
                raise ValueError(f"{name} has a batch of {x.shape[0]}: remove_batch_dim needs 1")
        return ActivationCache({n: x[0] for n, x in self.items()}, self.model)

    def apply_ln_to_stack(
        self,
        residual_stack: Tensor,
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: int | slice | None = None,
    ) -> Tensor:
        """Each component through the norm read at `layer` (None, -1 or L: the final norm),
        its scale frozen at the cached one; without the norm's weight and bias, as
        TransformerLens.

        Args:
            residual_stack: (N, B, T, C), or (N, B, C) with an int pos_slice.
        """
        L = self.model.cfg.n_layers
        if layer is None or layer in (-1, L):
            scale = self["ln_final.hook_scale"]  # (B, T, 1)
        else:
            scale = self[f"blocks.{layer}.ln{2 if mlp_input else 1}.hook_scale"]
        if self.model.cfg.normalization_type == "LN":
            residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
        return residual_stack / _pos(scale, pos_slice)

    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: int | slice | None = None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ):
        """The residual stream before each block up to `layer` (None: all, then the final
        stream): (N, B, T, C), labels "0_pre", "0_mid", ..., "final_post". With apply_ln at
        the final layer each stream goes through the final norm itself (its own statistics
        and the norm's weight: the logit lens, as TransformerLens 4 does); at an earlier layer
        through that layer's frozen scale (`apply_ln_to_stack`)."""
        L = self.model.cfg.n_layers
        layer = L if layer is None or layer == -1 else layer
        parts, labels = [], []
        for i in range(layer + 1):
            if i == L:
                parts.append(self["resid_post", L - 1])
                labels.append("final_post")
                continue
            parts.append(self["resid_pre", i])
            labels.append(f"{i}_pre")
            if (incl_mid and i < layer) or (mlp_input and i == layer):
                parts.append(self["resid_mid", i])
                labels.append(f"{i}_mid")
        stack = _pos(torch.stack(parts), pos_slice)
        if apply_ln and layer == L:
            stack = self.model.model.norm(stack)  # (N, B, T, C), each its own statistics
        elif apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        return (stack, labels) if return_labels else stack

    def decompose_resid(
        self,
        layer: int | None = None,
        apply_ln: bool = False,
        pos_slice: int | slice | None = None,
        return_labels: bool = False,
    ):
        """What wrote the stream read at `layer` (None: the final one): the embeddings, and
        each earlier block's attention and MLP outputs; (N, B, T, C), labels "embed",
        "pos_embed" (a learned table), "0_attn_out", "0_mlp_out", ..."""
        L = self.model.cfg.n_layers
        layer = L if layer is None or layer == -1 else layer
        parts, labels = [self["hook_embed"]], ["embed"]
        if "hook_pos_embed" in self:
            parts.append(self["hook_pos_embed"])
            labels.append("pos_embed")
        for i in range(layer):
            parts += [self["attn_out", i], self["mlp_out", i]]
            labels += [f"{i}_attn_out", f"{i}_mlp_out"]
        stack = _pos(torch.stack(parts), pos_slice)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def stack_head_results(
        self,
        layer: int = -1,
        pos_slice: int | slice | None = None,
        apply_ln: bool = False,
        return_labels: bool = False,
    ):
        """Each head's write to the stream (z_h W_O[h], no bias), for the blocks before `layer`
        (-1: every block): (L*H, B, T, C), labels "L{l}H{h}". Read from `attn.hook_result`
        when cached, else computed from `attn.hook_z` and o_proj's weight."""
        L = self.model.cfg.n_layers
        layer = L if layer == -1 else layer
        parts, labels = [], []
        for i in range(layer):
            parts.append(self._head_results(i))  # (B, T, H, C)
            labels += [f"L{i}H{h}" for h in range(self.model.cfg.n_heads)]
        stack = torch.cat([p.permute(2, 0, 1, 3) for p in parts])  # (L*H, B, T, C)
        stack = _pos(stack, pos_slice)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def _head_results(self, i: int) -> Tensor:
        name = get_act_name("result", i)
        if name in self:
            return self[name]
        z = self["z", i]  # (B, T, H, D)
        attn = self.model.model.blocks[i].self_attn
        w_o = attn.o_proj.weight.view(-1, z.shape[2], z.shape[3])  # (C, H, D)
        return torch.einsum("bthd,chd->bthc", z, w_o.to(z.dtype))  # (B, T, H, C)


class HookedModel:
    """A DecoderLM and its tokenizer with TransformerLens' model interface.

    Args:
        model: a pre-norm DecoderLM.  tokenizer: attnlab's Tokenizer (or None: ids only).
        n_ctx: the context length (`cfg.n_ctx`); None: the position table's, else 0.
    """

    def __init__(self, model: nn.Module, tokenizer=None, n_ctx: int | None = None):
        self.model, self.tokenizer = check_lm(model), tokenizer
        attn = model.blocks[0].self_attn
        norm = model.norm
        self.cfg = Config(
            n_layers=len(model.blocks),
            d_model=model.head.weight.shape[1],
            n_heads=attn.n_heads,
            d_head=attn.head_dim,
            n_key_value_heads=attn.n_kv_heads,
            d_vocab=model.head.weight.shape[0],
            n_ctx=getattr(model.positions, "max_seq_len", 0) if n_ctx is None else n_ctx,
            normalization_type="LN" if isinstance(norm, LayerNorm) else "RMS",
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path, **kw) -> "HookedModel":
        """Open any checkpoint attnlab reads (open_checkpoint) as a HookedModel."""
        loaded = plain_model(open_checkpoint(path, **kw), "HookedModel takes a plain causal LM")
        return cls(loaded.model, loaded.tokenizer, loaded.config.max_seq_len)

    # --- tokens ----------------------------------------------------------------------------------
    def _bos(self) -> list[int]:
        bos = None if self.tokenizer is None else self.tokenizer.token_id("<bos>")
        return [] if bos is None else [bos]

    def to_tokens(self, input: str | Sequence[str], prepend_bos: bool = True) -> Tensor:
        """(B, T) ids of a text or a list of texts (padded on the right), BOS first."""
        if self.tokenizer is None:
            raise ValueError("this HookedModel has no tokenizer: give token ids (B, T) instead")
        texts = [input] if isinstance(input, str) else list(input)
        rows = [(self._bos() if prepend_bos else []) + self.tokenizer.encode(t) for t in texts]
        pad = self.tokenizer.token_id("<pad>") or 0
        T = max(len(r) for r in rows)
        return torch.tensor([r + [pad] * (T - len(r)) for r in rows])

    def to_str_tokens(self, input: str | Tensor, prepend_bos: bool = True) -> list[str]:
        """Each token of a text (or of a 1-D / (1, T) id tensor) as a string."""
        ids = self.to_tokens(input, prepend_bos)[0] if isinstance(input, str) else input
        return [self.tokenizer.decode([i], skip_special=False) for i in ids.flatten().tolist()]

    def to_string(self, tokens: Tensor | int | Sequence[int]) -> str | list[str]:
        """The text of ids: an int, a list, a 0-D or (T,) tensor; a list of texts for (B, T)."""
        if isinstance(tokens, Tensor) and tokens.dim() == 2:
            return [self.tokenizer.decode(row.tolist()) for row in tokens]
        ids = tokens.reshape(-1).tolist() if isinstance(tokens, Tensor) else tokens
        return self.tokenizer.decode([ids] if isinstance(ids, int) else list(ids))

    def to_single_token(self, string: str) -> int:
        """The id of a string that is one token (a ValueError otherwise)."""
        ids = self.tokenizer.encode(string)
        if len(ids) != 1:
            raise ValueError(f"{string!r} is {len(ids)} tokens {ids}, not one")
        return ids[0]

    def get_token_position(
        self, single_token: str | int, input: str | Tensor, mode: str = "first", prepend_bos=True
    ) -> int:
        """The position of a token in a text (BOS counted) or in (T,) / (1, T) ids; mode
        "first" or "last" occurrence."""
        tokens = self.to_tokens(input, prepend_bos)[0] if isinstance(input, str) else input
        token = single_token
        if isinstance(token, str):
            token = self.to_single_token(token)
        where = (tokens.reshape(-1) == token).nonzero().flatten().tolist()
        if not where:
            raise ValueError(f"{single_token!r} is not in the input")
        if mode not in ("first", "last"):
            raise ValueError(f"mode {mode!r}: choose 'first' or 'last'")
        return where[0] if mode == "first" else where[-1]

    def _ids(self, input, prepend_bos: bool = True) -> Tensor:
        return self.to_tokens(input, prepend_bos) if isinstance(input, str | list) else input

    # --- running ---------------------------------------------------------------------------------
    def loss_fn(self, logits: Tensor, tokens: Tensor, per_token: bool = False) -> Tensor:
        """The next-token cross-entropy: the mean, or per_token (B, T - 1)."""
        losses = F.cross_entropy(
            logits[:, :-1].transpose(1, 2).float(), tokens[:, 1:], reduction="none"
        )
        return losses if per_token else losses.mean()

    def _out(self, logits: Tensor, tokens: Tensor, return_type: str | None):
        if return_type == "logits":
            return logits
        if return_type is None:
            return None
        if return_type == "loss":
            return self.loss_fn(logits, tokens)
        if return_type == "both":
            return logits, self.loss_fn(logits, tokens)
        raise ValueError(f"return_type {return_type!r}: choose 'logits', 'loss', 'both' or None")

    def _forward(self, tokens: Tensor, return_type, stop_at_layer: int | None, fwd_hooks=()):
        """The model on `tokens` with `fwd_hooks` on; with stop_at_layer = k, only the blocks
        before k run (negative counts from the end) and the result is the residual stream
        after them, as TransformerLens' (return_type is then not read)."""
        L = self.cfg.n_layers
        if stop_at_layer is None:
            with self.hooks(fwd_hooks):
                return self._out(self.model(tokens), tokens, return_type)
        k = stop_at_layer + L if stop_at_layer < 0 else stop_at_layer
        if not 0 <= k <= L:
            raise ValueError(f"stop_at_layer {stop_at_layer}: the model has {L} blocks")
        if k == L:  # the last block's output, before the final norm
            seen = {}
            last = (f"blocks.{L - 1}.hook_resid_post", lambda x, hook: seen.update(x=x))
            with self.hooks([*fwd_hooks, last]):
                self.model(tokens)
            return seen["x"]

        def stop(x, hook):  # installed before any other hook on the point: nothing sees it
            raise _Stopped(x)

        try:
            with self.hooks([(f"blocks.{k}.hook_resid_pre", stop), *fwd_hooks]):
                self.model(tokens)
        except _Stopped as stopped:
            return stopped.resid
        raise AssertionError(f"blocks.{k}.hook_resid_pre was not reached")

    @torch.no_grad()
    def __call__(self, input, return_type: str | None = "logits", prepend_bos: bool = True, **kw):
        return self._forward(self._ids(input, prepend_bos), return_type, kw.get("stop_at_layer"))

    def run_with_cache(
        self,
        input,
        names_filter: str | Sequence[str] | Callable[[str], bool] | None = None,
        return_type: str | None = "logits",
        remove_batch_dim: bool = False,
        stop_at_layer: int | None = None,
        prepend_bos: bool = True,
        **_,
    ) -> tuple[object, ActivationCache]:
        """The forward and an ActivationCache of TransformerLens' names (all by default)."""
        tokens = self._ids(input, prepend_bos)
        if names_filter is None:
            names = list(tl_points(self.model))
        elif isinstance(names_filter, str):
            names = [names_filter]
        elif callable(names_filter):
            names = [n for n in tl_points(self.model) if names_filter(n)]
        else:
            names = list(names_filter)
        kept: dict[str, Tensor] = {}

        def keep(x, hook):
            kept[hook.name] = x.detach()

        with torch.no_grad():
            out = self._forward(tokens, return_type, stop_at_layer, [(n, keep) for n in names])
        cache = ActivationCache(kept, self)
        return out, cache.remove_batch_dim() if remove_batch_dim else cache

    @torch.no_grad()
    def run_with_hooks(
        self,
        input,
        fwd_hooks=(),
        return_type: str | None = "logits",
        prepend_bos: bool = True,
        stop_at_layer: int | None = None,
        **_,
    ):
        """The forward with `fwd_hooks` ((name or filter over TL names, fn) pairs) on; the
        hooks come off after the run (an error in one too)."""
        return self._forward(self._ids(input, prepend_bos), return_type, stop_at_layer, fwd_hooks)

    @contextmanager
    def hooks(self, fwd_hooks=()):
        """Hooks on for a `with` block, under TransformerLens' names."""
        with hooks(self.model, list(fwd_hooks), naming="transformer_lens"):
            yield self

    def reset_hooks(self) -> None:
        """Take every hook off every point (run_with_hooks already does after its run)."""
        for point in hook_points(self.model).values():
            point.fns.clear()

    @torch.no_grad()
    def generate(
        self,
        input: str | Tensor = "",
        max_new_tokens: int = 10,
        stop_at_eos: bool = True,
        eos_token_id: int | None = None,
        do_sample: bool = True,
        top_k: int | None = None,
        top_p: float | None = None,
        temperature: float = 1.0,
        freq_penalty: float = 0.0,
        prepend_bos: bool = True,
        **_,
    ) -> str | Tensor:
        """Continue a text (returned with its continuation, BOS left out) or (B, T) ids
        (returned with theirs: rows that stop early are padded with the stop token), with
        attnlab's generation loop and KV cache."""
        tokens = self._ids(input, prepend_bos)
        if eos_token_id is None and stop_at_eos and self.tokenizer is not None:
            eos_token_id = self.tokenizer.token_id("<eos>")
        sampling = SamplingConfig(
            temperature=temperature if do_sample else 0.0,
            top_k=top_k,
            top_p=top_p,
            frequency_penalty=freq_penalty,
        )
        stops = (eos_token_id,) if stop_at_eos and eos_token_id is not None else ()
        config = GenerationConfig(max_new_tokens, sampling=sampling, stop_tokens=stops)
        rows = generate(self.model, tokens.tolist(), config)
        if isinstance(input, str):
            return self.to_string(tokens[0, len(self._bos()) if prepend_bos else 0 :]) + (
                self.to_string(rows[0])
            )
        pad = stops[0] if stops else 0
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=tokens.dtype)
        return torch.cat([tokens, new], dim=1)

    def named_parameters(self, *args, **kw):
        """The DecoderLM's parameters, under attnlab's names."""
        return self.model.named_parameters(*args, **kw)

    def parameters(self, *args, **kw):
        return self.model.parameters(*args, **kw)

    # --- weights ---------------------------------------------------------------------------------
    @property
    def W_U(self) -> Tensor:
        """(C, V) the unembedding (times the head scale a T5-style tied head has)."""
        return self.model.head.weight.T * self.model.head_scale

    @property
    def b_U(self) -> Tensor:
        """(V,) the unembedding's bias (zeros without one)."""
        b = self.model.head.bias
        return torch.zeros(self.cfg.d_vocab) if b is None else b

    @property
    def W_E(self) -> Tensor:
        """(V, C) the token embedding."""
        return self.model.embed.weight

    @property
    def embed(self) -> "_Embed":
        """`model.embed.W_E`, as TransformerLens' embedding module reads."""
        return _Embed(self.W_E)

    @property
    def unembed(self) -> "_Unembed":
        """`model.unembed.W_U` and `.b_U`."""
        return _Unembed(self.W_U, self.b_U)

    def _per_head(self, proj: str, bias: bool = False) -> Tensor:
        """q/k/v_proj of every block per head: weights (L, heads, C, D), biases (L, heads, D)
        (zeros without one); k and v have the key-value heads (GQA), as TransformerLens 4."""
        out = []
        for block in self.model.blocks:
            attn = block.self_attn
            layer = getattr(attn, proj)
            n = layer.out_features // attn.head_dim  # the heads this projection has
            if bias:
                b = torch.zeros(layer.out_features) if layer.bias is None else layer.bias
                out.append(b.view(n, attn.head_dim))
            else:
                out.append(layer.weight.view(n, attn.head_dim, -1).transpose(1, 2))
        return torch.stack(out).detach()

    def _for_each_query_head(self, w: Tensor) -> Tensor:
        """(L, K, ...) key-value heads -> (L, H, ...): each repeated for its query heads."""
        return w.repeat_interleave(self.cfg.n_heads // w.shape[1], dim=1)

    @property
    def W_Q(self) -> Tensor:
        """(L, H, C, D): q = x @ W_Q[l, h] + b_Q[l, h] (before the rotary rotation)."""
        return self._per_head("q_proj")

    @property
    def W_K(self) -> Tensor:
        """(L, K, C, D), K key-value heads."""
        return self._per_head("k_proj")

    @property
    def W_V(self) -> Tensor:
        return self._per_head("v_proj")

    @property
    def b_Q(self) -> Tensor:
        return self._per_head("q_proj", bias=True)

    @property
    def b_K(self) -> Tensor:
        return self._per_head("k_proj", bias=True)

    @property
    def b_V(self) -> Tensor:
        return self._per_head("v_proj", bias=True)

    @property
    def W_O(self) -> Tensor:
        """(L, H, D, C): head h's write to the stream is z[..., h, :] @ W_O[l, h]."""
        ws = []
        for block in self.model.blocks:
            attn = block.self_attn
            w = attn.o_proj.weight.view(-1, attn.n_heads, attn.head_dim)  # (C, H, D)
            ws.append(w.permute(1, 2, 0))
        return torch.stack(ws).detach()

    @property
    def b_O(self) -> Tensor:
        """(L, C), zeros where o_proj has no bias."""
        bs = [b.self_attn.o_proj.bias for b in self.model.blocks]
        zeros = torch.zeros(self.cfg.d_model)
        return torch.stack([zeros if b is None else b.detach() for b in bs])

    @property
    def QK(self) -> FactoredMatrix:
        """(L, H, C, C) W_Q W_K^T per head: the bilinear form of the attention scores (without
        the rotation and the 1/sqrt(D) scale)."""
        return FactoredMatrix(self.W_Q, self._for_each_query_head(self.W_K).transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """(L, H, C, C) W_V W_O per head: what a head moves, given where it attends."""
        return FactoredMatrix(self._for_each_query_head(self.W_V), self.W_O)

    def tokens_to_residual_directions(self, tokens: Tensor | int) -> Tensor:
        """W_U's column of each token: (C,) or (..., C)."""
        return (
            self.W_U[:, tokens].movedim(0, -1)
            if isinstance(tokens, Tensor)
            else self.W_U[:, tokens]
        )


class _Stopped(Exception):
    """Carries the residual stream out of a forward that stop_at_layer ends early."""

    def __init__(self, resid: Tensor):
        self.resid = resid


@dataclass(frozen=True)
class _Embed:
    W_E: Tensor


@dataclass(frozen=True)
class _Unembed:
    W_U: Tensor
    b_U: Tensor
