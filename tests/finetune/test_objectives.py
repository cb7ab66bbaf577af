"""SFT and DPO objectives against their references: a hand computation, `transformers`' loss with
-100 labels on the HF twin of a converted model, and `trl`'s sigmoid DPO loss."""

import copy
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from attnlab.adapters.lora import add_lora, disable_adapters, merge_lora
from attnlab.finetune.objectives import (
    IGNORE_INDEX,
    dpo_loss,
    pair_losses,
    reference_model,
    response_labels,
    sequence_logps,
    sft_loss,
    token_logps,
)


def test_response_labels_mask_the_prompt_and_shift_by_one():
    ids = [10, 11, 12, 20, 21, 2]  # prompt 10 11 12, response 20 21 <eos>=2
    x, labels = response_labels(ids, n_prompt=3)
    assert x == [10, 11, 12, 20, 21]
    assert labels == [IGNORE_INDEX, IGNORE_INDEX, 20, 21, 2]


def test_response_labels_refuse_a_sequence_without_response():
    with pytest.raises(ValueError, match="no response token"):
        response_labels([1, 2, 3], n_prompt=3)


def test_sft_loss_equals_a_hand_computation():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    labels = torch.tensor([[IGNORE_INDEX, 3, 5, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 6, 1]])
    terms = []  # -log softmax(logits[b, t])[label], written out with exp and sums
    for b in range(2):
        for t in range(4):
            y = int(labels[b, t])
            if y != IGNORE_INDEX:
                row = logits[b, t].double()
                terms.append(-(float(row[y]) - math.log(float(row.exp().sum()))))
    expected = sum(terms) / len(terms)  # token-weighted: 4 response tokens, not 2 rows
    assert sft_loss(logits, labels).item() == pytest.approx(expected, abs=1e-6)
    assert sft_loss(logits, labels, "sum").item() == pytest.approx(sum(terms), abs=1e-5)
    assert sequence_logps(logits, labels).tolist() == pytest.approx(
        [-(terms[0] + terms[1]), -(terms[2] + terms[3])], abs=1e-5
    )


def test_sft_loss_equals_torch_cross_entropy_with_ignore_index():
    torch.manual_seed(1)
    logits = torch.randn(3, 9, 11, requires_grad=True)
    labels = torch.randint(0, 11, (3, 9))
    labels[:, :4] = IGNORE_INDEX
    labels[2, 7:] = IGNORE_INDEX
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    ours = sft_loss(logits, labels)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-7, rtol=0)


def test_token_logps_are_zero_where_ignored():
    logits = torch.randn(1, 3, 5)
    labels = torch.tensor([[IGNORE_INDEX, 2, IGNORE_INDEX]])
    got = token_logps(logits, labels)
    assert got[0, 0] == 0 and got[0, 2] == 0
    assert got[0, 1] == pytest.approx(float(torch.log_softmax(logits[0, 1], -1)[2]))


@pytest.mark.hf
def test_sft_loss_equals_transformers_loss_on_the_hf_twin(tmp_path):
    """A tiny random GPT-2 saved by transformers, converted by attnlab: transformers' own loss
    with -100 on the prompt (it shifts labels itself) equals sft_loss on response_labels."""
    T = pytest.importorskip("transformers")
    from attnlab.interop.hf import load_hf

    torch.manual_seed(0)
    config = T.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=32, initializer_range=0.2
    )
    hf = T.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf(tmp_path)
    ours.eval()
    seqs = [([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17, 18, 19])]  # (prompt, response)
    n = max(len(p) + len(r) for p, r in seqs)
    full = torch.tensor([p + r + [0] * (n - len(p) - len(r)) for p, r in seqs])  # (B, n)
    real = torch.tensor([[t < len(p) + len(r) for t in range(n)] for p, r in seqs])  # (B, n)
    is_response = torch.tensor([[len(p) <= t < len(p) + len(r) for t in range(n)] for p, r in seqs])
    hf_labels = full.masked_fill(~is_response, IGNORE_INDEX)  # unshifted: transformers shifts
    labels = [response_labels(p + r, len(p))[1] for p, r in seqs]
    labels = torch.tensor([ls + [IGNORE_INDEX] * (n - 1 - len(ls)) for ls in labels])  # (B, n-1)
    with torch.no_grad():
        expected = hf(input_ids=full, attention_mask=real.long(), labels=hf_labels).loss
        got = sft_loss(ours(full[:, :-1], attention_mask=real[:, :-1]), labels)
    assert got.item() == pytest.approx(expected.item(), abs=1e-5)


# --- DPO against trl ------------------------------------------------------------------------------


def trl_sigmoid_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta):
    """trl 1.x's DPO loss (`DPOTrainer._compute_loss`, loss_type "sigmoid") on given sequence
    log-probs: the trainer is built without __init__ and holds only what that method reads; the
    "model" returns the log-probs as one token's (completion length 1), so trl's sum over the
    completion is the sequence log-prob itself."""
    trainer = trl_trainer(beta, ["sigmoid"], [1])
    B = chosen.shape[0]
    logps = torch.cat([chosen, rejected])[:, None]  # (2B, 1): [chosen, rejected] as trl batches
    mask = torch.tensor([[0, 1]] * (2 * B))
    return trl_loss(trainer, logps, mask, ref_chosen, ref_rejected)


def trl_trainer(beta, loss_types, loss_weights):
    """A trl.DPOTrainer built without __init__, holding only what `_compute_loss` reads."""
    trl = pytest.importorskip("trl")
    trainer = trl.DPOTrainer.__new__(trl.DPOTrainer)
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather_for_metrics=lambda t: t, gather=lambda t: t
    )
    trainer.aux_loss_enabled, trainer.ld_alpha, trainer.precompute_ref_logps = False, None, True
    trainer.f_divergence_type = "reverse_kl"
    trainer.loss_types, trainer.loss_weights = loss_types, loss_weights
    trainer.beta, trainer.use_weighting, trainer._tp_size = beta, False, 1
    trainer._metrics, trainer._total_train_tokens = defaultdict(lambda: defaultdict(list)), 0
    return trainer


def trl_loss(trainer, per_token_logps, completion_mask, ref_chosen, ref_rejected):
    """trainer._compute_loss on a batch whose "model" returns `per_token_logps` (2B, T) (0 off
    the completion), completion_mask (2B, T + 1) marking the completion's tokens."""
    n, T = per_token_logps.shape

    def model(**kwargs):
        zeros = torch.zeros(n, T)
        return SimpleNamespace(
            log_probs=per_token_logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
        )

    inputs = {
        "input_ids": torch.zeros(n, T + 1, dtype=torch.long),
        "attention_mask": torch.ones(n, T + 1, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    return trainer._compute_loss(model, inputs, return_outputs=False), trainer._metrics["train"]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.hf  # trl builds on transformers
@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_dpo_loss_and_gradient_equal_trl(beta):
    torch.manual_seed(3)
    B = 6
    policy = (torch.randn(2, B, dtype=torch.float64) * 20 - 40).requires_grad_()
    ref_c, ref_r = torch.randn(2, B, dtype=torch.float64) * 20 - 40
    ours, rc, rr = dpo_loss(policy[0], policy[1], ref_c, ref_r, beta)
    ours = ours.mean()  # trl averages over the pairs
    (g_ours,) = torch.autograd.grad(ours, policy)
    theirs, logged = trl_sigmoid_dpo_loss(policy[0], policy[1], ref_c, ref_r, beta)
    (g_theirs,) = torch.autograd.grad(theirs, policy)
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (g_ours - g_theirs).abs().max().item() < 1e-6
    assert rc.mean().item() == pytest.approx(logged["rewards/chosen"][0], abs=1e-6)
    assert rr.mean().item() == pytest.approx(logged["rewards/rejected"][0], abs=1e-6)
    assert (rc - rr).mean().item() == pytest.approx(logged["rewards/margins"][0], abs=1e-6)
    assert (rc > rr).double().mean().item() == pytest.approx(logged["rewards/accuracies"][0])


@pytest.mark.hf  # trl builds on transformers
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_rpo_loss_and_gradient_equal_trl_sigmoid_plus_sft(alpha):
    """RPO: DPO + alpha * the chosen responses' NLL per token equals trl's loss_type
    ["sigmoid", "sft"] with loss_weights [1, alpha], on responses of different lengths."""
    torch.manual_seed(4)
    B, T = 5, 6
    lengths = torch.randint(1, T + 1, (2 * B,))
    keep = torch.arange(T)[None, :] >= T - lengths[:, None]  # (2B, T): the response at the end
    per_token = (-torch.rand(2 * B, T, dtype=torch.float64) * 4).requires_grad_()
    ref_c, ref_r = torch.randn(2, B, dtype=torch.float64) * 5 - 10
    labels = torch.where(keep, 7, IGNORE_INDEX)  # any token id where the response is
    ours, _, _ = pair_losses(per_token * keep, labels, torch.cat([ref_c, ref_r]), 0.5, alpha)
    ours = ours.mean()  # the loop averages over the pairs, as trl does
    (g_ours,) = torch.autograd.grad(ours, per_token)
    mask = torch.cat([torch.zeros(2 * B, 1, dtype=torch.long), keep.long()], dim=1)
    trainer = trl_trainer(0.5, ["sigmoid", "sft"], [1.0, alpha])
    theirs, _ = trl_loss(trainer, per_token * keep, mask, ref_c, ref_r)
    (g_theirs,) = torch.autograd.grad(theirs, per_token)
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (g_ours - g_theirs).abs().max().item() < 1e-6
    if alpha:  # the term is there: plain DPO differs
        dpo = pair_losses(per_token * keep, labels, torch.cat([ref_c, ref_r]), 0.5)[0].mean()
        assert abs(dpo.item() - ours.item()) > 1e-3


def variant_batch(seed=5, B=4, T=6):
    """Per-token log-probs (2B, T) with responses of different lengths at the end, their labels,
    trl's completion mask (2B, T + 1) and reference log-probs."""
    torch.manual_seed(seed)
    lengths = torch.randint(1, T + 1, (2 * B,))
    keep = torch.arange(T)[None, :] >= T - lengths[:, None]  # (2B, T)
    per_token = (-torch.rand(2 * B, T, dtype=torch.float64) * 4).requires_grad_()
    ref = torch.randn(2 * B, dtype=torch.float64) * 5 - 10
    mask = torch.cat([torch.zeros(2 * B, 1, dtype=torch.long), keep.long()], dim=1)
    return per_token, keep, torch.where(keep, 7, IGNORE_INDEX), mask, ref


def assert_equal_with_gradient(ours, theirs, wrt):
    (g_ours,) = torch.autograd.grad(ours, wrt, retain_graph=True)
    (g_theirs,) = torch.autograd.grad(theirs, wrt)
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (g_ours - g_theirs).abs().max().item() < 1e-6
    assert g_ours.abs().max().item() > 1e-3  # not a comparison of zeros


@pytest.mark.hf  # trl builds on transformers
@pytest.mark.parametrize(("loss", "eps"), [("ipo", 0.0), ("robust", 0.1), ("robust", 0.3)])
def test_ipo_and_robust_dpo_equal_trl(loss, eps):
    """IPO (per-token normalised margins, responses of different lengths) and robust DPO equal
    trl's loss_type "ipo" / "robust", loss and gradient."""
    per_token, keep, labels, mask, ref = variant_batch()
    B = per_token.shape[0] // 2
    ours = pair_losses(per_token * keep, labels, ref, 0.5, loss=loss, label_smoothing=eps)[0]
    trainer = trl_trainer(0.5, [loss], [1.0])
    trainer.label_smoothing = eps
    theirs, _ = trl_loss(trainer, per_token * keep, mask, ref[:B], ref[B:])
    assert_equal_with_gradient(ours.mean(), theirs, per_token)


@pytest.mark.hf  # trl builds on transformers
@pytest.mark.parametrize("eps", [0.1, 0.25])
def test_conservative_dpo_equals_trls_label_smoothed_sigmoid(eps):
    """cDPO, -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h): trl 1.x has it no longer
    under "sigmoid", but its "aot" loss is exactly this of h after sorting the batch's
    log-ratios, a no-op on one pair: pair by pair, loss and gradient are trl's."""
    per_token, keep, labels, mask, ref = variant_batch(seed=6, B=3)
    B = per_token.shape[0] // 2
    ours = pair_losses(per_token * keep, labels, ref, 0.5, loss="sigmoid", label_smoothing=eps)[0]
    trainer = trl_trainer(0.5, ["aot"], [1.0])
    trainer.label_smoothing = eps
    theirs = []
    for i in range(B):
        rows = [i, B + i]  # pair i: its chosen row, then its rejected row
        one, _ = trl_loss(trainer, (per_token * keep)[rows], mask[rows], ref[[i]], ref[[B + i]])
        theirs.append(one)
    assert_equal_with_gradient(ours.mean(), torch.stack(theirs).mean(), per_token)
    plain = pair_losses(per_token * keep, labels, ref, 0.5)[0]
    assert (plain - ours).abs().max() > 1e-3  # the smoothing matters


def test_ipo_loss_is_the_papers_squared_margin():
    """Azar et al. eq. 17 by hand, with each log-ratio per response token, and its minimum at
    a margin of 1 / (2 tau)."""
    pi_w, pi_l, ref_w, ref_l, tau, n_w, n_l = -3.0, -5.0, -4.0, -4.5, 0.5, 2, 4
    t = torch.tensor
    got, _, _ = dpo_loss(
        t([pi_w]), t([pi_l]), t([ref_w]), t([ref_l]), tau, "ipo", lengths=(t([n_w]), t([n_l]))
    )
    margin = (pi_w - ref_w) / n_w - (pi_l - ref_l) / n_l
    assert got.item() == pytest.approx((margin - 1 / (2 * tau)) ** 2)
    at_optimum = dpo_loss(t([1.0]), t([0.0]), t([0.0]), t([0.0]), tau, "ipo", lengths=(t([1]),) * 2)
    assert at_optimum[0].item() == pytest.approx(0.0)


def test_dpo_loss_is_the_papers_formula():
    """Eq. 7 by hand: -log sigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l)))."""
    pi_w, pi_l, ref_w, ref_l, beta = -3.0, -5.0, -4.0, -4.5, 0.5
    z = beta * ((pi_w - ref_w) - (pi_l - ref_l))
    expected = math.log(1 + math.exp(-z))
    losses, rw, rl = dpo_loss(*(torch.tensor([v]) for v in (pi_w, pi_l, ref_w, ref_l)), beta)
    assert losses.item() == pytest.approx(expected, abs=1e-7)
    assert (rw.item(), rl.item()) == pytest.approx((beta * 1.0, beta * -0.5))


def test_dpo_loss_at_the_reference_is_log_2():
    """A policy equal to its reference has zero rewards and loss log 2 (sigmoid(0) = 1/2)."""
    logps = torch.randn(4)
    losses, rw, rl = dpo_loss(logps, logps + 1, logps, logps + 1, beta=0.1)
    torch.testing.assert_close(losses, torch.full((4,), math.log(2)))
    assert rw.abs().max() == 0 and rl.abs().max() == 0


# --- the reference model --------------------------------------------------------------------------


def with_adapters() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(policy, base): a small model with LoRA on its first Linear, B moved off zero (a trained
    adapter), and a copy of the model before LoRA."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    policy = copy.deepcopy(base)
    add_lora(policy, targets=["0"], rank=2, alpha=4.0)
    with torch.no_grad():
        policy[0].lora_B.normal_()
    return policy, base


def test_reference_is_the_frozen_copy_when_given():
    policy = torch.nn.Linear(4, 4)
    frozen = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        policy.weight.add_(1.0)  # the policy has moved; the reference has not
    x = torch.randn(2, 4)
    with reference_model(policy, frozen) as ref:
        assert ref is frozen
        torch.testing.assert_close(ref(x), x @ frozen.weight.T + frozen.bias)


def test_reference_is_the_policy_with_adapters_off():
    """With LoRA, the reference is the policy with its adapters switched off: the same outputs
    as the model before LoRA (computed apart, by plain torch), and the adapters back on after."""
    policy, base = with_adapters()
    x = torch.randn(5, 4)
    with reference_model(policy) as ref:
        assert ref is policy
        torch.testing.assert_close(ref(x), base(x), atol=0, rtol=0)  # W0 x exactly
    assert policy[0].enabled  # back on after the block
    assert not torch.allclose(policy(x), base(x))


def test_adapters_come_back_on_after_an_error_and_merged_ones_refuse():
    policy, base = with_adapters()
    x = torch.randn(5, 4)
    with pytest.raises(RuntimeError, match="inside"):
        with disable_adapters(policy):
            raise RuntimeError("inside")
    assert policy[0].enabled and not torch.allclose(policy(x), base(x))
    merge_lora(policy)
    with pytest.raises(ValueError, match="cannot disable merged adapters"):
        with disable_adapters(policy):
            pass


def test_reference_needs_a_copy_or_adapters():
    with pytest.raises(ValueError, match="reference model"):
        with reference_model(torch.nn.Linear(2, 2)):
            pass
