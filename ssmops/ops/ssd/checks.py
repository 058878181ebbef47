"""Argument checks of the SSD chunked scan (Mamba-2), and the chunk contract of its saved states.

Each failure names the argument, what it got and what was expected (see ssmops/ops/_checks.py).
Checks of values (seq_idx non-decreasing, cu_seqlens a partition of the sequence) read data, so
the kernels make them, not the fake kernels.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import INPUT_DTYPES, check_leading, check_tensor, dtype_name


# An infinite dt_limit bound travels through the operators as float32's largest magnitude (no infinity
# in an exported graph); every backend takes it as no bound on that side, so an infinite dt stays so.
FLOAT32_MAX = torch.finfo(torch.float32).max


def limit_bounds(dt_limit: list[float] | tuple[float, float]) -> tuple[float, float]:
    """dt_limit's (low, high) as clamp bounds, float32's largest magnitude back to infinity."""
    low, high = (float(v) for v in dt_limit)
    return (-math.inf if low <= -FLOAT32_MAX else low), (math.inf if high >= FLOAT32_MAX else high)

class SsdDims(NamedTuple):
    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    nseq: int  # sequences of cu_seqlens; 0 without it


def num_chunks(seqlen, chunk_size: int):
    return (seqlen + chunk_size - 1) // chunk_size


def _check_float(name: str, t, shape, device, sizes_from: str = "x") -> None:
    check_tensor(name, t, INPUT_DTYPES, shape, device, like="x", sizes_from=sizes_from)


def check_ssd_inputs(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    initial_states: Tensor | None,
    seq_idx: Tensor | None,
    cu_seqlens: Tensor | None,
    chunk_size: int,
    dt_limit,
) -> SsdDims:
    """Validates the forward's inputs and returns their sizes. Every floating input may be
    float32, float16 or bfloat16 on its own, except A (float32)."""
    check_leading("x", x, "(batch, seqlen, nheads, headdim)")
    batch, seqlen, nheads, headdim = x.shape
    if seqlen < 1:
        raise ValueError(f"x must have seqlen >= 1, got shape {tuple(x.shape)}")
    device = x.device
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if len(dt_limit) not in (0, 2) or (len(dt_limit) == 2 and not dt_limit[0] <= dt_limit[1]):
        raise ValueError(f"dt_limit must be (low, high) with low <= high, got {tuple(dt_limit)}")
    _check_float("dt", dt, (batch, seqlen, nheads), device)
    check_tensor("A", A, (torch.float32,), (nheads,), device, like="x")
    if not isinstance(B, Tensor):
        raise TypeError(f"B must be a Tensor, got {type(B).__name__}")
    if B.dim() != 4 or tuple(B.shape[:2]) != (batch, seqlen):
        raise ValueError(f"B must have shape (batch, seqlen, ngroups, dstate) with (batch, seqlen)=({batch}, {seqlen}),"
                         f" got {tuple(B.shape)}")
    ngroups, dstate = B.shape[2], B.shape[3]
    if ngroups < 1 or nheads % ngroups != 0:
        raise ValueError(f"B has ngroups={ngroups}, which does not divide nheads={nheads}")
    if dstate < 1:
        raise ValueError(f"B must have dstate >= 1, got shape {tuple(B.shape)}")
    _check_float("B", B, (batch, seqlen, ngroups, dstate), device)
    _check_float("C", C, (batch, seqlen, ngroups, dstate), device, sizes_from="B")
    if D is not None:
        _check_float("D", D, (nheads, headdim) if isinstance(D, Tensor) and D.dim() == 2 else (nheads,), device)
    if z is not None:
        _check_float("z", z, tuple(x.shape), device)
    if dt_bias is not None:
        _check_float("dt_bias", dt_bias, (nheads,), device)
    if initial_states is not None:
        _check_float("initial_states", initial_states, (batch, nheads, headdim, dstate), device,
                     sizes_from="x and B")
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, (torch.int32,), (batch, seqlen), device, like="x")
    nseq = 0
    if cu_seqlens is not None:
        if seq_idx is None:
            raise ValueError("cu_seqlens needs seq_idx too (the sequence of each token), got seq_idx=None")
        if batch != 1:
            raise ValueError(f"cu_seqlens needs x with batch 1 (the sequences packed along seqlen), got batch={batch}")
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            shape = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, Tensor) else type(cu_seqlens).__name__
            raise ValueError(f"cu_seqlens must have shape (nseq + 1,) with nseq >= 1, got {shape}")
        int_dtypes = (torch.int32, torch.int64)
        if cu_seqlens.dtype not in int_dtypes:
            raise TypeError(f"cu_seqlens must have dtype {dtype_name(int_dtypes)}, got {cu_seqlens.dtype}")
        if cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens must be on {device} like x, got {cu_seqlens.device}")
        nseq = cu_seqlens.shape[0] - 1
    return SsdDims(batch, seqlen, nheads, headdim, ngroups, dstate, nseq)


def check_ssd_grad_inputs(
    dims: SsdDims,
    x: Tensor,
    chunk_size: int,
    dout: Tensor,
    chunk_states: Tensor,
    dfinal_states: Tensor | None,
    dvarlen_states: Tensor | None,
    z: Tensor | None = None,
    ungated: Tensor | None = None,
) -> None:
    """Validates the backward-only inputs (the forward's inputs are checked separately)."""
    batch, seqlen, nheads, headdim, _, dstate, nseq = dims
    check_tensor("dout", dout, INPUT_DTYPES, tuple(x.shape), x.device, like="x")
    check_tensor("chunk_states", chunk_states, (torch.float32,),
                 (batch, num_chunks(seqlen, chunk_size) * nheads, headdim, dstate), x.device, like="x")
    if dfinal_states is not None:
        check_tensor("dfinal_states", dfinal_states, (torch.float32,), (batch, nheads, headdim, dstate), x.device,
                     like="x")
    if dvarlen_states is not None:
        check_tensor("dvarlen_states", dvarlen_states, (torch.float32,), (nseq, nheads, headdim, dstate), x.device,
                     like="x")
    if ungated is not None:
        if z is None:
            raise ValueError("ungated (the output before the gate) was given without z")
        check_tensor("ungated", ungated, INPUT_DTYPES, tuple(x.shape), x.device, like="x")


def keeps_ungated(z: Tensor | None, keep_ungated: bool) -> bool:
    """Whether the forward returns the output before the gate (else an empty tensor in its place)."""
    return z is not None and keep_ungated


def check_sequence_values(seqlen: int, seq_idx: Tensor | None, cu_seqlens: Tensor | None) -> None:
    """The checks that read data: seq_idx non-decreasing along each row; cu_seqlens starting at
    0, non-decreasing and ending at seqlen. For the kernels (eager), not the fake kernels."""
    if seq_idx is not None and seq_idx.shape[1] > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        raise ValueError("seq_idx must be non-decreasing along seqlen (sequences packed one after another)")
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != seqlen or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to seqlen={seqlen}, got {cu}")
