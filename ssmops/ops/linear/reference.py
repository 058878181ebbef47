"""`weight_only_linear` in plain PyTorch: the executable form of its contract (docs/design.md),
y = x @ (weight * weight_scale[:, None]).T + bias in float32 (float64 for float64 tests),
returned in x's dtype. Every backend is tested against it."""

from __future__ import annotations

from torch import Tensor


def weight_only_linear_ref(x: Tensor, weight: Tensor, weight_scale: Tensor | None = None,
                           bias: Tensor | None = None) -> Tensor:
    w = weight.double()
    if weight_scale is not None:
        w = w * weight_scale.double()[:, None]
    y = x.double() @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
