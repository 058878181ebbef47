"""`selective_state_update`: mamba_ssm's single-token decoding step, on the ssmops operators."""

from __future__ import annotations

import torch
from torch import Tensor

from ._registry import call_step
from .ops._checks import INPUT_DTYPES, check_cache_indices, checked_call
from .ops.state_update.checks import check_multihead_inputs, check_state_update_inputs


def _layout(state, state_batch_indices) -> str:
    """Which operator takes the step: 'multihead' (Mamba-2's layout), 'mamba1_as_heads' (Mamba-1's
    with a low-precision state or a cache: Mamba-2's operator, one channel a head of headdim 1) or
    'mamba1'."""
    if isinstance(state, Tensor) and state.dim() == 4:
        return "multihead"
    if isinstance(state, Tensor) and state.dim() == 3 and (state.dtype != torch.float32 or
                                                           state_batch_indices is not None):
        return "mamba1_as_heads"
    return "mamba1"


def _step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices) -> Tensor:
    """The operator call of the step's layout, the arguments as they are (each kernel checks them); in eager
    mode on a GPU, the Triton launcher called directly where the operator's route adds nothing
    (`_registry.call_step`)."""
    if _layout(state, state_batch_indices) == "mamba1":
        name, args = "selective_state_update", (state, x, dt, A, B, C, D, z, dt_bias)
    else:
        # (Mamba-1's layout with a low-precision state or a cache: the multi-head operator takes it as it is,
        # a channel a head of headdim 1, so that no views are built per call)
        name, args = "multihead_state_update", (state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    return call_step(name, x, args, (dt_softplus,), state)


def _check(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices) -> None:
    """The checks of `_step`'s arguments, with errors that name the argument."""
    layout = _layout(state, state_batch_indices)
    if layout == "multihead":
        check_multihead_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    elif layout == "mamba1_as_heads":
        check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_dtypes=INPUT_DTYPES,
                                  cache_size=state.shape[0] if state_batch_indices is not None else None)
    else:
        check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    if not torch.compiler.is_compiling():  # it reads the indices: eager only (the kernels check too)
        check_cache_indices("state_batch_indices", state_batch_indices, state.shape[0], "state")


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
    headdim); dt, A, D and dt_bias may also come in their per-head forms, (batch, nheads) and (nheads,).
    Where dt, A and dt_bias are per head, or stride-0 expansions over headdim (and dstate) as
    mamba_ssm's Mamba2 passes them, one decay per head is computed. Returns (batch, nheads, headdim).

    Either layout: the state may be float32, float16 or bfloat16 (the step computes in float32
    and writes the state back in its dtype), and `state_batch_indices` (batch,) picks the state's
    row of each batch row in a cache (a negative index is padding: output 0, no state changed).

    Inference only: not differentiable (no autograd is registered).
    """
    args = (state, x, dt, A, B, C, D, z, dt_bias)
    return checked_call(lambda: _step(*args, dt_softplus, state_batch_indices),
                        lambda: _check(*args, state_batch_indices))
