"""POST /v1/attention: the attention maps of a chat reply (or of a text) as the viewer's page.

    {"messages": [...], "reply": "..."}   the conversation, rendered by the chat template as
                                          /v1/chat/completions renders it, then the reply
    {"prompt": "..."}                     or a plain text
    "layers": [0, 3], "heads": [1]        the layers and heads to keep (default: all)
    "last": 64                            how many of the last tokens the page shows

The answer is the page of viz/viewer.py (text/html; self-contained, it fetches nothing), its
tokens the tokenizer's own pieces. The chat page's "attention" link under a reply asks for it.

Why `last`: the whole text runs through one forward, so every query attends to all the keys
before it, as in generation; the page then shows the last N queries over the last N keys only.
The viewer embeds every map as JSON, and a served model is large: SmolLM2-135M has 30 layers x
9 heads, so a 1000-token conversation would be 270 million weights, where N = 64 keeps it to
about a million (under 10 MB of page). A shown row then sums to at most 1: the rest of its weight
went to earlier tokens.

Where it runs: the forward needs capture hooks (viz/capture.py) on the model the engine serves,
and the engine's thread runs forwards of live batches on that model all the time. Hooks put on
from the HTTP handler's thread would fire inside those (wrong maps, a slower step) and race with
them, so the capture is an engine job (types.py's Jobs), run on the engine's thread between two
steps. It runs the base model: a LoRA adapter served beside it (--lora) or a learned prefix
(prefix or prompt tuning) is not applied.

Shapes: T tokens of the text, N = min(last, T) shown, H heads kept.
"""

from dataclasses import dataclass

import torch
from torch import nn

from attnlab.inference.steps import decoder_of
from attnlab.serve.protocol import APIError, Settings, field_of, token_text
from attnlab.viz.capture import attention_layers, capture_attention
from attnlab.viz.viewer import viewer_data

DEFAULT_LAST = 64  # tokens shown (queries and keys): see the module docstring


@dataclass(frozen=True)
class AttentionAsk:
    """A checked /v1/attention request: the text's token ids and what to show of it."""

    ids: tuple[int, ...]
    layers: list[int] | None  # None: all
    heads: list[int] | None  # None: all
    last: int


def indices(body: dict, name: str, n: int) -> list[int] | None:
    """body[name]: None (all), or a non-empty list of distinct indices in [0, n)."""
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, list) and value and len(set(value)) == len(value)
    if not ok or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise APIError(400, f"{name} must be a non-empty list of distinct indices", name)
    bad = [i for i in value if not 0 <= i < n]
    if bad:
        message = f"{name} {bad} out of range: this model has {n} (valid 0..{n - 1})"
        raise APIError(400, message, name)
    return value


def attention_ask(
    body: dict, ids: list[int], param: str, model: nn.Module, settings: Settings
) -> AttentionAsk:
    """Check a /v1/attention request whose text (from field `param`) gave `ids`; 400s name
    the field at fault."""
    found = attention_layers(model)
    if list(found) != ["decoder_self"]:
        message = (
            f"/v1/attention shows a decoder-only model's attention; this one has {list(found)}"
        )
        raise APIError(400, message, "model")
    stack = found["decoder_self"]
    if not ids:
        raise APIError(400, "the text is empty: give a prompt, or messages and a reply", param)
    if len(ids) > settings.context:
        message = (
            f"the text has {len(ids)} tokens; this model's context is {settings.context}: "
            "shorten it"
        )
        raise APIError(400, message, param, "context_length_exceeded")
    return AttentionAsk(
        tuple(ids),
        indices(body, "layers", len(stack)),
        indices(body, "heads", stack[0].n_heads),
        field_of(body, "last", int, DEFAULT_LAST, lambda v: v >= 1, "an integer >= 1"),
    )


@torch.no_grad()
def page_data(model: nn.Module, tokenizer, ask: AttentionAsk, name: str) -> dict:
    """The viewer's data for `ask` (viewer_data): one forward of the whole text with capture
    on, then the last N queries over the last N keys. An engine job: it runs on the engine's
    thread (the module docstring says why)."""
    decoder = decoder_of(model)  # a prefix-tuned model's base decoder
    ids = torch.tensor([ask.ids], device=decoder.head.weight.device)  # (1, T)
    n = min(ask.last, len(ask.ids))
    with capture_attention(decoder, ask.layers, ask.heads) as maps:
        decoder(ids)
    maps.weights = {
        kind: {i: w[:, :, -n:, -n:].cpu() for i, w in per_layer.items()}  # each (1, H, N, N)
        for kind, per_layer in maps.weights.items()
    }
    shown = [token_text(tokenizer, t) for t in ask.ids[-n:]]
    title = f"{name}: attention of the last {n} of {len(ask.ids)} tokens"
    return viewer_data(maps, {"decoder_self": (shown, shown)}, title=title)
