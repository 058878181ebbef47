"""`selective_state_update`: mamba_ssm's single-token decoding step, on the ssmops operator."""

from __future__ import annotations

import torch
from torch import Tensor

from ._registry import triton_op_for
from .ops.state_update.checks import check_state_update_inputs


def _flatten_heads(t: Tensor | None, shape) -> Tensor | None:
    return None if t is None else t.reshape(shape)


def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
) -> Tensor:
    """One recurrent step; a drop-in for `mamba_ssm.ops.triton.selective_state_update`.

    state: (batch, dim, dstate) float32, UPDATED IN PLACE; x, dt, z: (batch, dim) in
    fp32/fp16/bf16; A: (dim, dstate) float32; B, C: (batch, dstate) or
    (batch, ngroups, dstate) with ngroups dividing dim; D, dt_bias: (dim,) float32 or
    x's dtype. Computes, in float32::

        dt    = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias
        state = exp(dt * A) * state + dt * B * x
        y     = <state, C> + D * x,  times silu(z) when z is given

    and returns y (batch, dim) in x's dtype. It is exactly one timestep of
    `selective_scan_fn` with `initial_state=state`. The multi-head layout of mamba_ssm
    (state (batch, nheads, headdim, dstate), x (batch, nheads, headdim), A (nheads,
    headdim, dstate), D/dt_bias (nheads, headdim)) is accepted too; the state must then
    be viewable as (batch, nheads * headdim, dstate).

    Inference only: not differentiable (no autograd is registered).
    """
    if isinstance(state, Tensor) and state.dim() == 4:
        batch, nheads, headdim, dstate = state.shape
        dim = nheads * headdim
        try:
            flat_state = state.view(batch, dim, dstate)
        except RuntimeError as err:
            raise ValueError(
                f"state of shape {tuple(state.shape)} and strides {state.stride()} cannot be viewed as "
                f"(batch, nheads * headdim, dstate); it is updated in place, so it must be"
            ) from err
        y = selective_state_update(
            flat_state, x.reshape(batch, dim), dt.reshape(batch, dim), A.reshape(dim, dstate), B, C,
            _flatten_heads(D, (dim,)), _flatten_heads(z, (batch, dim)),
            _flatten_heads(dt_bias, (dim,)), dt_softplus,
        )
        return y.view(batch, nheads, headdim)
    check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    step = triton_op_for("selective_state_update", x) or torch.ops.ssmops.selective_state_update
    return step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
