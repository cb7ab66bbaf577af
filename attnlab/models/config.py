"""ModelConfig: one typed, validated description of every model attnlab builds.

A config is plain data (frozen dataclasses of numbers and names). `models/build.py` is the only
place that turns it into modules; presets live in `models/presets.py`.
"""

from dataclasses import dataclass, field
from typing import Literal

from attnlab.components.ffn import gated_d_ff
from attnlab.components.moe import check_routing
from attnlab.components.positions.rope import RopeScaling
from attnlab.components.vision import Patchify, PatchPosition, check_patch_geometry
from attnlab.configs import check_literals

Arch = Literal["decoder", "encoder", "encoder_decoder", "vlm"]
Position = Literal["none", "sinusoidal", "learned", "rope", "alibi", "t5_bias"]


@dataclass(frozen=True)
class AttentionConfig:
    """Attention heads and options.

    n_kv_heads: None -> n_heads (MHA); 1 -> MQA; a divisor of n_heads -> GQA.
    head_dim: None -> d_model // n_heads.  softmax_scale: None -> 1/sqrt(head_dim) (T5: 1.0).
    sliding_window: each token sees itself and the window - 1 tokens before it (Mistral).
    global_every: with a sliding_window, every global_every-th layer (layers n-1, 2n-1, ...)
        sees the whole sequence and the others the window: Gemma 2 alternates (2), Gemma 3
        has five local layers to each global one (6). None: every layer uses the window.
    qk_norm: RMS-normalise q and k (components/qk_norm.py) over each head (qk_norm_scope
        "head": Qwen3, Gemma 3) or over the whole projection ("projection": OLMo 2).
    logit_softcap: soft-cap the attention logits, cap * tanh(s / cap) (Gemma 2: 50;
        components/softcap.py); written out, so it needs backend "eager".
    backend: how scores become outputs (components/backends.py): "sdpa" (default), "eager",
        "flash", "flex", "triton", or "auto": sdpa, except that a layer given a score_mod bias or
        a BlockMask runs flex, and an ALiBi / T5 model gives its bias as a score_mod for long
        query blocks (positions/base.py `wants_score_mod`) and as a small tensor for decode
        steps. Opt-in: on CPU, flex is forward-only (inference) for now.
    kind: "standard" (MHA/GQA/MQA) or "mla", DeepSeek-V2's Multi-head Latent Attention
        (components/mla.py), which needs kv_lora_rank (r, the cached latent), qk_rope_head_dim
        (R, the shared rotary key), qk_nope_head_dim (Dn) and v_head_dim (Dv); q_lora_rank:
        None = no query compression. MLA takes no n_kv_heads, head_dim, qkv_bias or qk_norm.
    """

    n_heads: int = 8
    n_kv_heads: int | None = None
    head_dim: int | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: Literal["head", "projection"] = "head"
    softmax_scale: float | None = None
    sliding_window: int | None = None
    global_every: int | None = None
    logit_softcap: float | None = None
    backend: Literal["sdpa", "eager", "flash", "flex", "triton", "auto"] = "sdpa"
    kind: Literal["standard", "mla"] = "standard"
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self):
        check_literals(self)
        self._check_mla()
        if self.n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got {self.n_heads}")
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={kv}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        self._check_families()

    def _check_families(self) -> None:
        """The window pattern and the soft-cap of the newer dense families (Gemma 2/3)."""
        if self.global_every is not None:
            if self.sliding_window is None:
                raise ValueError(
                    f"global_every={self.global_every} alternates windowed and global layers; "
                    "set attention.sliding_window too"
                )
            if self.global_every < 2:
                raise ValueError(f"global_every must be >= 2, got {self.global_every}")
        if self.logit_softcap is not None:
            if self.logit_softcap <= 0:
                raise ValueError(f"logit_softcap must be > 0, got {self.logit_softcap}")
            if self.backend != "eager":
                raise ValueError(
                    f"attention.logit_softcap={self.logit_softcap} is written out: set "
                    f"attention.backend='eager' (not {self.backend!r})"
                )

    def is_local(self, layer: int) -> bool:
        """Whether `layer` (0-based) attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.global_every is None or (layer + 1) % self.global_every != 0

    def _check_mla(self) -> None:
        dims = {
            k: getattr(self, k)
            for k in (
                "kv_lora_rank",
                "q_lora_rank",
                "qk_rope_head_dim",
                "qk_nope_head_dim",
                "v_head_dim",
            )
        }
        given = {k: v for k, v in dims.items() if v is not None}
        if self.kind == "standard":
            if given:
                raise ValueError(f"{given} are MLA settings; set attention.kind='mla' to use them")
            return
        missing = [k for k, v in dims.items() if v is None and k != "q_lora_rank"]
        if missing:
            raise ValueError(f"kind='mla' needs {missing} (got {given})")
        small = {k: v for k, v in given.items() if v < 1}
        if small:
            raise ValueError(f"MLA widths must be >= 1, got {small}")
        unused = {
            k: getattr(self, k)
            for k in ("n_kv_heads", "head_dim", "qkv_bias", "qk_norm")
            if getattr(self, k) not in (None, False)
        }
        if unused:
            raise ValueError(f"kind='mla' sets its own key/value shapes; {unused} do not apply")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (used when position == "rope").

    local_theta: the base of the sliding-window layers of a model that alternates them with
        global ones (attention.global_every), where it differs: Gemma 3 rotates its local
        layers with base 10,000 and no scaling, its global ones with `theta` = 1,000,000 and
        `scaling`. None: every layer uses theta and scaling.
    """

    theta: float = 10000.0
    layout: Literal["half", "interleaved"] = "half"
    partial_rotary: float = 1.0
    scaling: RopeScaling | None = None
    local_theta: float | None = None

    def __post_init__(self):
        check_literals(self)
        if not 0.0 < self.partial_rotary <= 1.0:
            raise ValueError(f"partial_rotary must be in (0, 1], got {self.partial_rotary}")


@dataclass(frozen=True)
class VisionConfig:
    """The image side of a vision-language model (arch "vlm"): a small ViT and how it meets the
    text decoder. The ViT shares the text model's width, heads, norm and FFN settings.

    connect: "cross_attention": the decoder's blocks cross-attend to the image features
        (encoder-decoder style, as in captioning and VQA); "prefix": the image tokens open the
        decoder's own sequence and every token sees all of them (prefix-LM, as in PaliGemma and
        the VLA models built on such decoders).
    n_layers: ViT encoder blocks; 0 feeds the patch embeddings straight in (as Fuyu does).
    patchify, position, cls_token: see `components/vision.py`.
    """

    image_size: int = 32
    patch_size: int = 8
    in_channels: int = 3
    n_layers: int = 2
    patchify: Patchify = "conv"
    position: PatchPosition = "learned"
    cls_token: bool = False
    connect: Literal["cross_attention", "prefix"] = "cross_attention"

    def __post_init__(self):
        check_literals(self)
        check_patch_geometry(self.image_size, self.patch_size, self.in_channels)
        if self.n_layers < 0:
            raise ValueError(f"vision.n_layers must be >= 0, got {self.n_layers}")

    @property
    def n_tokens(self) -> int:
        """Image tokens: one per patch, plus the class token if there is one."""
        return (self.image_size // self.patch_size) ** 2 + int(self.cls_token)


@dataclass(frozen=True)
class MoEConfig:
    """Sparse Mixture-of-Experts feed-forward layers in place of the dense FFN
    (components/moe.py, which explains each field).

    n_experts: E routed SwiGLU experts.  n_experts_per_token: k, the experts each token uses.
    d_expert: each routed expert's hidden width; None -> the model's d_ff.
    score: the router, "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3, with its
        selection-only bias).  normalize: divide the k gates by their sum.
    n_groups, topk_groups: DeepSeek-V3's group-limited routing (1, 1 = off).
    routed_scale: multiplies the routed gates (DeepSeek's routed_scaling_factor).
    d_shared: the width of the shared expert every token uses (0 = none; DeepSeek's
        n_shared_experts * d_expert).  shared_gate: a sigmoid gate on it (Qwen2-MoE).
    bias_update_rate: DeepSeek-V3's gamma, the auxiliary-loss-free bias step (sigmoid only).
    first_dense_layers: the first layers keep a dense FFN (DeepSeek's first_k_dense_replace).
    """

    n_experts: int = 8
    n_experts_per_token: int = 2
    d_expert: int | None = None
    score: Literal["softmax", "sigmoid"] = "softmax"
    normalize: bool = True
    n_groups: int = 1
    topk_groups: int = 1
    routed_scale: float = 1.0
    d_shared: int = 0
    shared_gate: bool = False
    bias_update_rate: float = 0.0
    first_dense_layers: int = 0

    def __post_init__(self):
        check_routing(
            self.n_experts, self.n_experts_per_token, self.score, self.n_groups, self.topk_groups
        )
        check_literals(self)
        small = {
            k: getattr(self, k)
            for k in ("d_shared", "bias_update_rate", "first_dense_layers")
            if getattr(self, k) < 0
        }
        if small or (self.d_expert is not None and self.d_expert < 1):
            raise ValueError(f"moe widths, rates and layer counts must be >= 0, got {small}")
        if self.bias_update_rate and self.score != "sigmoid":
            raise ValueError(
                f"moe.bias_update_rate={self.bias_update_rate} balances a 'sigmoid' router; "
                f"moe.score={self.score!r} has no bias (use the auxiliary loss)"
            )


@dataclass(frozen=True)
class HeadConfig:
    """A task head in place of the LM / masked-LM head, for fine-tuning (models/heads.py).

    task: "sequence", one label per sequence: an encoder pools its first ([CLS]) token through
        BERT's pooler (dense + tanh); a decoder reads its last non-padding token, as HF's
        GPT2ForSequenceClassification and LlamaForSequenceClassification do. "token", one
        label per token (an encoder; BertForTokenClassification).
    num_labels: N, the classifier's outputs.
    labels: the label names, index = label id (HF's id2label); () names them LABEL_0, LABEL_1...
    pad_token_id: a decoder's sequence head without an attention mask treats tokens equal to
        it as padding (HF's rule); None: the last position is the last token.
    pooling: an encoder's sequence head pools "cls", its first token (BERT's), or "mean", the
        mean of its real tokens' hidden states (then the same pooler and classifier; no HF
        class holds it). A decoder's sequence head always reads its last real token.
    """

    task: Literal["sequence", "token"] = "sequence"
    num_labels: int = 2
    labels: tuple[str, ...] = ()
    pad_token_id: int | None = None
    pooling: Literal["cls", "mean"] = "cls"

    def __post_init__(self):
        check_literals(self)
        if self.pooling != "cls" and self.task != "sequence":
            raise ValueError(
                f"head.pooling={self.pooling!r} is for a sequence head; a token head "
                "classifies every token (leave pooling 'cls')"
            )
        object.__setattr__(self, "labels", tuple(self.labels))  # JSON gives a list
        if self.num_labels < 1:
            raise ValueError(f"head.num_labels must be >= 1, got {self.num_labels}")
        if self.labels and len(self.labels) != self.num_labels:
            raise ValueError(
                f"head.labels names {len(self.labels)} labels {list(self.labels)}, but "
                f"head.num_labels={self.num_labels}; give one name per label (or none)"
            )
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"head.labels has repeated names: {list(self.labels)}")

    @property
    def id2label(self) -> dict[int, str]:
        """{label id: name}, LABEL_i where no names were given."""
        names = self.labels or tuple(f"LABEL_{i}" for i in range(self.num_labels))
        return dict(enumerate(names))


@dataclass(frozen=True)
class ModelConfig:
    """Every architecture attnlab builds: decoder-only, encoder-only, encoder-decoder.

    Names follow the glossary: d_model, n_layers, vocab_size, max_seq_len, d_ff, norm_eps.
    n_decoder_layers: encoder-decoder only, None -> n_layers.
    d_ff: None -> 4 * d_model (mlp) or 8/3 * d_model rounded up to 64 (swiglu, geglu).
    activation: of the mlp, and of the geglu gate ("gelu" or "gelu_tanh"); swiglu uses SiLU.
    norm_placement: "pre", "post" (components/blocks.py), "sandwich": a pre-norm and a norm
        of each sublayer's output (Gemma 2/3), "post_sublayer": the output norm alone (OLMo 2).
    norm_unit_offset: every RMSNorm scales by (1 + weight), weights starting at 0 (Gemma).
    final_norm: None -> a final norm after the last block unless norm_placement == "post".
    logit_softcap: soft-cap the output logits, cap * tanh(z / cap) (Gemma 2: 30), or None.
    head_rescale: multiply the final hidden state by d_model^-0.5 before a tied head (T5 v1.0).
    embed_norm: a norm of the embeddings: in an encoder after adding positions and segments
        (BERT), in a decoder right after the token lookup (BLOOM's word_embeddings_layernorm).
    type_vocab_size: BERT's segment embeddings.
    vision: the image encoder of a "vlm" (vision-language) model; None for every other arch.
    head: a task head (sequence or token classification) in place of the LM head; None: the LM.
    moe: Mixture-of-Experts FFNs (a decoder's, ffn "swiglu"); None: dense FFNs.
    """

    arch: Arch
    d_model: int
    n_layers: int
    vocab_size: int
    max_seq_len: int
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    n_decoder_layers: int | None = None
    position: Position = "rope"
    rope: RopeConfig = field(default_factory=RopeConfig)
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    norm_placement: Literal["pre", "post", "sandwich", "post_sublayer"] = "pre"
    norm_eps: float = 1e-5
    norm_bias: bool = True
    norm_unit_offset: bool = False
    final_norm: bool | None = None
    logit_softcap: float | None = None
    ffn: Literal["mlp", "swiglu", "geglu"] = "swiglu"
    activation: Literal["relu", "gelu", "gelu_tanh", "silu"] = "gelu"
    d_ff: int | None = None
    ffn_bias: bool = False
    dropout: float = 0.0
    tie_embeddings: bool = True
    scale_embeddings: bool = False
    head_rescale: bool = False
    embed_norm: bool = False
    type_vocab_size: int = 0
    init: Literal["gpt2", "xavier", "trunc_normal"] = "gpt2"
    init_std: float = 0.02
    vision: VisionConfig | None = None
    head: HeadConfig | None = None
    moe: MoEConfig | None = None

    def __post_init__(self):
        check_literals(self)
        for name in ("d_model", "n_layers", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        a = self.attention
        if a.kind == "standard" and a.head_dim is None and self.d_model % a.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={a.n_heads}; "
                "pick another n_heads or set attention.head_dim"
            )
        if self.position == "rope":
            rotary_dim = int(self.rope_head_dim * self.rope.partial_rotary)
            if self.rope_head_dim % 2 or rotary_dim % 2:
                name = "qk_rope_head_dim" if a.kind == "mla" else "head_dim"
                raise ValueError(
                    f"RoPE rotates pairs of features: {name}={self.rope_head_dim} "
                    f"(rotary part {rotary_dim}) must be even"
                )
        self._check_mla()
        self._check_families()
        if self.ffn == "geglu" and self.activation not in ("gelu", "gelu_tanh"):
            raise ValueError(
                f"geglu gates with gelu or gelu_tanh, not activation={self.activation!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        self._check_vision()
        self._check_head()
        self._check_moe()

    def _check_moe(self) -> None:
        m = self.moe
        if m is None:
            return
        if self.arch != "decoder" or self.ffn != "swiglu":
            raise ValueError(
                f"moe needs arch='decoder' and ffn='swiglu' (SwiGLU experts), not "
                f"arch={self.arch!r}, ffn={self.ffn!r}"
            )
        if self.ffn_bias or m.first_dense_layers > self.n_layers:
            raise ValueError(
                f"moe experts have no biases (ffn_bias={self.ffn_bias}) and "
                f"moe.first_dense_layers={m.first_dense_layers} must be <= n_layers={self.n_layers}"
            )

    def _check_families(self) -> None:
        """The fields of the newer dense families (Qwen3, Gemma 2/3, OLMo 2) that need others."""
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ValueError(f"norm_unit_offset scales an RMSNorm, not norm={self.norm!r}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be > 0, got {self.logit_softcap}")
        if self.rope.local_theta is not None and (
            self.position != "rope" or self.attention.global_every is None
        ):
            raise ValueError(
                f"rope.local_theta={self.rope.local_theta} is the RoPE base of the windowed "
                "layers: it needs position='rope' and attention.global_every"
            )

    def _check_head(self) -> None:
        h = self.head
        if h is None:
            return
        allowed = {"encoder": ("sequence", "token"), "decoder": ("sequence",)}
        if h.task not in allowed.get(self.arch, ()):
            raise ValueError(
                f"a {h.task!r} head needs arch in "
                f"{[a for a, tasks in allowed.items() if h.task in tasks]}, not arch={self.arch!r}"
            )
        if h.pooling != "cls" and self.arch != "encoder":
            raise ValueError(
                f"head.pooling={h.pooling!r} is for an encoder; a {self.arch}'s sequence head "
                "reads its last real token (the only one that has seen the whole text)"
            )
        if h.pad_token_id is not None and not 0 <= h.pad_token_id < self.vocab_size:
            raise ValueError(
                f"head.pad_token_id={h.pad_token_id} is not a token id (vocab_size="
                f"{self.vocab_size})"
            )

    def _check_mla(self) -> None:
        a = self.attention
        if a.kind != "mla":
            return
        if self.arch not in ("decoder", "encoder"):
            raise ValueError(f"MLA is self-attention only; arch={self.arch!r} has cross-attention")
        ranks = {"kv_lora_rank": a.kv_lora_rank, "q_lora_rank": a.q_lora_rank}
        wide = {k: v for k, v in ranks.items() if v is not None and v > self.d_model}
        if wide:
            raise ValueError(
                f"MLA ranks compress the model width: {wide} exceed d_model={self.d_model}"
            )

    def _check_vision(self) -> None:
        if (self.arch == "vlm") != (self.vision is not None):
            raise ValueError(
                f"arch={self.arch!r} with vision={self.vision}: a 'vlm' model needs "
                "a vision config, and only a 'vlm' model takes one"
            )
        if self.vision is None or self.vision.connect != "prefix":
            return
        if self.max_seq_len <= self.vision.n_tokens:
            raise ValueError(
                f"a prefix vlm puts {self.vision.n_tokens} image tokens before the "
                f"text, so max_seq_len={self.max_seq_len} leaves no room for text"
            )
        if self.attention.sliding_window is not None:
            raise ValueError(
                "a prefix vlm sees its whole image prefix; "
                f"sliding_window={self.attention.sliding_window} is not supported"
            )

    @property
    def head_dim(self) -> int:
        a = self.attention
        return self.d_model // a.n_heads if a.head_dim is None else a.head_dim

    @property
    def rope_head_dim(self) -> int:
        """The per-head width RoPE is built for: qk_rope_head_dim for MLA, else head_dim."""
        a = self.attention
        return a.qk_rope_head_dim if a.kind == "mla" else self.head_dim

    @property
    def n_kv_heads(self) -> int:
        a = self.attention
        return a.n_heads if a.n_kv_heads is None else a.n_kv_heads

    @property
    def ffn_width(self) -> int:
        """The resolved d_ff."""
        if self.d_ff is not None:
            return self.d_ff
        return 4 * self.d_model if self.ffn == "mlp" else gated_d_ff(self.d_model)

    @property
    def expert_width(self) -> int:
        """The resolved moe.d_expert (the model's d_ff when unset)."""
        return self.ffn_width if self.moe.d_expert is None else self.moe.d_expert

    @property
    def has_final_norm(self) -> bool:
        return self.norm_placement != "post" if self.final_norm is None else self.final_norm

    @property
    def decoder_layers(self) -> int:
        return self.n_layers if self.n_decoder_layers is None else self.n_decoder_layers
