"""Vision-language models: the prefix-LM mask cell by cell, both ways of joining image and text,
cached decoding, config errors, and a checkpoint round trip."""

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.checkpoint import open_checkpoint, save_checkpoint
from attnlab.components.masks import prefix_lm_mask
from attnlab.configs import from_dict, to_dict
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig, VisionConfig
from attnlab.models.presets import VISION_PRESETS, get_preset
from attnlab.models.vision import PrefixVisionLM, VisionEncoderDecoder
from attnlab.training.config import RunConfig

B, T, V = 2, 6, 40


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: on a busy machine, threads spinning against each other make these tiny
    forward passes a thousand times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small(connect: str, **vision) -> ModelConfig:
    cfg = get_preset("vqa-tiny")
    vis = replace(cfg.vision, connect=connect, **vision)
    return replace(cfg, d_model=32, vocab_size=V, d_ff=64, vision=vis)


def inputs(cfg: ModelConfig):
    side = cfg.vision.image_size
    return torch.rand(B, 3, side, side), torch.randint(0, V, (B, T))


def prefix_allowed(q: int, k: int, n_prefix: int) -> bool:
    """The prefix-LM rule, written independently: keys in the prefix are always visible; a key
    after it is visible only from the same or a later position."""
    if k < n_prefix:
        return True
    return k <= q


# --- the prefix mask, cell by cell ---------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n_image=st.integers(0, 9), n_text=st.integers(0, 9))
def test_prefix_mask_cell_by_cell(n_image, n_text):
    L = n_image + n_text
    if L == 0:
        return
    mask = prefix_lm_mask(L, n_image)
    assert mask.shape == (L, L) and mask.dtype == torch.bool
    for q in range(L):
        for k in range(L):
            assert bool(mask[q, k]) == prefix_allowed(q, k, n_image), (q, k)


def test_prefix_mask_in_words():
    """Image tokens see each other fully; text sees every image token and the text before it."""
    N, L = 3, 6
    mask = prefix_lm_mask(L, N)
    assert mask[:N, :N].all()  # image <-> image, both ways
    assert not mask[:N, N:].any()  # an image token never sees the text
    assert mask[N:, :N].all()  # text -> every image token
    assert torch.equal(mask[N:, N:], torch.ones(L - N, L - N).tril().bool())  # causal text


def test_prefix_mask_per_row_lengths_cell_by_cell():
    lengths = torch.tensor([0, 2, 5])
    mask = prefix_lm_mask(5, lengths)  # (3, 1, 5, 5)
    assert mask.shape == (3, 1, 5, 5)
    for b, n in enumerate(lengths.tolist()):
        for q in range(5):
            for k in range(5):
                assert bool(mask[b, 0, q, k]) == prefix_allowed(q, k, n)


# --- the two models ----------------------------------------------------------------------------
@pytest.mark.parametrize("connect", ["cross_attention", "prefix"])
def test_forward_shapes_and_model_class(connect):
    cfg = small(connect)
    model = build_model(cfg).eval()
    expected = VisionEncoderDecoder if connect == "cross_attention" else PrefixVisionLM
    assert isinstance(model, expected)
    images, ids = inputs(cfg)
    logits = model(images, ids)
    assert logits.shape == (B, T, V) and torch.isfinite(logits).all()


def test_cross_attention_blocks_read_the_image_features():
    model = build_model(small("cross_attention", n_layers=2))
    assert all(block.cross_attn is not None for block in model.decoder.blocks)
    assert len(model.encoder.blocks) == 2  # EncoderBlocks of the ViT
    assert all(block.cross_attn is None for block in model.encoder.blocks)


@pytest.mark.parametrize("connect", ["cross_attention", "prefix"])
def test_text_is_causal_and_sees_the_image(connect):
    cfg = small(connect)
    model = build_model(cfg).eval()
    images, ids = inputs(cfg)
    with torch.no_grad():
        base = model(images, ids)
        later = ids.clone()
        later[:, 4:] = (later[:, 4:] + 1) % V
        changed_future = model(images, later)
        other_image = model(torch.rand_like(images), ids)
    torch.testing.assert_close(changed_future[:, :4], base[:, :4])  # the past ignores the future
    assert not torch.allclose(changed_future[:, 4:], base[:, 4:])
    assert (other_image - base).abs().amax(-1).min() > 0  # every text position sees the image


def test_prefix_image_tokens_see_each_other_but_not_the_text():
    cfg = small("prefix")
    model = build_model(cfg).eval()
    images, ids = inputs(cfg)
    N = cfg.vision.n_tokens
    with torch.no_grad():
        hidden = model(images, ids, return_hidden=True)  # (B, N + T, C)
        other_text = model(images, (ids + 1) % V, return_hidden=True)
        bottom_half = images.clone()
        bottom_half[..., 16:, :] = torch.rand_like(bottom_half[..., 16:, :])
        other_bottom = model(bottom_half, ids, return_hidden=True)
    torch.testing.assert_close(other_text[:, :N], hidden[:, :N])  # image tokens ignore the text
    # Top-row patches change when only the bottom of the image changes: bidirectional prefix.
    assert (other_bottom[:, :4] - hidden[:, :4]).abs().amax() > 1e-4


def test_prefix_padding_mask_hides_padded_text():
    cfg = small("prefix")
    model = build_model(cfg).eval()
    images, ids = inputs(cfg)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, 4:] = False
    padded = ids.clone()
    padded[:, 4:] = 0
    with torch.no_grad():
        a = model(images, ids, mask)[:, :4]
        b = model(images, padded, mask)[:, :4]
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("patchify", ["conv", "linear"])
@pytest.mark.parametrize("position", ["learned", "sinusoidal_2d"])
def test_vision_variants_build(patchify, position):
    cfg = small("prefix", patchify=patchify, position=position, cls_token=True, n_layers=0)
    model = build_model(cfg).eval()
    assert len(model.encoder.blocks) == 0  # Fuyu-style: patch embeddings straight in
    images, ids = inputs(cfg)
    assert model(images, ids).shape == (B, T, V)


@torch.no_grad()
def greedy_recompute(model, images, prompt: list[int], n: int, eos: int) -> list[int]:
    """The reference: greedy tokens for one image, each from a full forward without a cache."""
    ids = torch.tensor([prompt])  # (1, T0)
    for _ in range(n):
        token = model(images, ids)[:, -1].argmax(-1)  # (1,)
        ids = torch.cat([ids, token[:, None]], dim=1)
        if int(token) == eos:
            break
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("connect", ["cross_attention", "prefix"])
def test_cached_generate_equals_greedy_recompute(connect):
    """Both vision-language models answer through the library's KV-cached `generate`: the image
    as the source (cross-attention) or prefilled before the prompt (prefix), prompts of
    different lengths left-padded together, each row as the full forward gives it alone."""
    cfg = small(connect)
    model = build_model(cfg).eval()
    images, ids = inputs(cfg)
    prompts = [ids[0].tolist(), ids[1, 2:].tolist()]
    eos = V - 1
    greedy = SamplingConfig(temperature=0.0)
    cached = generate(model, prompts, GenerationConfig(5, greedy, stop_tokens=[eos]), source=images)
    expected = [
        greedy_recompute(model, images[b : b + 1], p, 5, eos) for b, p in enumerate(prompts)
    ]
    assert cached == expected


@pytest.mark.parametrize("connect", ["cross_attention", "prefix"])
def test_generate_stops_a_row_at_its_eos(connect):
    cfg = small(connect)
    model = build_model(cfg).eval()
    images, ids = inputs(cfg)
    with torch.no_grad():
        first = model(images, ids)[:, -1].argmax(-1)  # (B,)
    greedy = SamplingConfig(temperature=0.0)
    rows = generate(
        model, ids.tolist(), GenerationConfig(4, greedy, stop_tokens=[int(first[0])]), source=images
    )
    assert rows[0] == [int(first[0])]  # row 0 ends at once with its <eos>
    assert rows[1] == greedy_recompute(model, images[1:], ids[1].tolist(), 4, int(first[0]))


def test_a_prefix_model_does_not_crop_its_context():
    cfg = small("prefix")
    model = build_model(cfg).eval()
    images, ids = inputs(cfg)
    room = cfg.max_seq_len - cfg.vision.n_tokens - T
    with pytest.raises(ValueError, match="image-prefix model, which cannot crop"):
        generate(model, ids.tolist(), GenerationConfig(room + 1), source=images)


# --- configs -------------------------------------------------------------------------------------
def test_vision_presets_round_trip_and_build():
    for name in VISION_PRESETS:
        cfg = get_preset(name)
        assert from_dict(ModelConfig, to_dict(cfg)) == cfg
        assert cfg.arch == "vlm"


def test_config_errors_name_the_values():
    base = get_preset("vqa-tiny")
    with pytest.raises(ValueError, match=r"arch='vlm' with vision=None"):
        replace(base, vision=None)
    with pytest.raises(ValueError, match=r"arch='decoder'.*only a 'vlm' model takes one"):
        replace(base, arch="decoder")
    with pytest.raises(ValueError, match=r"image_size=28 is not divisible by patch_size=8"):
        VisionConfig(image_size=28)
    with pytest.raises(ValueError, match=r"16 image tokens .* max_seq_len=16"):
        replace(base, max_seq_len=16, vision=replace(base.vision, connect="prefix"))
    with pytest.raises(ValueError, match=r"vision.n_layers must be >= 0, got -1"):
        VisionConfig(n_layers=-1)


def test_images_of_the_wrong_size_or_channels():
    cfg = small("cross_attention")
    model = build_model(cfg)
    ids = torch.randint(0, V, (B, T))
    with pytest.raises(ValueError, match=r"images have 1 channels .* in_channels=3"):
        model(torch.rand(B, 1, 32, 32), ids)
    with pytest.raises(ValueError, match=r"images are 16x16 .* 32x32"):
        model(torch.rand(B, 3, 16, 16), ids)


def test_checkpoint_round_trip_on_meta(tmp_path):
    """open_checkpoint builds a vlm on the meta device; positions and outputs come back equal."""
    cfg = small("prefix", position="sinusoidal_2d")
    model = build_model(cfg).eval()
    save_checkpoint(tmp_path / "ckpt", model, None, RunConfig(cfg), {"step": 0})
    opened = open_checkpoint(tmp_path / "ckpt")
    loaded, saved = opened.model, opened.run
    assert saved["model"]["vision"]["connect"] == "prefix"
    images, ids = inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images, ids), model(images, ids))
