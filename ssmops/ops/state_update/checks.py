"""Argument checks of the decoding step (`selective_state_update`).

Each failure names the argument, what it got and what was expected (see ssmops/ops/_checks.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import check_A, check_leading, check_tensor


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
) -> StateUpdateDims:
    """Validates the inputs of `selective_state_update` (3-D state layout) and returns their sizes.

    state: (batch, dim, dstate) float32; x, dt, z: (batch, dim) fp32/fp16/bf16 (one dtype);
    A: (dim, dstate) float32; B, C: (batch, dstate) or (batch, groups, dstate), float32 or
    x's dtype; D, dt_bias: (dim,), float32 or x's dtype.
    """
    check_leading("x", x, "(batch, dim)")
    batch, dim = x.shape
    device = x.device
    f32_or_x = tuple(dict.fromkeys((torch.float32, x.dtype)))
    dstate = check_A(A, dim, device, like="x")
    check_tensor("state", state, (torch.float32,), (batch, dim, dstate), device, like="x")
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
