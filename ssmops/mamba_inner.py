"""`mamba_inner_fn`: the Mamba mixer between in_proj and out_proj, as mamba_ssm computes it.

Plain PyTorch around the scan operator, so it is differentiable (the scan's backward is
an operator), compiles with `fullgraph=True` and exports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .causal_conv1d import causal_conv1d_fn
from .selective_scan import selective_scan_fn


def _scan_layout(M: Tensor, A: Tensor) -> Tensor:
    """x_proj's B or C columns (batch, seqlen, d_state) as the scan's variable B/C: (batch, d_state,
    seqlen), or, for complex A, (batch, d_state / 2, 2 * seqlen) with each step's (re, im) adjacent."""
    if not A.is_complex():
        return M.transpose(1, 2)
    batch, seqlen, _ = M.shape
    return M.unflatten(-1, (-1, 2)).permute(0, 2, 1, 3).reshape(batch, -1, 2 * seqlen)


def mamba_inner_fn(
    xz: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor | None,
    x_proj_weight: Tensor,
    delta_proj_weight: Tensor,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    A: Tensor,
    B: Tensor | None = None,
    C: Tensor | None = None,
    D: Tensor | None = None,
    delta_bias: Tensor | None = None,
    B_proj_bias: Tensor | None = None,
    C_proj_bias: Tensor | None = None,
    delta_softplus: bool = True,
) -> Tensor:
    """mamba_ssm's `mamba_inner_fn`: same signature, same result, differentiable.

    xz: (batch, 2 * d_inner, seqlen), the output of in_proj with x and z stacked on dim 1;
    conv1d_weight: (d_inner, 1, d_conv); x_proj_weight: (dt_rank + 2 * d_state, d_inner);
    delta_proj_weight: (d_inner, dt_rank); out_proj_weight: (d_model, d_inner);
    A: (d_inner, d_state) float32; B, C: None (taken from x_proj, the usual case) or any
    layout `selective_scan_fn` accepts; D, delta_bias: (d_inner,); B_proj_bias,
    C_proj_bias: (d_state,). Returns (batch, seqlen, d_model)::

        x, z  = xz.chunk(2, dim=1)
        x     = silu(causal_conv1d(x) + conv1d_bias)
        dt, B, C = split(x_proj(x), [dt_rank, d_state, d_state])
        y     = selective_scan_fn(x, delta_proj(dt), A, B, C, D, z, delta_bias, delta_softplus)
        out   = out_proj(y)

    With complex A (d_inner, n) complex64, as in mamba_ssm, d_state = 2 * n: x_proj's B and C
    columns are n (re, im) pairs, and become (batch, n, 2 * seqlen) with each step's pair
    interleaved along time, the layout `selective_scan_fn` takes for a complex A's B/C.
    """
    dt_rank = delta_proj_weight.shape[1]
    d_state = A.shape[-1] * (2 if A.is_complex() else 1)
    x, z = xz.chunk(2, dim=1)
    x = causal_conv1d_fn(x, conv1d_weight, conv1d_bias, activation="silu")
    x_dbl = F.linear(x.transpose(1, 2), x_proj_weight)  # (batch, seqlen, dt_rank + 2 * d_state)
    delta = F.linear(x_dbl[..., :dt_rank], delta_proj_weight).transpose(1, 2)  # (batch, d_inner, seqlen)
    if B is None:
        B = x_dbl[..., dt_rank : dt_rank + d_state]
        if B_proj_bias is not None:
            B = B + B_proj_bias.to(B.dtype)
        B = _scan_layout(B, A)
    if C is None:
        C = x_dbl[..., x_dbl.shape[-1] - d_state :]
        if C_proj_bias is not None:
            C = C + C_proj_bias.to(C.dtype)
        C = _scan_layout(C, A)
    y = selective_scan_fn(
        x, delta, A, B, C,
        D=None if D is None else D.float(),
        z=z,
        delta_bias=None if delta_bias is None else delta_bias.float(),
        delta_softplus=delta_softplus,
    )
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)
