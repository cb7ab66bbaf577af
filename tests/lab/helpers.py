"""Shared by the lab tests: a sublayer that contributes nothing, and a tiny seeded LM."""

from dataclasses import replace

import torch
from torch import nn

from attnlab.models.build import build_model
from attnlab.models.presets import get_preset


class Zero(nn.Module):
    """A sublayer that contributes nothing: the reference for a sublayer taken out."""

    def forward(self, x, *args):
        return torch.zeros_like(x)


def tiny_lm(preset: str = "llama-tiny", **changes) -> nn.Module:
    torch.manual_seed(0)
    return build_model(replace(get_preset(preset), **changes)).eval()
