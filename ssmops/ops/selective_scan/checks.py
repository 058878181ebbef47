"""Argument checks of the selective scan, and the chunk contract of its intermediates.

Each failure names the argument, what it got and what was expected (see ssmops/ops/_checks.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import check_A, check_leading, check_tensor, dtype_name

# scan_intermediates hold one entry per CHUNK_LEN timesteps (mamba_ssm's layout).
CHUNK_LEN = 2048
# A's dtypes; the states (initial, last, scan_intermediates) and A's gradient have A's dtype.
# complex128 is not served: the operators compute in single precision (gradcheck runs on the reference).
STATE_DTYPES = (torch.float32, torch.complex64)


def num_chunks(seqlen):
    return (seqlen + CHUNK_LEN - 1) // CHUNK_LEN


class ScanDims(NamedTuple):
    batch: int
    dim: int
    seqlen: int
    dstate: int
    groups: int  # of the grouped/variable B and C; 1 when both are constant


def _bc_groups(name: str, M, batch: int, dim: int, seqlen: int, dstate: int, dtypes, complex_A: bool) -> int:
    """Checks B or C in its three layouts; returns its group count (0 when constant).

    With complex A (mamba_ssm's convention) a constant B/C is complex64, and a variable one
    is real with 2 * seqlen entries along time: the real and imaginary parts, interleaved."""
    if not isinstance(M, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(M).__name__}")
    time = 2 * seqlen if complex_A else seqlen

    def wrong_shape() -> ValueError:  # formatted only on failure: formatting a symbolic seqlen specializes it
        time_name = "2 * seqlen" if complex_A else "seqlen"
        pairs = " (re, im interleaved along time, as A is complex)" if complex_A else ""
        return ValueError(
            f"{name} must have shape (dim, dstate)=({dim}, {dstate}), (batch, dstate, {time_name})="
            f"({batch}, {dstate}, {time}) or (batch, groups, dstate, {time_name}) with groups dividing "
            f"dim={dim}{pairs}, got {tuple(M.shape)}"
        )

    if M.dim() == 2:
        expected, groups = (dim, dstate), 0
    elif M.dim() == 3:
        expected, groups = (batch, dstate, time), 1
    elif M.dim() == 4:
        groups = M.shape[1]
        if groups < 1 or dim % groups != 0:
            raise ValueError(f"{name} has {groups} groups, which does not divide dim={dim}")
        expected = (batch, groups, dstate, time)
    else:
        raise wrong_shape()
    if tuple(M.shape) != expected:
        dstate_axis = 1 if M.dim() == 2 else -2
        others = [s for i, s in enumerate(M.shape) if i != dstate_axis % M.dim()]
        if others == [s for i, s in enumerate(expected) if i != dstate_axis % M.dim()]:
            raise ValueError(
                f"{name} has dstate {M.shape[dstate_axis]} but A has dstate {dstate}: A is (dim, dstate)="
                f"({dim}, {dstate}), {name} is {tuple(M.shape)}"
            )
        raise wrong_shape()
    if complex_A and M.dim() == 2:
        dtypes, why = (torch.complex64,), " (a constant B/C is complex when A is)"
    else:
        why = " (a variable B/C holds re/im pairs when A is complex)" if complex_A else ""
    if M.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {dtype_name(dtypes)}{why}, got {M.dtype}")
    return groups


def check_scan_inputs(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    initial_state: Tensor | None,
) -> ScanDims:
    """Validates the forward's inputs against the contract (docs/design.md) and returns their sizes."""
    check_leading("u", u, "(batch, dim, seqlen)")
    batch, dim, seqlen = u.shape
    if seqlen < 1:
        raise ValueError(f"u must have seqlen >= 1, got shape {tuple(u.shape)}")
    device = u.device
    check_tensor("delta", delta, (u.dtype,), u.shape, device)
    # complex A (mamba_ssm's complex mode): complex states, B and C; see _bc_groups for their layouts
    dstate = check_A(A, dim, device, dtypes=STATE_DTYPES)
    complex_A = A.is_complex()
    bc_dtypes = tuple(dict.fromkeys((torch.float32, u.dtype)))
    groups_B = _bc_groups("B", B, batch, dim, seqlen, dstate, bc_dtypes, complex_A)
    groups_C = _bc_groups("C", C, batch, dim, seqlen, dstate, bc_dtypes, complex_A)
    if groups_B and groups_C and groups_B != groups_C:
        raise ValueError(f"B has {groups_B} groups but C has {groups_C}; they must agree")
    for name, M in (("B", B), ("C", C)):
        if M.device != device:
            raise ValueError(f"{name} must be on {device} like u, got {M.device}")
    for name, x in (("D", D), ("delta_bias", delta_bias)):
        if x is not None:
            check_tensor(name, x, (torch.float32,), (dim,), device)
    if z is not None:
        check_tensor("z", z, (u.dtype,), u.shape, device)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (A.dtype,), (batch, dim, dstate), device)
    return ScanDims(batch, dim, seqlen, dstate, max(groups_B, groups_C, 1))


def check_scan_grad_inputs(
    dims: ScanDims, u: Tensor, A: Tensor, dout: Tensor, scan_intermediates: Tensor, dlast_state: Tensor | None
) -> None:
    """Validates the backward-only inputs (the forward's inputs are checked separately); the states
    have A's dtype."""
    batch, dim, seqlen, dstate, _ = dims
    check_tensor("dout", dout, (u.dtype,), u.shape, u.device)
    n_chunks = num_chunks(seqlen)
    check_tensor(
        "scan_intermediates", scan_intermediates, (A.dtype,),
        (batch, dim, n_chunks * 2 * dstate), u.device,
    )
    if dlast_state is not None:
        check_tensor("dlast_state", dlast_state, (A.dtype,), (batch, dim, dstate), u.device)
