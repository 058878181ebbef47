"""The selective scan as standard operators, for ONNX export: a decomposition of
`selective_scan_fwd` into aten ops plus one `scan` over blocks of time.

Mamba-1's decay differs per (channel, state) entry, so the quadratic (attention-like) form that
SSD uses would hold a (T, T) matrix per entry; instead the sequence is cut into blocks of
`BLOCK` steps and `torch._higher_order_ops.scan` (which torch.onnx exports as one ONNX `Scan`)
carries the state from block to block. Inside a block every operand (decays, drives, outputs) is
computed for all its steps at once and the recurrence itself is `BLOCK` multiply-adds on the
(batch, dim, dstate) state, so the graph has a fixed size whatever the sequence length and runs
`max(ceil(seqlen / BLOCK), 2)` iterations. The length is padded to whole blocks with steps that change
nothing (dt = 0: decay 1, no input), so the last state is the state after the last real step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.scan import scan

from .checks import num_chunks

# Steps per scan iteration: an iteration's fixed cost (an ONNX Scan body call) is spread over BLOCK
# steps; the body's graph grows with it (BLOCK multiply-adds on the state).
BLOCK = 16


def _blocks(x: Tensor, padded: int) -> Tensor:
    """(..., seqlen) -> (nblocks, BLOCK, ...): zero-padded to `padded` steps, time-major."""
    x = F.pad(x, (0, padded - x.shape[-1]))
    return x.unflatten(-1, (padded // BLOCK, BLOCK)).movedim((-2, -1), (0, 1))


def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus):
    """`ssmops::selective_scan_fwd` from aten ops and a scan over blocks of time. Real A only;
    `scan_intermediates` is returned as zeros of its shape (it serves only the backward)."""
    if A.is_complex():
        raise NotImplementedError("ONNX export of selective_scan_fwd: a complex A is not supported (ONNX has "
                                  "no complex arithmetic in its standard operators); A must be float32")
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    groups = 1 if B.dim() < 4 else B.shape[1]
    groups_C = 1 if C.dim() < 4 else C.shape[1]
    # At least two blocks: a symbolic count whose example value is 1 would be specialised by export
    padded = torch.sym_max((seqlen + BLOCK - 1) // BLOCK, 2) * BLOCK

    dt = delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    uf = u.float()

    def variable(M: Tensor, g: int) -> Tensor:
        # (batch, [g,] dstate, seqlen) -> (nblocks, BLOCK, batch, g, 1, dstate): one row per channel group
        M = M.float().reshape(batch, g, dstate, seqlen)
        return _blocks(M, padded).unsqueeze(-2)

    def per_group(x: Tensor, g: int) -> Tensor:
        # (nblocks, BLOCK, batch, dim) -> (nblocks, BLOCK, batch, g, dim // g)
        return x.unflatten(-1, (g, dim // g))

    # The body closes over contiguous constants and Python flags only (not over the inputs, whose
    # symbolic strides its trace would have to guard on)
    B_variable, C_variable = B.dim() > 2, C.dim() > 2
    xs = [_blocks(dt, padded), _blocks(uf, padded)]
    xs += [variable(B, groups)] if B_variable else []
    xs += [variable(C, groups_C)] if C_variable else []
    A_f = A.float().contiguous()
    B_const = None if B_variable else B.float().contiguous()
    C_const = None if C_variable else C.float().contiguous()

    def step(h: Tensor, blk: list[Tensor]):
        # h: (batch, dim, dstate); a block's dt, u: (BLOCK, batch, dim), B/C (BLOCK, batch, g, 1, dstate)
        dt_b, u_b = blk[0], blk[1]
        decay = torch.exp(dt_b.unsqueeze(-1) * A_f)  # (BLOCK, batch, dim, dstate)
        dtu = (dt_b * u_b).unsqueeze(-1)
        if B_variable:
            drive = (per_group(dtu.squeeze(-1), groups).unsqueeze(-1) * blk[2]).flatten(2, 3)
        else:
            drive = dtu * B_const
        states = []
        for t in range(BLOCK):
            h = decay[t] * h + drive[t]
            states.append(h)
        H = torch.stack(states)  # (BLOCK, batch, dim, dstate)
        if C_variable:
            y = (H.unflatten(2, (groups_C, dim // groups_C)) * blk[-1]).sum(-1).flatten(2, 3)
        else:
            y = (H * C_const).sum(-1)
        return h, y  # y: (BLOCK, batch, dim)

    h0 = initial_state.float() if initial_state is not None else u.new_zeros(batch, dim, dstate, dtype=torch.float32)
    last_state, ys = scan(step, h0, xs)
    # the padding cut off by a negative pad, not a slice: export cannot prove seqlen <= padded for a slice
    y = F.pad(ys.flatten(0, 1).permute(1, 2, 0), (0, seqlen - padded))  # (batch, dim, seqlen)
    if D is not None:
        y = y + D.float()[:, None] * uf
    out = y.to(u.dtype)
    out_z = (y * F.silu(z.float())).to(u.dtype) if z is not None else u.new_empty(0)
    intermediates = u.new_zeros(batch, dim, num_chunks(seqlen) * 2 * dstate, dtype=torch.float32)
    return out, intermediates, out_z, last_state
