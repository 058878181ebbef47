"""`mamba_chunk_scan_combined`: mamba_ssm's Mamba-2 (SSD) scan of that name, on the ssmops operators."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._registry import triton_op_for
from .ops.ssd.checks import check_sequence_values, check_ssd_inputs

_FLOAT32_MAX = torch.finfo(torch.float32).max


def _limit_arg(dt_limit: tuple[float, float]) -> list[float]:
    """The operator's dt_limit: [] for no clamp (mamba_ssm's default (0, inf)), else finite bounds
    (an infinite one becomes float32's largest value, which clamps no float32 dt)."""
    low, high = (float(v) for v in dt_limit)
    if (low, high) == (0.0, math.inf):
        return []
    return [max(min(low, _FLOAT32_MAX), -_FLOAT32_MAX), max(min(high, _FLOAT32_MAX), -_FLOAT32_MAX)]


def mamba_chunk_scan_combined(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    state_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """The SSD scan; a drop-in for `mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`.

    x, z: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads); A: (nheads,) float32;
    B, C: (batch, seqlen, ngroups, dstate), ngroups dividing nheads; D: (nheads, headdim) or
    (nheads,); dt_bias: (nheads,); initial_states: (batch, nheads, headdim, dstate); seq_idx:
    (batch, seqlen) int32, non-decreasing; cu_seqlens: (nseq + 1,), with seq_idx and batch 1.
    Per head, in float32::

        dt_t = clamp(softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias, *dt_limit)
        h_t  = exp(dt_t * A) * h_{t-1} + dt_t * outer(x_t, B_t)
        y_t  = h_t @ C_t + D * x_t;   out = y * silu(z) when z is given

    The state restarts at zero where seq_idx changes; `initial_states` reaches the first tokens
    only when seq_idx starts at 0 (as in mamba_ssm). Returns out (x's dtype), then the float32
    final states (batch, nheads, headdim, dstate) when `return_final_states`, then each
    sequence's final state (nseq, nheads, headdim, dstate) when `return_varlen_states` (which
    needs cu_seqlens). `chunk_size` is a speed setting. Differentiable in every tensor argument,
    through the final and varlen states too. States are float32 whatever `state_dtype` says
    (accepted for mamba_ssm's signature).
    """
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states needs cu_seqlens, got cu_seqlens=None")
    if not return_varlen_states:
        cu_seqlens = None  # as mamba_ssm: only the varlen states read it
    limit = _limit_arg(dt_limit)
    check_ssd_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, limit)
    if not torch.compiler.is_compiling():  # reads seq_idx and cu_seqlens: eager only (the kernels check too)
        check_sequence_values(x.shape[1], seq_idx, cu_seqlens)
    # on GPUs the Triton operator itself, so that torch.compile and AOTInductor trace into its kernels
    scan = triton_op_for("ssd_scan_fwd", x) or torch.ops.ssmops.ssd_scan_fwd
    out, final_states, _, varlen_states = scan(
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus, limit)
    returned = (out,) + ((final_states,) if return_final_states else ()) + \
        ((varlen_states,) if return_varlen_states else ())
    return returned[0] if len(returned) == 1 else returned
