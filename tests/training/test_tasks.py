"""Tasks: the evaluation sample of a language model stays inside the trained context."""

from attnlab.training import tasks
from attnlab.training.tasks import build_task


def test_sample_is_drawn_in_windows_no_longer_than_the_context(make_run, monkeypatch):
    run = make_run("llama-tiny", context=16)
    task = build_task(run)
    letters = task.tokenizer.encode("abcdefghijklmnopqrstuvwxyz")
    calls = []  # (prompt ids, new tokens) of each generate call

    def fake_generate(model, prompts, n_new, *args, **kwargs):
        calls.append((list(prompts[0]), n_new))
        return [[letters[i % 26] for i in range(n_new)]]

    monkeypatch.setattr(tasks, "generate", fake_generate)
    text = task.sample(None, 40, "cpu", prompt="ROMEO:\n")

    ids = task.tokenizer.encode(text)  # (a character tokenizer: one id per character)
    assert text.startswith("ROMEO:\n") and len(ids) == 7 + 40 and len(calls) > 1
    end = 7
    for prompt, n_new in calls:
        assert prompt == ids[:end][-8:]  # the text so far, cropped to half the context
        assert len(prompt) + n_new <= 16  # never past the trained context
        end += n_new
    assert end == len(ids)
