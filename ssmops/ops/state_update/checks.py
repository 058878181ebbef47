"""Argument checks of the decoding step (`selective_state_update`).

Each failure names the argument, what it got and what was expected (see ssmops/ops/_checks.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import INPUT_DTYPES, check_A, check_leading, check_tensor


class StateUpdateDims(NamedTuple):
    batch: int
    dim: int
    dstate: int
    groups: int  # of B and C; 1 for the (batch, dstate) layout


def check_state_update_inputs(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    state_dtypes: tuple = (torch.float32,),
    cache_size: int | None = None,
) -> StateUpdateDims:
    """Validates the inputs of `selective_state_update` (3-D state layout) and returns their sizes.

    state: (batch, dim, dstate) float32 (its operator's rule; the front end also takes other
    `state_dtypes` and a cache of `cache_size` rows, which it sends to `multihead_state_update`);
    x, dt, z: (batch, dim) fp32/fp16/bf16 (one dtype); A: (dim, dstate) float32; B, C:
    (batch, dstate) or (batch, groups, dstate), float32 or x's dtype; D, dt_bias: (dim,),
    float32 or x's dtype.
    """
    check_leading("x", x, "(batch, dim)")
    batch, dim = x.shape
    device = x.device
    f32_or_x = tuple(dict.fromkeys((torch.float32, x.dtype)))
    dstate = check_A(A, dim, device, like="x")
    rows = batch if cache_size is None else cache_size
    check_tensor("state", state, state_dtypes, (rows, dim, dstate), device, like="x")
    check_tensor("dt", dt, (x.dtype,), (batch, dim), device, like="x")
    groups = {}
    for name, M in (("B", B), ("C", C)):
        if not isinstance(M, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(M).__name__}")
        if M.dim() == 2:
            expected, groups[name] = (batch, dstate), 1
        elif M.dim() == 3:
            groups[name] = M.shape[1]
            if groups[name] < 1 or dim % groups[name] != 0:
                raise ValueError(f"{name} has {groups[name]} groups, which does not divide dim={dim}")
            expected = (batch, groups[name], dstate)
        else:
            raise ValueError(
                f"{name} must have shape (batch, dstate)=({batch}, {dstate}) or (batch, groups, dstate) "
                f"with groups dividing dim={dim}, got {tuple(M.shape)}"
            )
        check_tensor(name, M, f32_or_x, expected, device, like="x")
    if groups["B"] != groups["C"]:
        raise ValueError(f"B has {groups['B']} groups but C has {groups['C']}; they must agree")
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None:
            check_tensor(name, v, f32_or_x, (dim,), device, like="x")
    if z is not None:
        check_tensor("z", z, (x.dtype,), (batch, dim), device, like="x")
    return StateUpdateDims(batch, dim, dstate, groups["B"])


# --- the multi-head form: Mamba-2's layout, a cache of states, any state dtype ----------


class MultiheadDims(NamedTuple):
    batch: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    cache_size: int  # state's first dimension (== batch without state_batch_indices)


def _check_per_head(name: str, t: Tensor, per_channel: tuple, per_head: tuple, device) -> None:
    """A per-(head, channel) argument, or its per-head form tied over headdim."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    shape = per_channel if t.dim() == len(per_channel) else per_head
    dtypes = (torch.float32,) if name == "A" else INPUT_DTYPES
    check_tensor(name, t, dtypes, shape, device, like="x")


def check_multihead_inputs(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    state_batch_indices: Tensor | None,
) -> MultiheadDims:
    """Validates the inputs of `multihead_state_update` and returns their sizes.

    state: (cache_size, nheads, headdim, dstate), float32/float16/bfloat16 (written back in its
    dtype); x, z: (batch, nheads, headdim); dt: (batch, nheads, headdim), or (batch, nheads) tied
    over headdim; A: (nheads, headdim, dstate) or (nheads,) tied over headdim and dstate, float32;
    B, C: (batch, ngroups, dstate) with ngroups dividing nheads; D, dt_bias: (nheads, headdim) or
    (nheads,); state_batch_indices: (batch,) int32/int64, the cache row of each batch row (a
    negative one is padding: its output is 0 and no state changes). Floating arguments may each
    be float32, float16 or bfloat16 (A: float32).

    Or Mamba-1's layout, whose channels are heads of headdim 1 (`check_state_update_inputs`' rules, the
    state in any float dtype, a cache with state_batch_indices): x, dt, z (batch, dim), state
    (cache_size, dim, dstate), A (dim, dstate), B, C (batch, dstate) or (batch, groups, dstate), D,
    dt_bias (dim,); y is then (batch, dim).
    """
    if isinstance(x, Tensor) and x.dim() == 2:  # Mamba-1's layout, a channel a head of headdim 1
        cache_size = state.shape[0] if isinstance(state, Tensor) and state_batch_indices is not None else None
        batch, dim, dstate, groups = check_state_update_inputs(
            state, x, dt, A, B, C, D, z, dt_bias, state_dtypes=INPUT_DTYPES, cache_size=cache_size)
        if state_batch_indices is not None:
            check_tensor("state_batch_indices", state_batch_indices, (torch.int32, torch.int64), (batch,), x.device,
                         like="x")
        return MultiheadDims(batch, dim, 1, dstate, groups, state.shape[0])
    check_leading("x", x, "(batch, nheads, headdim)")
    batch, nheads, headdim = x.shape
    device = x.device
    if not isinstance(state, Tensor) or state.dim() != 4 or tuple(state.shape[1:3]) != (nheads, headdim):
        shape = tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__
        raise ValueError(f"state must have shape (cache_size, nheads, headdim, dstate) with (nheads, headdim)="
                         f"({nheads}, {headdim}), got {shape}")
    cache_size, _, _, dstate = state.shape
    check_tensor("state", state, INPUT_DTYPES, (cache_size, nheads, headdim, dstate), device, like="x")
    if state_batch_indices is None:
        if cache_size != batch:
            raise ValueError(f"state must have batch {batch} like x (or give state_batch_indices), got "
                             f"{tuple(state.shape)}")
    else:
        check_tensor("state_batch_indices", state_batch_indices, (torch.int32, torch.int64), (batch,), device,
                     like="x")
    _check_per_head("dt", dt, (batch, nheads, headdim), (batch, nheads), device)
    _check_per_head("A", A, (nheads, headdim, dstate), (nheads,), device)
    if not isinstance(B, Tensor) or B.dim() != 3 or B.shape[0] != batch or B.shape[2] != dstate:
        shape = tuple(B.shape) if isinstance(B, Tensor) else type(B).__name__
        raise ValueError(f"B must have shape (batch, ngroups, dstate) with (batch, dstate)=({batch}, {dstate}), "
                         f"got {shape}")
    ngroups = B.shape[1]
    if ngroups < 1 or nheads % ngroups != 0:
        raise ValueError(f"B has ngroups={ngroups}, which does not divide nheads={nheads}")
    check_tensor("B", B, INPUT_DTYPES, (batch, ngroups, dstate), device, like="x")
    check_tensor("C", C, INPUT_DTYPES, (batch, ngroups, dstate), device, like="x")
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None:
            _check_per_head(name, v, (nheads, headdim), (nheads,), device)
    if z is not None:
        check_tensor("z", z, INPUT_DTYPES, (batch, nheads, headdim), device, like="x")
    return MultiheadDims(batch, nheads, headdim, dstate, ngroups, cache_size)
