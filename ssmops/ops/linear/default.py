"""`weight_only_linear` in pure PyTorch, any device: the `default` backend's kernel. The weight is
widened to x's compute dtype and `torch.nn.functional.linear` does the work; an int8 weight's
scale is applied to the output (out_features values instead of a whole scaled weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_linear_inputs


def weight_only_linear(x, weight, weight_scale, bias):
    check_linear_inputs(x, weight, weight_scale, bias)
    compute = torch.float32 if x.dtype != weight.dtype else x.dtype
    y = F.linear(x.to(compute), weight.to(compute))
    if weight_scale is not None:
        y = y * weight_scale
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)
