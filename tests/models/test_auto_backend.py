"""attention.backend "auto": sdpa, except that a layer whose call carries a score_mod or a
BlockMask runs flex; an ALiBi / T5 model gives its bias as a score_mod for long query blocks and
as a tensor for decode steps. Checked against the eager backend, with spies on the backends table
to see which function ran."""

from collections import Counter
from dataclasses import replace

import pytest
import torch

from attnlab.components import backends
from attnlab.components.flex import block_mask
from attnlab.components.kv_cache import ModelCache
from attnlab.components.positions import ALiBi
from attnlab.components.positions.base import AUTO_MIN_SCORES, wants_score_mod
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig

pytestmark = pytest.mark.filterwarnings("error:flex_attention called without torch.compile")
B, H, D = 2, 4, 8


@pytest.fixture
def ran(monkeypatch) -> Counter:
    """Which of the flex and sdpa backends ran, and how often (they still compute)."""
    calls = Counter()
    for name in ("flex", "sdpa"):
        real = backends.BACKENDS[name]

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setitem(backends.BACKENDS, name, spy)
    return calls


def decoder(backend: str, position: str = "alibi", max_seq_len: int = 160):
    cfg = ModelConfig(
        arch="decoder",
        d_model=H * D,
        n_layers=2,
        vocab_size=50,
        max_seq_len=max_seq_len,
        attention=AttentionConfig(n_heads=H, backend=backend),
        position=position,
        norm="layernorm",
    )
    return build_model(cfg).eval()


def test_the_form_follows_the_shapes():
    assert wants_score_mod(128, 128) and wants_score_mod(2, AUTO_MIN_SCORES // 2)
    assert not wants_score_mod(1, 10**6)  # a decode step keeps the tensor, whatever S
    assert not wants_score_mod(37, 37)  # short: less than one flex block of scores
    alibi = ALiBi(H)
    alibi.bias_form = "auto"
    assert callable(alibi.prepare(torch.arange(130), torch.arange(130)).bias)
    step = alibi.prepare(torch.tensor([[129]]), torch.arange(130)[None]).bias
    assert isinstance(step, torch.Tensor) and step.shape == (1, H, 1, 130)


@pytest.mark.slow
def test_auto_dispatches_on_the_form_of_the_terms(ran):
    """Tensors go to sdpa, a score_mod or a BlockMask to flex; all give eager's numbers."""
    torch.manual_seed(0)
    T = 24
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    alibi = ALiBi(H)
    pos = torch.arange(T)
    want, _ = backends.eager_attention(q, k, v, bias=alibi.score_bias(pos, pos), is_causal=True)
    out, _ = backends.auto_attention(q, k, v, bias=alibi.score_bias(pos, pos), is_causal=True)
    assert ran == {"sdpa": 1}
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    out, _ = backends.auto_attention(q, k, v, bias=alibi.score_mod(pos, pos), is_causal=True)
    assert ran == {"sdpa": 1, "flex": 1}
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    causal = block_mask(lambda b, h, i, j: j <= i, None, None, T, T)
    out, _ = backends.auto_attention(q, k, v, mask=causal)
    assert ran == {"sdpa": 1, "flex": 2}
    torch.testing.assert_close(out, backends.eager_attention(q, k, v, is_causal=True)[0])


def test_auto_sets_the_schemes_bias_form():
    assert decoder("auto").positions.bias_form == "auto"
    assert decoder("sdpa").positions.bias_form == "tensor"
    assert decoder("flex").positions.bias_form == "score_mod"


@pytest.mark.slow
@pytest.mark.parametrize("position", ["alibi", "t5_bias"])
def test_auto_decoder_equals_eager_long_prefill_on_flex_decode_step_on_sdpa(position, ran):
    torch.manual_seed(0)
    eager = decoder("eager", position)
    auto = decoder("auto", position)
    auto.load_state_dict(eager.state_dict())
    T0 = 130  # 130 x 130 scores: over one flex block, and not a multiple of its 128
    ids = torch.randint(0, 50, (B, T0 + 1))
    valid = torch.ones(B, T0 + 1, dtype=torch.bool)
    with torch.no_grad():
        caches = [ModelCache.for_decoder(m, valid) for m in (eager, auto)]
        slots = torch.arange(T0)
        want = eager(ids[:, :T0], cache=caches[0], slots=slots)
        got = auto(ids[:, :T0], cache=caches[1], slots=slots)  # prefill: long, flex
        assert ran == {"flex": 2}  # one call per layer
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        step = torch.tensor([T0])
        want = eager(ids[:, T0:], cache=caches[0], slots=step)
        got = auto(ids[:, T0:], cache=caches[1], slots=step)  # decode step: T = 1, sdpa
        assert ran == {"flex": 2, "sdpa": 2}
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # and the same model without a cache, short and long
        ran.clear()
        for T, backend in ((20, "sdpa"), (T0, "flex")):
            torch.testing.assert_close(auto(ids[:, :T]), eager(ids[:, :T]), atol=1e-5, rtol=0)
            assert ran == {backend: 2}
            ran.clear()


def test_rope_model_on_auto_stays_on_sdpa(ran):
    torch.manual_seed(0)
    eager, auto = decoder("eager", "rope"), decoder("auto", "rope")
    auto.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 50, (B, 140))
    with torch.no_grad():
        torch.testing.assert_close(auto(ids), eager(ids), atol=1e-5, rtol=0)
    assert ran == {"sdpa": 2}


def test_auto_is_opt_in():
    assert AttentionConfig().backend == "sdpa"
    with pytest.raises(ValueError, match="backend"):
        replace(AttentionConfig(), backend="fastest")
