"""Images as tokens: the ViT patch embedding (Dosovitskiy et al. 2021, arXiv:2010.11929, §3.1).

An image is cut into non-overlapping P x P patches, read row by row; each patch becomes one token:

    image (B, 3, 32, 32), P = 8            tokens (B, N, C), N = (32 / 8)^2 = 16
    ┌──┬──┬──┬──┐
    │ 0│ 1│ 2│ 3│  each patch: 3*8*8 = 192   [cls] + [p0 p1 ... p15] + positions
    ├──┼──┼──┼──┤  numbers -> Linear -> C
    │ 4│ 5│ ...  │
    └──┴──┴──┴──┘

Two ways to patchify compute the same function: "linear" reshapes the patches and applies one
Linear (the paper's equation 1); "conv" is a Conv2d with kernel = stride = P (what most code does,
as it needs no reshaping). With `linear.weight = conv.weight.flatten(1)` they agree exactly.

Positions are added per patch: "learned" (the paper: one trained vector per token, class token
included) or "sinusoidal_2d" (fixed; half the channels encode the row and half the column, as in
MAE, He et al. 2022), the class token getting position zero.

Shapes: B batch, H/W image height/width, P patch_size, N patches, C d_model.
"""

from typing import Literal

import torch
from torch import Tensor, nn

from attnlab.components.positions.learned import LearnedPosition
from attnlab.components.positions.sinusoidal import sinusoidal_table

Patchify = Literal["conv", "linear"]
PatchPosition = Literal["learned", "sinusoidal_2d", "none"]
PATCHIFY = ("conv", "linear")
PATCH_POSITIONS = ("learned", "sinusoidal_2d", "none")


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """Cut images into non-overlapping patches, row-major, each flattened channel-first.

    Args:
        images: (B, C_in, H, W) with H and W multiples of patch_size.
        patch_size: P.

    Returns:
        (B, N, C_in * P * P), N = (H / P) * (W / P); a patch's numbers are ordered (C_in, P, P),
        the layout of a Conv2d weight, so `linear.weight = conv.weight.flatten(1)` matches.
    """
    B, C_in, H, W = images.shape
    P = patch_size
    x = images.view(B, C_in, H // P, P, W // P, P)  # (B, C_in, rows, P, cols, P)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, rows, cols, C_in, P, P)
    return x.reshape(B, (H // P) * (W // P), C_in * P * P)  # (B, N, C_in*P*P)


def sinusoidal_2d_table(rows: int, cols: int, d_model: int) -> Tensor:
    """Fixed 2-D positions: the first half of the channels is the row's 1-D sinusoidal encoding,
    the second half the column's (He et al. 2022, MAE; Chen et al. 2021, MoCo v3).

    Returns:
        (rows * cols, C) float32, row-major like `patchify`.
    """
    if d_model < 2:
        raise ValueError(f"a 2-D sinusoidal table needs d_model >= 2, got {d_model}")
    half = d_model // 2
    row = sinusoidal_table(rows, half)  # (rows, C/2)
    col = sinusoidal_table(cols, d_model - half)  # (cols, C - C/2)
    row = row[:, None, :].expand(rows, cols, half)  # (rows, cols, C/2)
    col = col[None, :, :].expand(rows, cols, d_model - half)  # (rows, cols, C - C/2)
    return torch.cat([row, col], dim=-1).reshape(rows * cols, d_model)  # (N, C)


class PatchEmbedding(nn.Module):
    """Image -> patch tokens with positions, optionally behind a class token (ViT §3.1).

    Args:
        image_size: side of the (square) input images, a multiple of patch_size.
        patch_size: P, the side of one patch.
        in_channels: C_in, e.g. 3 for RGB.
        d_model: C, the token width.
        patchify: "conv" (Conv2d, kernel = stride = P) or "linear" (reshape + Linear).
        position: "learned", "sinusoidal_2d" or "none".
        cls_token: prepend a trained class token (ViT's [class]; not needed for VQA/VLA here).
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_channels: int,
        d_model: int,
        patchify: Patchify = "conv",
        position: PatchPosition = "learned",
        cls_token: bool = False,
    ):
        super().__init__()
        check_patch_geometry(image_size, patch_size, in_channels)
        if patchify not in PATCHIFY:
            raise ValueError(f"unknown patchify {patchify!r}; choose from {list(PATCHIFY)}")
        if position not in PATCH_POSITIONS:
            raise ValueError(
                f"unknown patch position {position!r}; choose from {list(PATCH_POSITIONS)}"
            )
        self.image_size, self.patch_size, self.in_channels = image_size, patch_size, in_channels
        self.grid = image_size // patch_size  # patches per side
        self.n_patches = self.grid**2
        self.n_tokens = self.n_patches + int(cls_token)
        if patchify == "conv":
            self.proj = nn.Conv2d(in_channels, d_model, kernel_size=patch_size, stride=patch_size)
        else:
            self.proj = nn.Linear(in_channels * patch_size**2, d_model)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model)) if cls_token else None
        self.learned = LearnedPosition(self.n_tokens, d_model) if position == "learned" else None
        # Computed, not learned: built on the CPU even inside a meta-device build (as in
        # models/build.py), so a model whose weights are assigned later has nothing to recompute.
        with torch.device("cpu"):
            table = torch.zeros(self.n_tokens, d_model)  # (N[+1], C); the class token's row: 0
            if position == "sinusoidal_2d":
                table[int(cls_token) :] = sinusoidal_2d_table(self.grid, self.grid, d_model)
        # Non-persistent: a pure function of the geometry, so checkpoints never hold a copy.
        self.register_buffer("fixed", table, persistent=False)

    def forward(self, images: Tensor) -> Tensor:
        """Patch tokens of `images`.

        Args:
            images: (B, C_in, H, W) float, H = W = image_size.

        Returns:
            (B, N, C), or (B, 1 + N, C) with the class token first.
        """
        self.check_images(images)
        if isinstance(self.proj, nn.Conv2d):
            x = self.proj(images)  # (B, C, H/P, W/P)
            x = x.flatten(2).transpose(1, 2)  # (B, N, C), row-major
        else:
            x = self.proj(patchify(images, self.patch_size))  # (B, N, C)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1+N, C)
        if self.learned is not None:
            x = self.learned.embed(x, torch.arange(self.n_tokens, device=x.device))
        return x + self.fixed.to(x.dtype)  # (B, N[+1], C)

    def check_images(self, images: Tensor) -> None:
        """ValueError unless images are (B, in_channels, image_size, image_size) floats."""
        if images.dim() != 4:
            raise ValueError(f"images must be (B, C, H, W), got shape {tuple(images.shape)}")
        _, C_in, H, W = images.shape
        if C_in != self.in_channels:
            raise ValueError(
                f"images have {C_in} channels but the patch embedding expects "
                f"in_channels={self.in_channels}"
            )
        if (H, W) != (self.image_size, self.image_size):
            raise ValueError(
                f"images are {H}x{W} but the patch embedding was built for "
                f"{self.image_size}x{self.image_size} (its positions are fixed)"
            )
        if not images.is_floating_point():
            raise ValueError(f"images must be floating point, got dtype {images.dtype}")


def check_patch_geometry(image_size: int, patch_size: int, in_channels: int) -> None:
    """ValueError naming the values unless the image tiles exactly into patches."""
    if image_size < 1 or patch_size < 1 or in_channels < 1:
        raise ValueError(
            f"image_size={image_size}, patch_size={patch_size} and "
            f"in_channels={in_channels} must all be >= 1"
        )
    if image_size % patch_size:
        raise ValueError(f"image_size={image_size} is not divisible by patch_size={patch_size}")
