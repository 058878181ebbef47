"""Argument checks of `mamba_step` (the C++ kernel says the same in the same words)."""

from __future__ import annotations

import torch

from .._checks import MAX_DSTATE, check_tensor, dtype_name
from ..linear.checks import WEIGHT_DTYPES

F32 = (torch.float32,)


def _check_2d(name: str, t, layout: str, dtypes=F32) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {dtype_name(dtypes)}, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")


def _check_linear(name: str, weight, scale, bias, in_features: int, out: int, device, sizes_from: str) -> None:
    """A projection's weight (out, in_features) in a weight format, its scale (int8 only) and bias."""
    check_tensor(f"{name}_weight", weight, WEIGHT_DTYPES, (out, in_features), device, like="hidden_states",
                 sizes_from=sizes_from)
    if weight.dtype == torch.int8:
        if scale is None:
            raise ValueError(f"an int8 {name}_weight needs {name}_scale, its float32 scale per output feature, "
                             f"shape ({out},)")
        check_tensor(f"{name}_scale", scale, F32, (out,), device, like="hidden_states",
                     sizes_from=f"{name}_weight")
    elif scale is not None:
        raise ValueError(f"{name}_scale is for int8 weights only; {name}_weight has dtype {weight.dtype}")
    if bias is not None:
        check_tensor(f"{name}_bias", bias, F32, (out,), device, like="hidden_states", sizes_from=f"{name}_weight")


def check_mamba_step_inputs(hidden_states, conv_state, ssm_state, in_proj_weight, in_proj_scale, in_proj_bias,
                            conv_weight, conv_bias, x_proj_weight, x_proj_scale, dt_proj_weight, dt_proj_scale,
                            dt_proj_bias, A_log, D, out_proj_weight, out_proj_scale, out_proj_bias) -> tuple:
    """Returns (batch, d_model, d_inner, d_state, d_conv, dt_rank, out_features)."""
    _check_2d("hidden_states", hidden_states, "(batch, d_model)")
    batch, d_model = hidden_states.shape
    device = hidden_states.device
    _check_2d("in_proj_weight", in_proj_weight, "(2 * d_inner, d_model)", WEIGHT_DTYPES)
    if in_proj_weight.shape[0] % 2 or in_proj_weight.shape[0] == 0:
        raise ValueError(f"in_proj_weight must have shape (2 * d_inner, d_model) with d_inner >= 1, got "
                         f"{tuple(in_proj_weight.shape)}")
    d_inner = in_proj_weight.shape[0] // 2
    _check_linear("in_proj", in_proj_weight, in_proj_scale, in_proj_bias, d_model, 2 * d_inner, device,
                  "hidden_states")
    _check_2d("A_log", A_log, "(d_inner, d_state)")
    d_state = A_log.shape[1]
    if not 1 <= d_state <= MAX_DSTATE:
        raise ValueError(f"A_log must have 1 <= d_state <= {MAX_DSTATE}, got d_state={d_state}")
    check_tensor("A_log", A_log, F32, (d_inner, d_state), device, like="hidden_states", sizes_from="in_proj_weight")
    _check_2d("conv_weight", conv_weight, "(d_inner, d_conv)")
    d_conv = conv_weight.shape[1]
    if d_conv < 1:
        raise ValueError(
            f"conv_weight must have shape (d_inner, d_conv) with d_conv >= 1, got {tuple(conv_weight.shape)}")
    check_tensor("conv_weight", conv_weight, F32, (d_inner, d_conv), device, like="hidden_states",
                 sizes_from="in_proj_weight")
    if conv_bias is not None:
        check_tensor("conv_bias", conv_bias, F32, (d_inner,), device, like="hidden_states",
                     sizes_from="in_proj_weight")
    check_tensor("conv_state", conv_state, F32, (batch, d_inner, d_conv), device, like="hidden_states",
                 sizes_from="hidden_states, in_proj_weight and conv_weight")
    check_tensor("ssm_state", ssm_state, F32, (batch, d_inner, d_state), device, like="hidden_states",
                 sizes_from="hidden_states, in_proj_weight and A_log")
    _check_2d("x_proj_weight", x_proj_weight, "(dt_rank + 2 * d_state, d_inner)", WEIGHT_DTYPES)
    dt_rank = x_proj_weight.shape[0] - 2 * d_state
    if dt_rank < 1:
        raise ValueError(f"x_proj_weight must have shape (dt_rank + 2 * d_state, d_inner) with d_state={d_state} "
                         f"and dt_rank >= 1, got {tuple(x_proj_weight.shape)}")
    _check_linear("x_proj", x_proj_weight, x_proj_scale, None, d_inner, dt_rank + 2 * d_state, device,
                  "in_proj_weight and A_log")
    _check_linear("dt_proj", dt_proj_weight, dt_proj_scale, dt_proj_bias, dt_rank, d_inner, device,
                  "in_proj_weight and x_proj_weight")
    if D is not None:
        check_tensor("D", D, F32, (d_inner,), device, like="hidden_states", sizes_from="in_proj_weight")
    _check_2d("out_proj_weight", out_proj_weight, "(out_features, in_features)", WEIGHT_DTYPES)
    out_features = out_proj_weight.shape[0]
    _check_linear("out_proj", out_proj_weight, out_proj_scale, out_proj_bias, d_inner, out_features, device,
                  "in_proj_weight")
    return batch, d_model, d_inner, d_state, d_conv, dt_rank, out_features


# mamba_layers_step's per-layer lists after norm_eps, in order (the optional ones hold None for a layer without)
LAYER_LISTS = ("in_proj_weight", "in_proj_scale", "in_proj_bias", "conv_weight", "conv_bias", "x_proj_weight",
               "x_proj_scale", "dt_proj_weight", "dt_proj_scale", "dt_proj_bias", "A_log", "D", "out_proj_weight",
               "out_proj_scale", "out_proj_bias")


def split_final_norm(lists_and_final: tuple) -> tuple[tuple, torch.Tensor | None]:
    """mamba_layers_step's arguments after norm_eps: (the per-layer lists, final_norm_weight or None)."""
    n = len(LAYER_LISTS)
    return lists_and_final[:n], lists_and_final[n] if len(lists_and_final) > n else None


def layer_arguments(conv_states, ssm_states, lists) -> list[list]:
    """mamba_layers_step's per-layer lists, as each layer's mamba_step arguments after hidden_states
    (conv_state, ssm_state, in_proj_weight, in_proj_scale, ...)."""
    return [[conv_states[i], ssm_states[i], *(lst[i] for lst in lists)] for i in range(len(conv_states))]


def check_mamba_layers_step_inputs(hidden_states, residual, conv_states, ssm_states, norm_weight, norm_eps,
                                   *lists_and_final) -> tuple[int, int]:
    """Returns (batch, d_model). A layer's mixer is checked as mamba_step's arguments are, its
    messages opened by the layer's index."""
    lists, final_norm_weight = split_final_norm(lists_and_final)
    _check_2d("hidden_states", hidden_states, "(batch, d_model)")
    batch, d_model = hidden_states.shape
    device = hidden_states.device
    if residual is not None:
        check_tensor("residual", residual, F32, (batch, d_model), device, like="hidden_states",
                     sizes_from="hidden_states")
    if final_norm_weight is not None:
        check_tensor("final_norm_weight", final_norm_weight, F32, (d_model,), device, like="hidden_states",
                     sizes_from="hidden_states")
    layers = len(norm_weight)
    if layers == 0:
        raise ValueError("norm_weight must hold one tensor per layer, at least one, got none")
    named = [("conv_states", conv_states), ("ssm_states", ssm_states), *zip(LAYER_LISTS, lists, strict=True)]
    for name, lst in named:
        if len(lst) != layers:
            raise ValueError(f"{name} must hold one entry per layer ({layers}), got {len(lst)}")
    for i, args in enumerate(layer_arguments(conv_states, ssm_states, lists)):
        try:
            check_tensor("norm_weight", norm_weight[i], F32, (d_model,), device, like="hidden_states",
                         sizes_from="hidden_states")
            out_features = check_mamba_step_inputs(hidden_states, *args)[-1]
            if out_features != d_model:
                raise ValueError(f"out_proj_weight must have d_model={d_model} output features (the next layer's "
                                 f"input), got shape {tuple(args[-3].shape)}")
        except (TypeError, ValueError) as err:
            raise type(err)(f"layer {i}: {err}") from None
    return batch, d_model
