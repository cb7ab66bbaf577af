"""lab/sae.py against sae-lens 6.54 (through tests/lab/sae_lens_shim.py): the same weights and
activations give the same encode/decode/forward, loss terms, optimizer step and files."""

import copy
import importlib.util

import pytest
import torch

from attnlab.components.hooks import run_with_cache
from attnlab.lab.sae import SAE, SAEConfig, SAETrainer, load_sae, save_sae, splice
from tests.lab.helpers import tiny_lm

# sae-lens is not a dev requirement (pyproject.toml's dev extra says why and how to install it):
# a checkout without it skips these parity tests. When it is installed, the shim imports it, and
# any failure there is an error, not a skip.
if importlib.util.find_spec("sae_lens") is None:
    pytest.skip("pip install --no-deps 'sae-lens>=6.54,<7'", allow_module_level=True)
from tests.lab import sae_lens_shim as sl  # noqa: E402

TOL = 1e-5
C, FEATURES, N = 16, 48, 64


def reference(kind: str, **cfg):
    """sae-lens' training SAE of `kind` and attnlab's, with sae-lens' random weights copied in
    (the biases too, made non-zero so each term is tested)."""
    torch.manual_seed(1)
    if kind == "relu":
        ref = sl.StandardTrainingSAE(sl.StandardTrainingSAEConfig(d_in=C, d_sae=FEATURES, **cfg))
    else:
        ref = sl.TopKTrainingSAE(sl.TopKTrainingSAEConfig(d_in=C, d_sae=FEATURES, **cfg))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = SAE(SAEConfig(C, FEATURES, kind=kind, **cfg))
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def step_input(x, coefficient=1.0, dead=None):
    return sl.TrainStepInput(x, {"l1": coefficient}, dead, 0, False)


def maxdiff(a, b) -> float:
    return (a - b).abs().max().item()


KINDS = [
    ("relu", {"l1_coefficient": 0.7}),
    ("relu", {"l1_coefficient": 0.3, "apply_b_dec_to_input": False}),
    ("topk", {"k": 5}),
    ("topk", {"k": 5, "rescale_acts_by_decoder_norm": False}),
]


@pytest.mark.parametrize("kind,cfg", KINDS)
def test_encode_decode_forward_and_losses_equal_sae_lens(kind, cfg):
    ref, ours = reference(kind, **cfg)
    x = torch.randn(N, C)
    acts_ref, pre_ref = ref.encode_with_hidden_pre(x)
    acts, pre = ours.encode_with_hidden_pre(x)
    assert maxdiff(acts, acts_ref) <= TOL and maxdiff(pre, pre_ref) <= TOL
    assert (acts != 0).sum() > 0
    assert maxdiff(ours.decode(acts), ref.decode(acts_ref)) <= TOL
    assert maxdiff(ours(x), ref(x)) <= TOL
    dead = torch.zeros(FEATURES, dtype=torch.bool)
    dead[::3] = True  # topk: the aux loss needs dead features
    want = ref.training_forward_pass(step_input(x, cfg.get("l1_coefficient", 1.0), dead))
    got = ours.training_forward(x, cfg.get("l1_coefficient"), dead)
    assert set(got.losses) == set(want.losses)
    for name, value in want.losses.items():
        assert value.item() > 0 and abs(got.losses[name].item() - value.item()) <= TOL, name
    assert abs(got.loss.item() - want.loss.item()) <= TOL


def sae_lens_step(ref, x, lr, dead, coefficient):
    """sae-lens' `SAETrainer._train_step`, its lines: forward, backward, clip 1.0, Adam step."""
    opt = torch.optim.Adam(ref.parameters(), lr=lr, betas=(0.9, 0.999))
    out = ref.training_forward_pass(step_input(x, coefficient, dead))
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    return out


@pytest.mark.parametrize("kind,cfg", KINDS)
def test_one_optimizer_step_equals_sae_lens(kind, cfg):
    ref, ours = reference(kind, **cfg)
    x = 3 * torch.randn(N, C)
    trainer = SAETrainer(ours, lr=1e-2, dead_feature_window=0)
    trainer.since_fired[::2] = 1  # half the features dead (window 0): the aux term is on
    dead = trainer.dead().clone()
    sae_lens_step(ref, x, 1e-2, dead, cfg.get("l1_coefficient", 1.0))
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    trainer.step(x)
    for name, p in ref.named_parameters():
        mine = dict(ours.named_parameters())[name]
        assert maxdiff(mine, before[name]) > 1e-4, f"{name} did not move"
        assert maxdiff(mine, p) <= TOL, name


@pytest.mark.parametrize("kind,cfg", KINDS)
def test_steps_equal_sae_lens_trainer(kind, cfg):
    """sae-lens' own SAETrainer.step over batches of different scales (the gradient clip and
    Adam's moments then matter), an L1 warm-up and a dead-feature window that is crossed."""
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer as Reference

    if kind == "relu":
        cfg = cfg | {"l1_warm_up_steps": 3}
    ref, ours = reference(kind, **cfg)
    batches = [s * torch.randn(N, C) for s in (3.0, 0.05, 10.0, 1.0, 0.3)]
    tcfg = SAETrainerConfig(N * len(batches), N, lr=1e-2, lr_end=1e-2, dead_feature_window=1)
    theirs = Reference(tcfg, ref, data_provider=iter(batches))
    trainer = SAETrainer(ours, lr=1e-2, dead_feature_window=1)
    for x in batches:
        want, got = theirs.step(x), trainer.step(x)
        assert set(got.losses) == set(want.losses)
        for name, value in want.losses.items():
            assert abs(got.losses[name].item() - value.item()) <= TOL, name
        assert torch.equal(trainer.dead(), theirs.dead_neurons)
    for name, p in ref.named_parameters():
        assert maxdiff(dict(ours.named_parameters())[name], p) <= TOL, name


def test_same_seed_same_init_as_sae_lens():
    torch.manual_seed(7)
    ref = sl.TopKTrainingSAE(sl.TopKTrainingSAEConfig(d_in=C, d_sae=FEATURES, k=4))
    torch.manual_seed(7)
    ours = SAE(SAEConfig(C, FEATURES, kind="topk", k=4))
    for name, p in ref.named_parameters():
        assert maxdiff(dict(ours.named_parameters())[name], p) == 0, name


def test_l1_warm_up_follows_sae_lens_scheduler():
    from sae_lens.training.optim import CoefficientScheduler

    from attnlab.lab.sae import l1_schedule

    cfg = SAEConfig(C, FEATURES, kind="relu", l1_coefficient=2.0, l1_warm_up_steps=4)
    sched = CoefficientScheduler(warm_up_steps=4, final_value=2.0)
    for step in range(7):  # the trainer reads the value, then steps the scheduler
        assert l1_schedule(step, cfg) == pytest.approx(sched.value)
        sched.step()


@pytest.mark.parametrize("kind,cfg", KINDS)
def test_saved_by_attnlab_loads_in_sae_lens_and_back(tmp_path, kind, cfg):
    ref, ours = reference(kind, **cfg)
    x = torch.randn(N, C)
    save_sae(ours, tmp_path / "ours")
    theirs = sl.SAE.load_from_disk(tmp_path / "ours")
    assert maxdiff(theirs(x), ref(x)) <= TOL
    assert maxdiff(theirs.encode(x), ref.encode(x)) <= TOL
    ref.save_inference_model(tmp_path / "ref")
    back = load_sae(tmp_path / "ref")
    assert back.cfg.kind == kind
    assert maxdiff(back(x), ref(x)) <= TOL and maxdiff(back.encode(x), ref.encode(x)) <= TOL
    ref.save_model(tmp_path / "ref_training")  # the training save: other fields, same reading
    assert maxdiff(load_sae(tmp_path / "ref_training")(x), ref(x)) <= TOL


def test_load_rejects_what_it_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="no cfg.json"):
        load_sae(tmp_path)
    sae = save_sae(SAE(SAEConfig(C, FEATURES, kind="relu")), tmp_path / "s")
    text = (sae / "cfg.json").read_text().replace('"standard"', '"jumprelu"')
    (sae / "cfg.json").write_text(text)
    with pytest.raises(ValueError, match="jumprelu"):
        load_sae(sae)


def spliced_model(kind="topk"):
    model = tiny_lm()
    d = model.embed.weight.shape[1]
    torch.manual_seed(3)
    sae = SAE(SAEConfig(d, 4 * d, kind=kind, k=5, hook_name="blocks.1.hook_resid_post"))
    with torch.no_grad():
        sae.b_dec.add_(0.1 * torch.randn(d))
    return model, sae


def test_splice_with_error_term_leaves_the_output_and_caches_sae_points():
    model, sae = spliced_model()
    ids = torch.randint(0, 100, (2, 9))
    clean, cache = run_with_cache(model, ids, names=["blocks.1.hook_resid_post"])
    names = [f"blocks.1.hook_resid_post.hook_sae_{n}" for n in ("input", "acts_post", "recons")]
    names += ["blocks.1.hook_resid_post.hook_sae_error", "blocks.1.hook_resid_post.hook_sae_output"]
    with splice(model, sae):
        out, sae_cache = run_with_cache(model, ids, names=names)
    assert maxdiff(out, clean) <= 1e-5
    x = cache["blocks.1.hook_resid_post"]
    assert maxdiff(sae_cache[names[0]], x) == 0
    ref = copy.deepcopy(sae)
    assert maxdiff(sae_cache[names[2]], ref.decode(ref.encode(x))) <= TOL
    assert maxdiff(sae_cache[names[2]] + sae_cache[names[3]], x) <= 1e-5
    with splice(model, sae, use_error_term=False):
        dropped = model(ids)
    assert maxdiff(dropped, clean) > 1e-3  # without the error term the SAE's loss shows
    assert maxdiff(model(ids), clean) == 0  # and after the block the model is plain again


def test_splice_equals_sae_lens_forward_on_the_same_activations(tmp_path):
    model, sae = spliced_model("relu")
    ids = torch.randint(0, 100, (2, 9))
    _, cache = run_with_cache(model, ids, names=["blocks.1.hook_resid_post"])
    save_sae(sae, tmp_path / "s")
    theirs = sl.SAE.load_from_disk(tmp_path / "s")
    name = "blocks.1.hook_resid_post.hook_sae_output"
    with splice(model, sae, use_error_term=False):
        _, got = run_with_cache(
            model, ids, names=[name, "blocks.1.hook_resid_post.hook_sae_acts_post"]
        )
    x = cache["blocks.1.hook_resid_post"]
    assert maxdiff(got[name], theirs(x)) <= TOL
    assert maxdiff(got["blocks.1.hook_resid_post.hook_sae_acts_post"], theirs.encode(x)) <= TOL


def test_splice_names_a_missing_point():
    model, sae = spliced_model()
    with pytest.raises(ValueError, match="no hook point 'blocks.9.hook_resid_post'"):
        with splice(model, sae, "blocks.9.hook_resid_post"):
            pass


def test_splice_at_a_transformer_lens_name(tmp_path):
    """The SAE at `blocks.1.hook_mlp_out` (TransformerLens' name of attnlab's ffn.hook_out):
    its points take that name, and its features are sae-lens' on the cached activation."""
    model, _ = spliced_model()
    d = model.embed.weight.shape[1]
    torch.manual_seed(4)
    sae = SAE(SAEConfig(d, 2 * d, kind="topk", k=3, hook_name="blocks.1.hook_mlp_out"))
    ids = torch.randint(0, 100, (1, 7))
    clean, cache = run_with_cache(model, ids, names=["blocks.1.hook_mlp_out"])
    theirs = sl.SAE.load_from_disk(save_sae(sae, tmp_path / "s"))
    name = "blocks.1.hook_mlp_out.hook_sae_acts_post"
    with splice(model, sae):
        out, got = run_with_cache(model, ids, names=[name])
    assert maxdiff(out, clean) <= 1e-5
    assert maxdiff(got[name], theirs.encode(cache["blocks.1.hook_mlp_out"])) <= TOL
