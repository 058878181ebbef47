"""`mamba_step` and `mamba_layers_step` in plain PyTorch, formula by formula: the executable form of
their contract (docs/design.md). Every backend is tested against it; it is built from the references
of the operators it fuses (the projections in float64), each tested against its own formulas."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..linear.reference import weight_only_linear_ref
from ..state_update.reference import selective_state_update_ref
from .checks import layer_arguments, split_final_norm


def mamba_step_ref(hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor, in_proj_weight: Tensor,
                   in_proj_scale: Tensor | None, in_proj_bias: Tensor | None, conv_weight: Tensor,
                   conv_bias: Tensor | None, x_proj_weight: Tensor, x_proj_scale: Tensor | None,
                   dt_proj_weight: Tensor, dt_proj_scale: Tensor | None, dt_proj_bias: Tensor | None, A_log: Tensor,
                   D: Tensor | None, out_proj_weight: Tensor, out_proj_scale: Tensor | None,
                   out_proj_bias: Tensor | None) -> Tensor:
    """Updates conv_state and ssm_state in place and returns out (batch, out_features)::

        x, z     = split(in_proj(hidden_states))                  (d_inner each)
        window   = (conv_state[..., 1:], x);  conv_state = window
        x        = silu(<window, conv_weight> + conv_bias)
        dt, B, C = split(x_proj(x))                                (dt_rank, d_state, d_state)
        dt       = softplus(dt_proj(dt) + dt_proj_bias)
        ssm_state = exp(dt * A) * ssm_state + dt * x * B,  A = -exp(A_log)
        y        = (<ssm_state, C> + D * x) * silu(z)
        out      = out_proj(y)

    where proj(v) = v @ (weight * scale[:, None]).T + bias.
    """
    d_inner, d_state = A_log.shape
    dt_rank = x_proj_weight.shape[0] - 2 * d_state
    xz = weight_only_linear_ref(hidden_states.double(), in_proj_weight, in_proj_scale, in_proj_bias)
    x, z = xz.split(d_inner, dim=-1)
    window = conv_state.double().roll(-1, dims=-1)
    window[..., -1] = x
    conv_state.copy_(window)
    x = (window * conv_weight.double()).sum(-1)
    if conv_bias is not None:
        x = x + conv_bias.double()
    x = F.silu(x)
    dt, B, C = weight_only_linear_ref(x, x_proj_weight, x_proj_scale).split([dt_rank, d_state, d_state], dim=-1)
    dt = weight_only_linear_ref(dt, dt_proj_weight, dt_proj_scale)
    state64 = ssm_state.double()
    y = selective_state_update_ref(state64, x, dt, -A_log.double().exp(), B, C, None if D is None else D.double(), z,
                                   None if dt_proj_bias is None else dt_proj_bias.double(), dt_softplus=True)
    ssm_state.copy_(state64)
    return weight_only_linear_ref(y, out_proj_weight, out_proj_scale, out_proj_bias).to(hidden_states.dtype)


def mamba_layers_step_ref(hidden_states: Tensor, residual: Tensor | None, conv_states: list[Tensor],
                          ssm_states: list[Tensor], norm_weight: list[Tensor], norm_eps: float,
                          *lists_and_final) -> tuple[Tensor, Tensor]:
    """Updates every layer's states in place and returns (hidden_states, residual) after the last::

        rms_norm(r, w) = r / sqrt(mean(r^2) + norm_eps) * w
        for each layer i:
            residual      = hidden_states + residual        (hidden_states alone at the first layer
                                                             when residual is None)
            hidden_states = mamba_step(rms_norm(residual, norm_weight[i]))
        with final_norm_weight:
            residual      = hidden_states + residual
            hidden_states = rms_norm(residual, final_norm_weight)

    in float64, each layer's mixer by `mamba_step_ref`; `lists_and_final` are the mixer's per-layer
    lists in the operator's order, then final_norm_weight if given."""
    lists, final_norm_weight = split_final_norm(lists_and_final)

    def rms_norm(r: Tensor, w: Tensor) -> Tensor:
        return r * (r.pow(2).mean(-1, keepdim=True) + norm_eps).rsqrt() * w.double()

    hidden, res = hidden_states.double(), None if residual is None else residual.double()
    for norm_w, args in zip(norm_weight, layer_arguments(conv_states, ssm_states, lists), strict=True):
        res = hidden if res is None else hidden + res
        hidden = mamba_step_ref(rms_norm(res, norm_w), *args)
    if final_norm_weight is not None:
        res = hidden + res
        hidden = rms_norm(res, final_norm_weight)
    return hidden.to(hidden_states.dtype), res.to(hidden_states.dtype)
