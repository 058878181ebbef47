"""Argument checks shared by the Python API, the fake kernels and the Python backends.

Each failure names the argument, what it got and what was expected: TypeError for a
wrong type or dtype, ValueError for a wrong rank, shape or device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_DSTATE = 256


class ScanDims(NamedTuple):
    batch: int
    dim: int
    seqlen: int
    dstate: int
    groups: int  # of the grouped/variable B and C; 1 when both are constant


def _dtype_name(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_tensor(name: str, x, dtypes, shape, device, like: str = "u") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_name(dtypes)}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like {like}, got {x.device}")


def _check_leading(name: str, x, layout: str) -> None:
    """The argument whose rank and dtype set the others' shapes and dtypes (u, or x)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    if x.dim() != layout.count(",") + 1:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must have dtype {_dtype_name(INPUT_DTYPES)}, got {x.dtype}")


def _check_A(A, dim: int, device, like: str = "u") -> int:
    """Checks A (dim, dstate) float32; returns dstate, which A sets for every other argument."""
    if not isinstance(A, Tensor):
        raise TypeError(f"A must be a Tensor, got {type(A).__name__}")
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must have shape (dim, dstate) with dim={dim}, got {tuple(A.shape)}")
    dstate = A.shape[1]
    if not 1 <= dstate <= MAX_DSTATE:
        raise ValueError(f"A must have 1 <= dstate <= {MAX_DSTATE}, got dstate={dstate}")
    _check_tensor("A", A, (torch.float32,), (dim, dstate), device, like=like)
    return dstate


def _bc_groups(name: str, M, batch: int, dim: int, seqlen: int, dstate: int, dtypes) -> int:
    """Checks B or C in its three layouts; returns its group count (0 when constant)."""
    if not isinstance(M, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(M).__name__}")

    def wrong_shape() -> ValueError:  # formatted only on failure: formatting a symbolic seqlen specializes it
        return ValueError(
            f"{name} must have shape (dim, dstate)=({dim}, {dstate}), (batch, dstate, seqlen)="
            f"({batch}, {dstate}, {seqlen}) or (batch, groups, dstate, seqlen) with groups dividing "
            f"dim={dim}, got {tuple(M.shape)}"
        )

    if M.dim() == 2:
        expected, groups = (dim, dstate), 0
    elif M.dim() == 3:
        expected, groups = (batch, dstate, seqlen), 1
    elif M.dim() == 4:
        groups = M.shape[1]
        if groups < 1 or dim % groups != 0:
            raise ValueError(f"{name} has {groups} groups, which does not divide dim={dim}")
        expected = (batch, groups, dstate, seqlen)
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
    if M.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_name(dtypes)}, got {M.dtype}")
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
    """Validates the forward's inputs against DESIGN.md and returns their sizes."""
    _check_leading("u", u, "(batch, dim, seqlen)")
    batch, dim, seqlen = u.shape
    if seqlen < 1:
        raise ValueError(f"u must have seqlen >= 1, got shape {tuple(u.shape)}")
    device = u.device
    _check_tensor("delta", delta, (u.dtype,), u.shape, device)
    dstate = _check_A(A, dim, device)
    bc_dtypes = (torch.float32, u.dtype)
    groups_B = _bc_groups("B", B, batch, dim, seqlen, dstate, bc_dtypes)
    groups_C = _bc_groups("C", C, batch, dim, seqlen, dstate, bc_dtypes)
    if groups_B and groups_C and groups_B != groups_C:
        raise ValueError(f"B has {groups_B} groups but C has {groups_C}; they must agree")
    for name, M in (("B", B), ("C", C)):
        if M.device != device:
            raise ValueError(f"{name} must be on {device} like u, got {M.device}")
    for name, x in (("D", D), ("delta_bias", delta_bias)):
        if x is not None:
            _check_tensor(name, x, (torch.float32,), (dim,), device)
    if z is not None:
        _check_tensor("z", z, (u.dtype,), u.shape, device)
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, (torch.float32,), (batch, dim, dstate), device)
    return ScanDims(batch, dim, seqlen, dstate, max(groups_B, groups_C, 1))


def check_scan_grad_inputs(
    dims: ScanDims, u: Tensor, dout: Tensor, scan_intermediates: Tensor, dlast_state: Tensor | None
) -> None:
    """Validates the backward-only inputs (the forward's inputs are checked separately)."""
    batch, dim, seqlen, dstate, _ = dims
    _check_tensor("dout", dout, (u.dtype,), u.shape, u.device)
    n_chunks = num_chunks(seqlen)
    _check_tensor(
        "scan_intermediates", scan_intermediates, (torch.float32,),
        (batch, dim, n_chunks * 2 * dstate), u.device,
    )
    if dlast_state is not None:
        _check_tensor("dlast_state", dlast_state, (torch.float32,), (batch, dim, dstate), u.device)


# scan_intermediates hold one entry per CHUNK_LEN timesteps (mamba_ssm's layout).
CHUNK_LEN = 2048


def num_chunks(seqlen):
    return (seqlen + CHUNK_LEN - 1) // CHUNK_LEN


# --- selective_state_update: one decoding step ----------------------------------------


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
    _check_leading("x", x, "(batch, dim)")
    batch, dim = x.shape
    device = x.device
    f32_or_x = tuple(dict.fromkeys((torch.float32, x.dtype)))
    dstate = _check_A(A, dim, device, like="x")
    _check_tensor("state", state, (torch.float32,), (batch, dim, dstate), device, like="x")
    _check_tensor("dt", dt, (x.dtype,), (batch, dim), device, like="x")
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
        _check_tensor(name, M, f32_or_x, expected, device, like="x")
    if groups["B"] != groups["C"]:
        raise ValueError(f"B has {groups['B']} groups but C has {groups['C']}; they must agree")
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None:
            _check_tensor(name, v, f32_or_x, (dim,), device, like="x")
    if z is not None:
        _check_tensor("z", z, (x.dtype,), (batch, dim), device, like="x")
    return StateUpdateDims(batch, dim, dstate, groups["B"])
