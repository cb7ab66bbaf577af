"""SFTTask and DPOTask: what their batches train on, packing against unpacked rows, the chat
template, and DPO's loss against per-sequence forwards of the policy and the reference."""

import copy
import math
from dataclasses import replace

import pytest
import torch

from attnlab.adapters.lora import add_lora, lora_modules
from attnlab.finetune.objectives import IGNORE_INDEX, dpo_loss, sequence_logps, sft_loss
from attnlab.finetune.sequences import check_examples, pack_rows, pad_rows
from attnlab.finetune.tasks import DPOTask, SFTTask
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.quantize import quantize_model
from attnlab.tokenizer import (
    CHAT_TOKENS,
    DEFAULT_CHAT_TEMPLATE,
    Tokenizer,
    train_char_tokenizer,
)

SFT = [
    {"prompt": "up ab:", "response": "AB"},
    {"prompt": "up cde:", "response": "CDE"},
    {"prompt": "up f:", "response": "F"},
    {"prompt": "up bad:", "response": "BAD"},
]
DPO = [{"prompt": e["prompt"], "chosen": e["response"], "rejected": e["response"][::-1] + "x"}
       for e in SFT]  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_char_tokenizer(["up abcdef: ABCDEF x"])


def tiny_model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = replace(get_preset("llama-tiny"), vocab_size=vocab, n_layers=2, max_seq_len=64)
    return build_model(cfg).eval()


def sft_task(tok, **kw) -> SFTTask:
    return SFTTask(SFT, SFT[:2], tok, batch_size=4, context=32, **kw)


def test_sft_batches_train_on_the_response_and_eos_only(tok):
    task = sft_task(tok)
    batch = task.train_batch(torch.Generator().manual_seed(0))
    eos = tok.token_id("<eos>")
    for x, labels, mask in zip(batch["x"], batch["labels"], batch["mask"]):
        trained = labels[labels != IGNORE_INDEX].tolist()
        assert trained[-1] == eos  # the response ends with <eos>: generation learns to stop
        response = tok.decode(trained[:-1])
        prompt = tok.decode(x[mask].tolist())[: -len(response)]
        assert {"prompt": prompt, "response": response} in SFT
        assert (labels[~mask] == IGNORE_INDEX).all()  # padding is never trained on
    assert task.n_targets(batch) == int((batch["labels"] != IGNORE_INDEX).sum())


def test_sft_counts_every_response_token_of_a_batch(tok):
    task = sft_task(tok)
    rows = task.train  # each (x, labels): the response's tokens and <eos> carry labels
    for (x, labels), ex in zip(rows, SFT):
        assert sum(t != IGNORE_INDEX for t in labels) == len(ex["response"]) + 1
        assert len(x) == len(ex["prompt"]) + len(ex["response"])


def test_packed_rows_give_each_example_its_unpacked_loss(tok):
    """Three examples in one packed row and two more in another: the summed loss equals the sum
    of each example's loss computed alone (nothing leaks between examples; positions restart)."""
    task = sft_task(tok)
    model = tiny_model(tok.vocab_size)
    rows = task.train
    packed = pack_rows([[rows[0], rows[1], rows[2]], [rows[3], rows[1]]], 32, task.pad)
    assert packed["pos"][0, : len(rows[0][0]) + 1].tolist() == [*range(len(rows[0][0])), 0]
    alone = [rows[0], rows[1], rows[2], rows[3], rows[1]]
    expected = sum(task.loss_sum(model, pad_rows([r], task.pad)).item() for r in alone)
    with torch.no_grad():
        got = task.loss_sum(model, packed).item()
    assert got == pytest.approx(expected, abs=1e-4)
    assert task.n_targets(packed) == sum(task.n_targets(pad_rows([r], task.pad)) for r in alone)


def test_packed_training_batches_fill_rows_of_the_context(tok):
    task = sft_task(tok, packing=True)
    batch = task.train_batch(torch.Generator().manual_seed(1))
    assert batch["x"].shape == (4, 32) and batch["attn_mask"].shape == (4, 32, 32)
    assert (batch["pos"] == 0).sum(1).min() >= 3  # several examples per row


def test_sft_uses_the_chat_template_and_its_end_of_turn():
    """The tokenizer's own template (DEFAULT_CHAT_TEMPLATE, brought by CHAT_TOKENS): the prompt
    is the user turn and the generation prompt, the response is trained up to <|end|>."""
    chat = train_char_tokenizer(["up abcdef: ABCDEF x\n"], special_tokens=CHAT_TOKENS)
    assert chat.chat_template == DEFAULT_CHAT_TEMPLATE
    task = SFTTask(SFT, SFT[:1], chat, batch_size=2, context=32)
    end = chat.token_id("<|end|>")
    assert task.format.templated and task.format.stop_tokens == [end]
    x, labels = task.train[0]
    prompt = "<|user|>\nup ab:<|end|>\n<|assistant|>\n"
    assert chat.decode(x, skip_special=False) == prompt + "AB<|end|>"
    trained = [t for t in labels if t != IGNORE_INDEX]
    # the rest of the template's text after the prompt; no <eos>: the turn's end stops it
    assert chat.decode(trained, skip_special=False) == "AB<|end|>\n"
    assert chat.token_id("<eos>") not in trained
    assert task.format.response_of(chat.encode("AB") + [end] + chat.encode("junk")) == "AB"
    no_template = SFTTask(SFT, SFT[:1], chat, batch_size=2, context=32, chat_template=False)
    assert not no_template.format.templated


def test_examples_longer_than_the_context_are_left_out_and_counted(tok):
    long = {"prompt": "up " + "a" * 40 + ":", "response": "A"}
    task = SFTTask([*SFT, long], SFT[:1], tok, batch_size=2, context=16)
    assert task.skipped == 1 and len(task.train) == len(SFT)
    with pytest.raises(ValueError, match="longer than train.context=16"):
        SFTTask([long], SFT[:1], tok, batch_size=2, context=16)


def test_examples_are_validated_by_number_and_field():
    with pytest.raises(ValueError, match="the data, example 2: field 'response' must be a non"):
        check_examples(
            [SFT[0], {"prompt": "x", "response": ""}], ("prompt", "response"), "the data"
        )
    with pytest.raises(ValueError, match="has no examples"):
        check_examples([], ("prompt",), "the data")


def test_sft_evaluate_reports_loss_and_exact_match(tok):
    model = tiny_model(tok.vocab_size)
    task = sft_task(tok, max_new_tokens=4)
    got = task.evaluate(model, 1, "cpu")
    batch = pad_rows(task.val, task.pad)
    with torch.no_grad():
        expected = sft_loss(model(batch["x"], attention_mask=batch["mask"]), batch["labels"])
    assert got["val_loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert got["val_exact_match"] == 0.0  # random weights answer nothing right


def alone_logps(model, task, pairs, side: int) -> torch.Tensor:
    """log pi(y|x) of each sequence forwarded on its own, without padding."""
    out = []
    for pair in pairs:
        x, labels = pair[side]
        logits = model(torch.tensor([x]))
        out.append(sequence_logps(logits, torch.tensor([labels]))[0])
    return torch.stack(out)


def test_dpo_loss_of_a_padded_batch_equals_per_sequence_forwards(tok):
    policy = tiny_model(tok.vocab_size)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the policy has moved away from the reference
    task = DPOTask(DPO, DPO[:2], tok, batch_size=4, context=32, beta=0.3, reference=reference)
    batch = task._batch(task.train)
    with torch.no_grad():
        losses, rc, rr = task.pair_losses(policy, batch)
        expected = dpo_loss(
            alone_logps(policy, task, task.train, 0),
            alone_logps(policy, task, task.train, 1),
            alone_logps(reference, task, task.train, 0),
            alone_logps(reference, task, task.train, 1),
            beta=0.3,
        )
    for got, want in zip((losses, rc, rr), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert task.n_targets(batch) == len(DPO)
    assert not any(p.requires_grad for p in reference.parameters())


def test_rpo_adds_alpha_times_the_chosen_responses_sft_loss(tok):
    """DPOTask(rpo_alpha=a): each pair's loss is DPO's plus a times the SFT loss (per token) of
    the batch's chosen sequences, forwarded here as an SFT batch of their own."""
    policy = tiny_model(tok.vocab_size)
    kw = dict(batch_size=4, context=32, beta=0.3, reference=copy.deepcopy(policy))
    dpo = DPOTask(DPO, DPO[:2], tok, **kw)
    rpo = DPOTask(DPO, DPO[:2], tok, rpo_alpha=0.7, **kw)
    batch = dpo._batch(dpo.train)
    with torch.no_grad():
        plain = dpo.pair_losses(policy, batch)[0]
        got = rpo.pair_losses(policy, batch)[0]
        chosen = pad_rows([c for c, _ in dpo.train], dpo.pad)
        nll = sft_loss(policy(chosen["x"], attention_mask=chosen["mask"]), chosen["labels"])
    torch.testing.assert_close(got, plain + 0.7 * nll, atol=1e-5, rtol=0)
    assert nll > 0.1


def test_dpo_starts_at_log_2_when_the_policy_is_its_reference(tok):
    policy = tiny_model(tok.vocab_size)
    task = DPOTask(DPO, DPO, tok, batch_size=4, context=32, reference=copy.deepcopy(policy))
    got = task.evaluate(policy, 1, "cpu")
    assert got["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert got["val_reward_margin"] == 0 and got["val_preference_accuracy"] == 0


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_qlora_dpo_starts_at_log_2_as_it_trains(tok, scheme):
    """QLoRA at step 0 (B = 0: the policy is its reference), in a training forward (the
    adapters' gradients flow) and with precomputed reference log-probs: every log-ratio is 0
    and the loss log 2. The quantized layers took the bf16 kernel in the no-grad reference
    and the fp32 path in the policy: log-ratios of ~1e-3 nats, the loss off by ~1e-5."""
    policy = tiny_model(tok.vocab_size).train()
    quantize_model(policy, scheme)
    add_lora(policy, targets=("q", "v", "mlp"), rank=4)
    task = DPOTask(DPO, DPO, tok, batch_size=4, context=32, reference=None)
    losses, rc, rr = task.pair_losses(policy, task._batch(task.train))
    assert losses.requires_grad
    assert float(losses.mean()) == pytest.approx(math.log(2), abs=1e-6)
    assert float(torch.cat([rc, rr]).abs().max()) <= 1e-6
    task.precompute_reference(policy, "cpu")
    losses, rc, rr = task.pair_losses(policy, task.train_batch(torch.Generator().manual_seed(0)))
    assert float(losses.mean()) == pytest.approx(math.log(2), abs=1e-6)
    assert float(torch.cat([rc, rr]).abs().max()) <= 1e-6
    kernels = [m.use_kernel for m in policy.modules() if hasattr(m, "use_kernel")]
    assert kernels and any(kernels)  # the kernels are back on for inference


def test_dpo_reference_is_the_policy_with_its_adapters_off(tok):
    """A LoRA policy (trained adapters: B off zero) and no frozen copy: the reference log-probs
    are the base model's, each sequence computed alone through the model before LoRA."""
    base = tiny_model(tok.vocab_size)
    policy = copy.deepcopy(base)
    add_lora(policy, targets=("q_proj", "v_proj", "o_proj"), rank=4)
    with torch.no_grad():
        for m in lora_modules(policy).values():
            m.lora_B.normal_(std=0.5)
    task = DPOTask(DPO, DPO[:2], tok, batch_size=4, context=32, beta=0.5, reference=None)
    batch = task._batch(task.train)
    with torch.no_grad():
        _, rc, rr = task.pair_losses(policy, batch)
        with_copy = DPOTask(DPO, DPO[:2], tok, batch_size=4, context=32, reference=base)
        want = with_copy._reference_logps(policy, batch)  # the frozen model before LoRA
        assert torch.equal(task._reference_logps(policy, batch), want)
        want_c = alone_logps(policy, task, task.train, 0) - alone_logps(base, task, task.train, 0)
        want_r = alone_logps(policy, task, task.train, 1) - alone_logps(base, task, task.train, 1)
    torch.testing.assert_close(rc, 0.5 * want_c, atol=1e-5, rtol=0)
    torch.testing.assert_close(rr, 0.5 * want_r, atol=1e-5, rtol=0)
    assert rc.abs().max() > 1e-3  # the adapters do move the policy from the reference
    assert all(m.enabled for m in lora_modules(policy).values())  # back on


def test_dpo_without_a_reference_or_adapters_is_an_error(tok):
    task = DPOTask(DPO, DPO[:2], tok, batch_size=4, context=32, reference=None)
    with pytest.raises(ValueError, match="DPO needs a reference model"):
        task.loss_sum(tiny_model(tok.vocab_size), task._batch(task.train))


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_exact_match_after_learning_the_examples_by_heart(tok):
    """Greedy, batched generation of the responses (prompts of different lengths, left-padded)
    is scored right: a model trained on four examples until it knows them answers them all,
    and each answer is the one generated for its prompt alone."""
    model = tiny_model(tok.vocab_size).train()
    task = SFTTask(SFT, SFT, tok, batch_size=4, context=32, max_new_tokens=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(120):
        batch = task.train_batch(gen)
        loss = task.loss_sum(model, batch) / task.n_targets(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert task.evaluate(model, 1, "cpu")["val_exact_match"] == 1.0
    prompts = [ex["prompt"] for ex in SFT]
    together = task.responses(model, prompts, 6)
    assert together == [task.responses(model, [p], 6)[0] for p in prompts]
    assert [r.strip() for r in together] == [ex["response"] for ex in SFT]


def test_precomputed_reference_log_probs_give_the_same_losses(tok):
    """precompute_reference: batches carry the frozen reference's log-probs, computed once;
    the losses and rewards are those of computing them at each step, and the copy is let go."""
    policy = tiny_model(tok.vocab_size)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    kw = dict(batch_size=2, context=32, beta=0.3)
    live = DPOTask(DPO, DPO[:3], tok, reference=copy.deepcopy(reference), **kw)
    cached = DPOTask(DPO, DPO[:3], tok, reference=copy.deepcopy(reference), **kw)
    cached.precompute_reference(policy, "cpu")
    assert cached.reference is None and cached.ref_train.shape == (len(DPO), 2)
    a = live.train_batch(torch.Generator().manual_seed(5))
    b = cached.train_batch(torch.Generator().manual_seed(5))
    assert "ref_logps" in b and torch.equal(a["x"], b["x"])
    with torch.no_grad():
        for got, want in zip(cached.pair_losses(policy, b), live.pair_losses(policy, a)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert cached.evaluate(policy, 1, "cpu") == pytest.approx(live.evaluate(policy, 1, "cpu"))
