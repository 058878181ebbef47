"""mamba_ssm's Mamba-2 (SSD) entry points on the ssmops operators: the scan
(`mamba_chunk_scan_combined`) and the mixer around it (`mamba_split_conv1d_scan_combined`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._registry import operator_for
from .causal_conv1d import causal_conv1d_fn
from .layernorm_gated import rmsnorm_fn
from .ops._autograd import contiguous_when_compiling_backward
from .ops._checks import checked_call
from .ops.ssd.checks import FLOAT32_MAX, check_sequence_values, check_ssd_inputs


def _limit_arg(dt_limit: tuple[float, float]) -> list[float]:
    """The operator's dt_limit: [] for no clamp (mamba_ssm's default (0, inf)), else finite bounds
    (an infinite one becomes float32's largest value, which the operators take as no bound)."""
    low, high = (float(v) for v in dt_limit)
    if (low, high) == (0.0, math.inf):
        return []
    return [max(min(low, FLOAT32_MAX), -FLOAT32_MAX), max(min(high, FLOAT32_MAX), -FLOAT32_MAX)]


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
    inputs = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    # the output before the gate, for the backward's dz (schema.py): kept only where a backward may follow, and
    # not in an exported graph (an inference program, whose parameters still require grad)
    keep_ungated = (z is not None and torch.is_grad_enabled() and not torch.compiler.is_exporting()
                    and any(isinstance(t, Tensor) and t.requires_grad for t in inputs))

    def scan():
        # (on GPUs the Triton operator itself, so that torch.compile and AOTInductor trace into its kernels)
        forward = operator_for("ssd_scan_fwd", x)
        return forward(*contiguous_when_compiling_backward(*inputs), seq_idx, cu_seqlens, chunk_size, dt_softplus,
                       limit, keep_ungated)

    def check():
        check_ssd_inputs(*inputs, seq_idx, cu_seqlens, chunk_size, limit)
        if not torch.compiler.is_compiling():  # reads seq_idx and cu_seqlens: eager only (the kernels check too)
            check_sequence_values(x.shape[1], seq_idx, cu_seqlens)

    out, final_states, _, varlen_states, _ = checked_call(scan, check)
    returned = (out,) + ((final_states,) if return_final_states else ()) + \
        ((varlen_states,) if return_varlen_states else ())
    return returned[0] if len(returned) == 1 else returned


def mamba_split_conv1d_scan_combined(
    zxbcdt: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor | None,
    dt_bias: Tensor,
    A: Tensor,
    D: Tensor,
    chunk_size: int,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    activation: str | None = "silu",
    rmsnorm_weight: Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: Tensor | None = None,
    outproj_bias: Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    state_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The whole Mamba-2 mixer from in_proj's output on; a drop-in for mamba_ssm's
    `mamba_split_conv1d_scan_combined`, composed of ssmops operators (differentiable,
    compiles with `fullgraph=True`, exports).

    zxbcdt: (batch, seqlen, 2 * d_mlp + 2 * dim + 2 * ngroups * dstate + nheads), split as
    [z0, x0, z, xBC, dt] with dim = nheads * headdim; conv1d_weight: (dim + 2 * ngroups *
    dstate, width) or with a middle 1; D: (nheads, headdim), or (nheads,) with `headdim` given;
    A, dt_bias: (nheads,); rmsnorm_weight: (dim,); outproj_weight: (out_dim, 2 * ...). Computes::

        xBC = act(causal_conv1d_fn(xBC))  (not across seq_idx boundaries);  x, B, C = split(xBC)
        y   = mamba_chunk_scan_combined(x, dt, A, B, C, D, z if no rmsnorm, dt_bias, softplus)
        y   = rmsnorm_fn(y, rmsnorm_weight, z, group_size=dim // ngroups, norm_before_gate)
        out = out_proj(cat([silu(z0) * x0, y]))

    Returns out, and the float32 final states (batch, nheads, headdim, dstate) when
    `return_final_states`."""
    if D.dim() == 1:
        if headdim is None:
            raise ValueError(f"headdim must be given when D is 1-D, got D of shape {tuple(D.shape)}")
        nheads = D.shape[0]
    else:
        nheads, headdim = D.shape
    dim = nheads * headdim
    conv_dim = conv1d_weight.shape[0]
    dstate = (conv_dim - dim) // (2 * ngroups)
    if dstate <= 0 or conv_dim != dim + 2 * ngroups * dstate:
        raise ValueError(f"conv1d_weight must have dim + 2 * ngroups * dstate rows (dim {dim}, ngroups "
                         f"{ngroups}), got shape {tuple(conv1d_weight.shape)}")
    if zxbcdt.dim() != 3:
        raise ValueError(f"zxbcdt must be (batch, seqlen, features), got shape {tuple(zxbcdt.shape)}")
    d_mlp2 = zxbcdt.shape[-1] - (dim + conv_dim + nheads)
    if d_mlp2 < 0 or d_mlp2 % 2:
        raise ValueError(f"zxbcdt's last dimension must be 2 * d_mlp + {dim + conv_dim + nheads} "
                         f"(z, xBC, dt), got {zxbcdt.shape[-1]}")
    zx0, z, xBC, dt = torch.split(zxbcdt, [d_mlp2, dim, conv_dim, nheads], dim=-1)
    # xBC (batch, seqlen, conv_dim) is the conv's channel-last x: read in place, out in the same layout
    xBC = causal_conv1d_fn(xBC.mT, conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation).mT
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    z = z.unflatten(-1, (nheads, headdim))
    scanned = mamba_chunk_scan_combined(
        x.unflatten(-1, (nheads, headdim)), dt, A, B.unflatten(-1, (ngroups, dstate)),
        C.unflatten(-1, (ngroups, dstate)), chunk_size, D=D, z=z if rmsnorm_weight is None else None,
        dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states, state_dtype=state_dtype,
    )
    y, final_states = scanned if return_final_states else (scanned, None)
    y = y.flatten(-2)
    if rmsnorm_weight is not None:
        y = rmsnorm_fn(y, rmsnorm_weight, None, z=z.flatten(-2), eps=rmsnorm_eps, group_size=dim // ngroups,
                       norm_before_gate=norm_before_gate)
    if d_mlp2:
        z0, x0 = zx0.chunk(2, dim=-1)
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final_states) if return_final_states else y
