"""Tasks: the evaluation sample of a language model stays inside the trained context."""

import torch
from torch import nn

from attnlab.components.positions.base import NoPosition
from attnlab.training.tasks import build_task


class RecordingLM(nn.Module):
    """A stand-in decoder that writes `letters` in turn, one per call, and records what each
    call is fed: (first cache slot, ids). A call at slot 0 is a prefill of a new cache."""

    def __init__(self, letters: list[int], vocab_size: int):
        super().__init__()
        self.head = nn.Linear(1, vocab_size, bias=False)  # generate reads V and the device here
        self.embed = nn.Embedding(vocab_size, 1)  # the KV cache takes its dtype from here
        self.blocks = nn.ModuleList()
        self.positions = NoPosition()
        self.letters, self.calls = letters, []

    def forward(self, ids, attention_mask=None, *, slots=None, **_):
        self.calls.append((int(slots[0]), ids[0].tolist()))
        logits = torch.full((*ids.shape, self.head.out_features), -50.0)
        logits[..., self.letters[(len(self.calls) - 1) % len(self.letters)]] = 50.0
        return logits  # (B, T, V)


def test_sample_is_drawn_in_windows_no_longer_than_the_context(make_run):
    run = make_run("llama-tiny", context=16)
    task = build_task(run)
    tok = task.tokenizer
    letters = sorted(set(tok.encode("Speak, hear me.")))  # characters every corpus here has
    model = RecordingLM(letters, tok.vocab_size)
    text = task.sample(model, 40, "cpu", prompt="Speak:\n")

    ids = tok.encode(text)  # (a character tokenizer: one id per character)
    assert text.startswith("Speak:\n") and len(ids) == 7 + 40
    assert ids[7:] == [letters[i % len(letters)] for i in range(40)]
    prefills = [i for i, (slot, _) in enumerate(model.calls) if slot == 0]
    assert len(prefills) > 1  # the context was refilled
    fed = 0  # tokens of the text the model has read so far
    for slot, ids_in in model.calls:
        if slot == 0:  # a new cache: the prompt, then a refill with the newest token
            upto = 7 if fed == 0 else fed + 1
            assert ids_in == ids[:upto][-8:]  # the text so far, cropped to half the context
            visible = len(ids_in)
        else:  # one decode step: the newest token, after the ones in the cache
            upto = fed + 1
            assert ids_in == [ids[fed]] and slot == visible
            visible += 1
        assert visible <= 16  # never past the trained context
        fed = upto
    assert fed == len(ids) - 1  # every token but the last was read
