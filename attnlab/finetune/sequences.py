"""From prompt/response examples to token rows: the chat format, padded and packed batches.

    check_examples  each example an object with the task's fields as non-empty strings
    ChatFormat      (prompt, response) -> ids, through the tokenizer's chat template when it
                    has one (Tokenizer.apply_chat_template): the response is what the
                    template adds after the prompt with the generation prompt, ending with
                    the template's end-of-turn marker; without a template the prompt is used
                    as it is and the response ends with <eos>
    pad_rows        (x, labels) rows right-padded into one batch
    pack_rows       several examples per row, each attending only to itself

Shapes: B batch, T length.
"""

import torch

from attnlab.finetune.objectives import IGNORE_INDEX
from attnlab.inference.chat import end_of_turn

SFT_FIELDS = ("prompt", "response")
DPO_FIELDS = ("prompt", "chosen", "rejected")


def check_example(example, fields: tuple[str, ...], where: str) -> None:
    """ValueError naming `where` and the field when `example` is not an object whose `fields`
    are non-empty strings."""
    if not isinstance(example, dict):
        raise ValueError(f"{where}: expected an object with fields {list(fields)}")
    for name in fields:
        value = example.get(name)
        if not isinstance(value, str) or not value.strip():
            got = "missing" if name not in example else repr(value)
            raise ValueError(f"{where}: field {name!r} must be a non-empty string, got {got}")


def check_examples(examples: list, fields: tuple[str, ...], where: str) -> None:
    """`check_example` on each (named by number, from 1); an empty list is an error too."""
    if not examples:
        raise ValueError(f"{where} has no examples")
    for i, example in enumerate(examples, 1):
        check_example(example, fields, f"{where}, example {i}")


class ChatFormat:
    """How (prompt, response) becomes token ids, and how a generated response ends.

    Args:
        tokenizer: an attnlab Tokenizer.
        use_template: use the tokenizer's chat template when it has one.
    """

    def __init__(self, tokenizer, use_template: bool = True):
        self.tokenizer = tokenizer
        self.templated = bool(use_template and getattr(tokenizer, "chat_template", None))
        self.eos = tokenizer.token_id("<eos>")
        marker = ""
        if self.templated:  # the template's end of an assistant turn, e.g. "<|end|>"
            marker = end_of_turn(tokenizer)
        self.append_eos = not marker  # no template, or one that does not end a turn
        if self.append_eos:
            if self.eos is None:
                raise ValueError(
                    "the tokenizer has neither a chat template nor an <eos> token: a response "
                    "would have no end to learn"
                )
            marker = tokenizer.backend.id_to_token(self.eos)
        self.end = marker
        end_ids = tokenizer.encode(self.end)
        self.stop_tokens = end_ids if len(end_ids) == 1 else []

    def prompt_text(self, prompt: str) -> str:
        if not self.templated:
            return prompt
        user = [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(user, add_generation_prompt=True)

    def _response_text(self, prompt: str, response: str) -> str:
        """What follows the prompt text: the response and the template's end of turn."""
        if not self.templated:
            return response
        turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        full = self.tokenizer.apply_chat_template(turns, add_generation_prompt=False)
        head = self.prompt_text(prompt)
        if not full.startswith(head):
            raise ValueError(
                "the chat template writes a conversation that does not start with its own "
                "generation prompt; fine-tune with --data.chat_template false"
            )
        return full[len(head) :]

    def encode(self, prompt: str, response: str) -> tuple[list[int], int]:
        """The ids of prompt + response (+ <eos> without a template) and the prompt's length."""
        head = self.tokenizer.encode(self.prompt_text(prompt))
        tail = self.tokenizer.encode(self._response_text(prompt, response))
        if self.append_eos:
            tail = tail + [self.eos]
        return head + tail, len(head)

    def response_of(self, ids: list[int]) -> str:
        """The text of generated ids, up to the end of the response."""
        text = self.tokenizer.decode(ids, skip_special=False)
        return text.split(self.end)[0]


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """Right-pad (x, labels) rows to the longest: {"x", "labels", "mask"}, each (B, T)."""
    T = max(len(x) for x, _ in rows)
    x = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.long)
    for i, (xs, ls) in enumerate(rows):
        x[i, : len(xs)] = torch.tensor(xs)
        labels[i, : len(ls)] = torch.tensor(ls)
    lengths = torch.tensor([len(xs) for xs, _ in rows])
    return {"x": x, "labels": labels, "mask": torch.arange(T)[None, :] < lengths[:, None]}


def pack_rows(rows: list[list[tuple[list[int], list[int]]]], T: int, pad_id: int) -> dict:
    """Several (x, labels) examples per row of T tokens, each attending only to itself.

    Returns:
        {"x", "labels", "pos" (positions restart at 0 in each example), "attn_mask"
        (B, T, T): causal within an example, nothing across; a padding position attends to
        itself only}.
    """
    B = len(rows)
    x = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((B, T), dtype=torch.long)
    segment = torch.arange(T).repeat(B, 1) + T  # padding: a segment of its own per position
    for b, examples in enumerate(rows):
        start = 0
        for s, (xs, ls) in enumerate(examples):
            n = len(xs)
            x[b, start : start + n] = torch.tensor(xs)
            labels[b, start : start + n] = torch.tensor(ls)
            pos[b, start : start + n] = torch.arange(n)
            segment[b, start : start + n] = s
            start += n
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T)
    same = segment[:, :, None] == segment[:, None, :]  # (B, T, T)
    return {"x": x, "labels": labels, "pos": pos, "attn_mask": same & causal}
