"""`selective_state_update`: mamba_ssm's single-token decoding step, on the ssmops operators."""

from __future__ import annotations

import torch
from torch import Tensor

from ._registry import triton_op_for
from .ops._checks import INPUT_DTYPES
from .ops.state_update.checks import check_multihead_inputs, check_state_batch_indices, check_state_update_inputs
from .ops.state_update.schema import as_multihead


def _tied(t: Tensor | None, tied_dims: int) -> Tensor | None:
    """t without its last `tied_dims` dimensions when they are stride-0 expansions (mamba_ssm's
    Mamba2 passes dt, A, D and dt_bias so), else t itself."""
    if t is None or t.dim() <= tied_dims or any(s != 0 for s in t.stride()[-tied_dims:]):
        return t
    return t[(...,) + (0,) * tied_dims]


def _tie(dt: Tensor, A: Tensor, dt_bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The per-head forms of dt, A and dt_bias where all three are tied over headdim (and A over
    dstate): the operator then computes one decay per head instead of headdim * dstate."""
    dt_h, A_h, bias_h = _tied(dt, 1), _tied(A, 2), _tied(dt_bias, 1)
    if dt_h.dim() == 2 and A_h.dim() == 1 and (bias_h is None or bias_h.dim() == 1):
        return dt_h, A_h, bias_h
    return dt, A, dt_bias


def _check_indices(state_batch_indices: Tensor | None, cache_size: int) -> None:
    if not torch.compiler.is_compiling():  # it reads the indices: eager only (the kernels check too)
        check_state_batch_indices(state_batch_indices, cache_size)


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
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """One recurrent step; a drop-in for `mamba_ssm.ops.triton.selective_state_update`.

    Mamba-1's layout: state (batch, dim, dstate), UPDATED IN PLACE; x, dt, z: (batch, dim);
    A: (dim, dstate) float32; B, C: (batch, dstate) or (batch, ngroups, dstate) with ngroups
    dividing dim; D, dt_bias: (dim,). Computes, in float32::

        dt    = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias
        state = exp(dt * A) * state + dt * B * x
        y     = <state, C> + D * x,  times silu(z) when z is given

    and returns y (batch, dim) in x's dtype: exactly one timestep of `selective_scan_fn` with
    `initial_state=state`.

    Mamba-2's layout: state (cache_size, nheads, headdim, dstate); x, dt, z: (batch, nheads,
    headdim); A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate); D, dt_bias: (nheads,
    headdim). Where dt, A and dt_bias are stride-0 expansions over headdim (and dstate), as
    mamba_ssm's Mamba2 passes them, one decay per head is computed. Returns (batch, nheads, headdim).

    Either layout: the state may be float32, float16 or bfloat16 (the step computes in float32
    and writes the state back in its dtype), and `state_batch_indices` (batch,) picks the state's
    row of each batch row in a cache (a negative index is padding: output 0, no state changed).

    Inference only: not differentiable (no autograd is registered).
    """
    if isinstance(state, Tensor) and state.dim() == 4:
        dt, A, dt_bias = _tie(dt, A, dt_bias)
        D = _tied(D, 1)  # a per-head D expanded over headdim: its per-head form spares the kernel a copy
        check_multihead_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
        _check_indices(state_batch_indices, state.shape[0])
        step = triton_op_for("multihead_state_update", x) or torch.ops.ssmops.multihead_state_update
        return step(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus)
    if isinstance(state, Tensor) and state.dim() == 3 and (state.dtype != torch.float32 or
                                                           state_batch_indices is not None):
        # a low-precision state or a cache: Mamba-2's operator, one channel a head of headdim 1
        check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_dtypes=INPUT_DTYPES,
                                  cache_size=state.shape[0] if state_batch_indices is not None else None)
        _check_indices(state_batch_indices, state.shape[0])
        heads = as_multihead(state, x, dt, A, B, C, D, z, dt_bias)
        step = triton_op_for("multihead_state_update", x) or torch.ops.ssmops.multihead_state_update
        return step(*heads, state_batch_indices, dt_softplus).squeeze(-1)
    check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    step = triton_op_for("selective_state_update", x) or torch.ops.ssmops.selective_state_update
    return step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
