"""Task heads for fine-tuning: a pre-trained body with a small classifier in place of its LM head.

    sequence classification, encoder   EncoderForClassification (models/encoder.py): BERT's
                                       pooler (dense + tanh) on the first ([CLS]) token
                                       (pooling "cls"), or the same on the mean of the
                                       real tokens: EncoderForMeanPooledClassification
    sequence classification, decoder   DecoderForSequenceClassification: the hidden state of
                                       the last non-padding token (a causal model has read the
                                       whole text only there), as GPT-2 and Llama do in HF
    token classification, encoder      EncoderForTokenClassification: a Linear on every token

`ModelConfig.head` (a HeadConfig: task, num_labels, label names) says which one `build_model`
makes, so a checkpoint's config.json rebuilds it. `copy_body` gives a freshly built head model
the weights of a pre-trained base (an MLM-trained encoder, a causal LM).

Shapes: B batch, T length, C d_model, N num_labels.
"""

from dataclasses import replace

import torch
from torch import Tensor, nn

from attnlab.models.config import HeadConfig, ModelConfig
from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import Encoder, EncoderForClassification


def task_head_kind(cfg: ModelConfig) -> str | None:
    """None for a language model (its LM or masked-LM head in place); otherwise what the model
    is instead, as a phrase for one-line errors: "a sequence classifier (3 labels)". The one
    test of "can this checkpoint generate / be served / be scored as an LM" (a loaded
    checkpoint's config carries its head, old "n_labels" runs included: checkpoint.py)."""
    if cfg.head is None:
        return None
    return f"a {cfg.head.task} classifier ({cfg.head.num_labels} labels)"


def last_token_index(
    ids: Tensor, attention_mask: Tensor | None = None, pad_token_id: int | None = None
) -> Tensor:
    """The position of each row's last real token, as HF's sequence classifiers find it.

    Real tokens are where `attention_mask` is True, else where ids != pad_token_id; with
    neither, every position is real. Taking the largest index of a real token works for right
    padding (the last word) and for left padding (the last position) alike.

    Args:
        ids: (B, T) token ids.  attention_mask: (B, T) True = real token, or None.
        pad_token_id: the padding id, used when there is no attention_mask.

    Returns:
        (B,) long indices.
    """
    B, T = ids.shape
    if attention_mask is None and pad_token_id is None:
        return torch.full((B,), T - 1, dtype=torch.long, device=ids.device)
    real = attention_mask.bool() if attention_mask is not None else ids != pad_token_id  # (B, T)
    positions = torch.arange(T, device=ids.device)  # (T,)
    return (positions * real).argmax(-1)  # (B,): the largest real index (0 for an empty row)


class DecoderForSequenceClassification(DecoderLM):
    """A decoder whose head maps the last real token's hidden state to N label logits.

    The same modules and weight names as DecoderLM (embed, blocks, norm, head), with `head`
    a Linear(C, N) without bias (HF's `score`), so every family converter reuses its key table.

    Args:
        as DecoderLM; head: Linear(C, N).  pad_token_id: see `last_token_index`.
    """

    def __init__(self, *args, pad_token_id: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pad_token_id = pad_token_id

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """ids: (B, T); attention_mask: (B, T) True = real token -> label logits (B, N)."""
        B = ids.shape[0]
        ctx, pos = self.context(ids, attention_mask, None, None, None, None, None)
        x = self.drop(self.positions.embed(self.embed(ids), pos))  # (B, T, C)
        x = self.run_blocks(x, ctx)  # (B, T, C)
        last = last_token_index(ids, attention_mask, self.pad_token_id)  # (B,)
        x = x[torch.arange(B, device=ids.device), last]  # (B, C)
        return self.logits(x)  # final norm and score: (B, N)


class EncoderForMeanPooledClassification(EncoderForClassification):
    """EncoderForClassification pooling the mean of the real tokens' hidden states in place of
    the first token's (HeadConfig.pooling "mean"; the same modules: pooler, classifier):

        pooled = tanh(W_p (sum_t m_t h_t) / (sum_t m_t) + b_p)     m_t = 1 for a real token

    For a base whose first token was never trained to sum up the text (an MLM-only encoder:
    no next-sentence task). No HF class holds it: the HF export refuses it.

    Args:
        as EncoderForClassification.
    """

    def summary(self, h: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The mean of the real tokens' hidden states: (B, T, C) -> (B, C)."""
        if attention_mask is None:
            return h.mean(1)
        m = attention_mask.to(h.dtype).unsqueeze(-1)  # (B, T, 1)
        return (h * m).sum(1) / m.sum(1).clamp(min=1)


class EncoderForTokenClassification(nn.Module):
    """Encoder + dropout + a Linear on every token (BertForTokenClassification; NER, tagging).

    Args:
        encoder: an Encoder.  d_model: C.  n_labels: N.  dropout: before the classifier.
    """

    def __init__(self, encoder: Encoder, d_model: int, n_labels: int, dropout: float = 0.0):
        super().__init__()
        if n_labels < 1:
            raise ValueError(f"n_labels must be >= 1, got {n_labels}")
        self.encoder = encoder
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(d_model, n_labels)

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """ids: (B, T) -> label logits for every token (B, T, N)."""
        h = self.encoder(ids, attention_mask, token_type_ids)  # (B, T, C)
        return self.classifier(self.drop(h))  # (B, T, N)


HEAD_CLASSES = (
    EncoderForClassification,
    EncoderForTokenClassification,
    DecoderForSequenceClassification,
)


def head_modules(model: nn.Module) -> tuple[str, ...]:
    """The names of the modules a task head adds to its body (what fine-tuning starts afresh)."""
    if isinstance(model, EncoderForClassification):
        return ("pooler", "classifier")
    if isinstance(model, EncoderForTokenClassification):
        return ("classifier",)
    if isinstance(model, DecoderForSequenceClassification):
        return ("head",)
    raise ValueError(f"{type(model).__name__} has no task head")


def config_with_head(cfg: ModelConfig, model: nn.Module) -> ModelConfig:
    """`cfg` with the head `model` has, when `cfg` does not say (a model built with
    build_model(cfg, n_labels=N)); the label names are then LABEL_i."""
    if cfg.head is not None or not isinstance(model, HEAD_CLASSES):
        return cfg
    if isinstance(model, DecoderForSequenceClassification):
        head = HeadConfig("sequence", model.head.out_features, pad_token_id=model.pad_token_id)
    elif isinstance(model, EncoderForMeanPooledClassification):
        head = HeadConfig("sequence", model.classifier.out_features, pooling="mean")
    else:
        task = "token" if isinstance(model, EncoderForTokenClassification) else "sequence"
        head = HeadConfig(task, model.classifier.out_features)
    return replace(cfg, head=head)


def copy_body(model: nn.Module, base: nn.Module) -> nn.Module:
    """Copy every weight of `model` but its head from `base`, the pre-trained model.

    Args:
        model: a fresh head model (build_model of the base's config with `head` set).
        base: the pre-trained model (EncoderForMLM, DecoderLM, or a model with another head).

    Returns:
        `model` in train mode: its body equals base's, its head is as built.

    Raises:
        ValueError when `base` is not of the family the head needs, naming both.
    """
    fresh = tuple(f"{name}." for name in head_modules(model))
    body = {k: v for k, v in model.state_dict().items() if not k.startswith(fresh)}
    given = base.state_dict()
    missing = sorted(k for k in body if k not in given)
    wrong = sorted(k for k in body if k in given and given[k].shape != body[k].shape)
    if missing or wrong:
        raise ValueError(
            f"a {type(base).__name__} is not a base for {type(model).__name__}: its weights "
            f"lack {missing[:4]}{'...' if len(missing) > 4 else ''} and differ in shape for "
            f"{wrong[:4]}; use a base checkpoint of the family the task needs"
        )
    model.load_state_dict({k: given[k] for k in body}, strict=False)
    return model.train()
