"""ViT patch embedding: shapes of every variant, conv == linear patchify, positions, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.components.positions.sinusoidal import sinusoidal_table
from attnlab.components.vision import (
    PATCH_POSITIONS,
    PATCHIFY,
    PatchEmbedding,
    patchify,
    sinusoidal_2d_table,
)


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: on a busy machine, threads spinning against each other make these tiny
    forward passes a thousand times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cls_token", [False, True])
@pytest.mark.parametrize("position", PATCH_POSITIONS)
@pytest.mark.parametrize("kind", PATCHIFY)
def test_output_shape_every_variant(kind, position, cls_token):
    emb = PatchEmbedding(32, 8, 3, 24, kind, position, cls_token)
    out = emb(torch.rand(2, 3, 32, 32))
    assert out.shape == (2, 16 + cls_token, 24)
    assert (emb.grid, emb.n_patches, emb.n_tokens) == (4, 16, 16 + cls_token)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@settings(max_examples=25, deadline=None)
@given(
    grid=st.integers(1, 5),
    patch=st.integers(1, 6),
    channels=st.integers(1, 4),
    B=st.integers(1, 3),
)
def test_patchify_reads_row_major_crops(grid, patch, channels, B):
    side = grid * patch
    images = torch.randn(B, channels, side, side)
    patches = patchify(images, patch)  # (B, N, C_in*P*P)
    assert patches.shape == (B, grid * grid, channels * patch * patch)
    for n in range(grid * grid):
        r, c = divmod(n, grid)
        crop = images[:, :, r * patch : (r + 1) * patch, c * patch : (c + 1) * patch]
        torch.testing.assert_close(patches[:, n], crop.reshape(B, -1), rtol=0, atol=0)


@pytest.mark.parametrize("cls_token", [False, True])
def test_conv_and_linear_patchify_compute_the_same_function(cls_token):
    conv = PatchEmbedding(16, 4, 3, 12, "conv", "sinusoidal_2d", cls_token)
    linear = PatchEmbedding(16, 4, 3, 12, "linear", "sinusoidal_2d", cls_token)
    with torch.no_grad():
        linear.proj.weight.copy_(conv.proj.weight.flatten(1))  # (C, C_in*P*P)
        linear.proj.bias.copy_(conv.proj.bias)
        if cls_token:
            linear.cls.copy_(conv.cls)
    images = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(linear(images), conv(images), rtol=1e-5, atol=1e-5)


def _zero_projection(emb: PatchEmbedding) -> PatchEmbedding:
    """With the projection zeroed, the output is the positions alone."""
    with torch.no_grad():
        emb.proj.weight.zero_()
        emb.proj.bias.zero_()
    return emb


def test_sinusoidal_2d_positions_rows_and_columns():
    C, G = 16, 4
    emb = _zero_projection(PatchEmbedding(4 * G, 4, 3, C, position="sinusoidal_2d"))
    pos = emb(torch.rand(1, 3, 4 * G, 4 * G))[0].view(G, G, C)  # (row, col, C)
    rows, cols = sinusoidal_table(G, C // 2), sinusoidal_table(G, C // 2)
    for r in range(G):
        for c in range(G):
            torch.testing.assert_close(pos[r, c, : C // 2], rows[r])  # first half: the row
            torch.testing.assert_close(pos[r, c, C // 2 :], cols[c])  # second half: the column
    assert len({tuple(v.tolist()) for v in pos.reshape(G * G, C)}) == G * G  # all distinct


def test_sinusoidal_2d_table_odd_width_and_class_token_at_zero():
    assert sinusoidal_2d_table(3, 2, 7).shape == (6, 7)
    emb = _zero_projection(PatchEmbedding(8, 4, 1, 6, position="sinusoidal_2d", cls_token=True))
    with torch.no_grad():
        emb.cls.fill_(0.5)
    out = emb(torch.rand(1, 1, 8, 8))[0]  # (1 + 4, C)
    torch.testing.assert_close(out[0], torch.full((6,), 0.5))  # class token: no position added
    torch.testing.assert_close(out[1:], sinusoidal_2d_table(2, 2, 6))
    with pytest.raises(ValueError, match="d_model >= 2"):
        sinusoidal_2d_table(2, 2, 1)


def test_learned_positions_are_the_table_rows():
    emb = _zero_projection(PatchEmbedding(8, 4, 3, 10, position="learned", cls_token=True))
    out = emb(torch.rand(2, 3, 8, 8))  # (2, 5, C)
    table = emb.learned.table.weight  # (5, C): class token first, then patches row-major
    assert table.shape == (5, 10)
    torch.testing.assert_close(out[0, 1:], table[1:])
    torch.testing.assert_close(out[0, 0], table[0] + emb.cls[0, 0])


def test_no_positions_make_patches_permutation_equivariant():
    emb = PatchEmbedding(8, 4, 3, 10, position="none")
    images = torch.rand(1, 3, 8, 8)
    swapped = images.clone()
    swapped[..., :4, :4], swapped[..., :4, 4:] = images[..., :4, 4:], images[..., :4, :4]
    out, out_swapped = emb(images), emb(swapped)
    torch.testing.assert_close(out_swapped[0, [1, 0, 2, 3]], out[0])


def test_positions_are_not_saved_but_survive_a_meta_build():
    emb = PatchEmbedding(8, 4, 3, 10, position="sinusoidal_2d")
    assert "fixed" not in emb.state_dict()
    with torch.device("meta"):
        meta = PatchEmbedding(8, 4, 3, 10, position="sinusoidal_2d")
    assert meta.fixed.device.type == "cpu"  # computed on the CPU, never left on meta
    torch.testing.assert_close(meta.fixed, emb.fixed)


# --- bad input ---------------------------------------------------------------------------------
def test_image_size_not_divisible_by_patch_size():
    with pytest.raises(ValueError, match=r"image_size=30 is not divisible by patch_size=8"):
        PatchEmbedding(30, 8, 3, 16)


def test_channel_mismatch_names_both():
    emb = PatchEmbedding(32, 8, 3, 16)
    with pytest.raises(ValueError, match=r"images have 1 channels .* in_channels=3"):
        emb(torch.rand(2, 1, 32, 32))


def test_wrong_image_size_and_rank_and_dtype():
    emb = PatchEmbedding(32, 8, 3, 16)
    with pytest.raises(ValueError, match=r"images are 24x24 .* built for 32x32"):
        emb(torch.rand(2, 3, 24, 24))
    with pytest.raises(ValueError, match=r"\(B, C, H, W\), got shape \(3, 32, 32\)"):
        emb(torch.rand(3, 32, 32))
    with pytest.raises(ValueError, match="floating point"):
        emb(torch.zeros(1, 3, 32, 32, dtype=torch.uint8))


def test_unknown_variants_and_bad_sizes():
    with pytest.raises(ValueError, match=r"unknown patchify 'unfold'"):
        PatchEmbedding(32, 8, 3, 16, patchify="unfold")
    with pytest.raises(ValueError, match=r"unknown patch position 'rope'"):
        PatchEmbedding(32, 8, 3, 16, position="rope")
    with pytest.raises(ValueError, match=r"in_channels=0 must all be >= 1"):
        PatchEmbedding(32, 8, 0, 16)
