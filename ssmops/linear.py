"""`weight_only_linear`: the decoding projection's front end, on the ssmops operator."""

from __future__ import annotations

from torch import Tensor

from ._registry import operator_for
from .ops._checks import checked_call
from .ops.linear.checks import check_linear_inputs


def weight_only_linear(x: Tensor, weight: Tensor, weight_scale: Tensor | None = None,
                       bias: Tensor | None = None) -> Tensor:
    """y = x @ (weight * weight_scale[:, None]).T + bias, in x's dtype, accumulated in float32.

    x: (..., in_features) float32/float16/bfloat16; weight: (out_features, in_features) float32,
    bfloat16, float16 or int8; weight_scale: (out_features,) float32, for int8 weights only;
    bias: (out_features,) float32 or x's dtype. Inference only (no autograd)."""
    inputs = (x, weight, weight_scale, bias)
    return checked_call(lambda: operator_for("weight_only_linear", x)(*inputs), lambda: check_linear_inputs(*inputs))
