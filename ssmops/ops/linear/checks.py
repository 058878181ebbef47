"""Argument checks of `weight_only_linear` (the C++ kernel says the same in the same words)."""

from __future__ import annotations

import torch

from .._checks import INPUT_DTYPES, check_tensor, dtype_name

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


def check_linear_inputs(x, weight, weight_scale, bias) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must have dtype {dtype_name(INPUT_DTYPES)}, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"x must have shape (..., in_features), got {tuple(x.shape)}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a Tensor, got {type(weight).__name__}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"weight must have dtype {dtype_name(WEIGHT_DTYPES)}, got {weight.dtype}")
    in_features = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(
            f"weight must have shape (out_features, in_features) with in_features={in_features} (x's last size), "
            f"got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on {x.device} like x, got {weight.device}")
    out_features = weight.shape[0]
    if weight.dtype == torch.int8:
        if weight_scale is None:
            raise ValueError(
                f"an int8 weight needs weight_scale, its float32 scale per output feature, shape ({out_features},)")
        check_tensor("weight_scale", weight_scale, (torch.float32,), (out_features,), x.device, like="x",
                     sizes_from="weight")
    elif weight_scale is not None:
        raise ValueError(f"weight_scale is for int8 weights only; weight has dtype {weight.dtype}")
    if bias is not None:
        check_tensor("bias", bias, tuple(dict.fromkeys((torch.float32, x.dtype))), (out_features,), x.device,
                     like="x", sizes_from="weight")
