"""`mamba_step` and `mamba_layers_step` in pure PyTorch, any device: the `default` backend's kernels,
the mixer's step as the `default` kernels of the operators it fuses."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..causal_conv1d.default import causal_conv1d_update
from ..linear.default import weight_only_linear
from ..state_update.default import selective_state_update
from .checks import check_mamba_layers_step_inputs, check_mamba_step_inputs, layer_arguments, split_final_norm


def mamba_step(hidden_states, conv_state, ssm_state, in_proj_weight, in_proj_scale, in_proj_bias, conv_weight,
               conv_bias, x_proj_weight, x_proj_scale, dt_proj_weight, dt_proj_scale, dt_proj_bias, A_log, D,
               out_proj_weight, out_proj_scale, out_proj_bias):
    _, _, d_inner, d_state, _, dt_rank, _ = check_mamba_step_inputs(
        hidden_states, conv_state, ssm_state, in_proj_weight, in_proj_scale, in_proj_bias, conv_weight, conv_bias,
        x_proj_weight, x_proj_scale, dt_proj_weight, dt_proj_scale, dt_proj_bias, A_log, D, out_proj_weight,
        out_proj_scale, out_proj_bias)
    x, z = weight_only_linear(hidden_states, in_proj_weight, in_proj_scale, in_proj_bias).split(d_inner, dim=-1)
    x = causal_conv1d_update(x.unsqueeze(-1), conv_state, conv_weight, conv_bias, None, None, True).squeeze(-1)
    dt, B, C = weight_only_linear(x, x_proj_weight, x_proj_scale, None).split([dt_rank, d_state, d_state], dim=-1)
    dt = weight_only_linear(dt, dt_proj_weight, dt_proj_scale, None)
    y = selective_state_update(ssm_state, x, dt, -torch.exp(A_log), B, C, D, z, dt_proj_bias, True)
    return weight_only_linear(y, out_proj_weight, out_proj_scale, out_proj_bias)


def mamba_layers_step(hidden_states, residual, conv_states, ssm_states, norm_weight, norm_eps, *lists_and_final):
    check_mamba_layers_step_inputs(hidden_states, residual, conv_states, ssm_states, norm_weight, norm_eps,
                                   *lists_and_final)
    lists, final_norm_weight = split_final_norm(lists_and_final)
    for norm_w, args in zip(norm_weight, layer_arguments(conv_states, ssm_states, lists), strict=True):
        residual = hidden_states.clone() if residual is None else hidden_states + residual  # never an input
        hidden_states = mamba_step(F.rms_norm(residual, norm_w.shape, norm_w, norm_eps), *args)
    if final_norm_weight is not None:
        residual = hidden_states + residual
        hidden_states = F.rms_norm(residual, final_norm_weight.shape, final_norm_weight, norm_eps)
    return hidden_states, residual
