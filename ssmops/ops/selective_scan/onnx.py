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
# steps, but indexing a block's steps and stacking its states are copies of the (BLOCK, batch, dstate,
# dim) operands. On a VMamba-style model (batch 8, 384 channels, 256 steps, onnxruntime, 1 thread, a
# loaded 2-vCPU machine) 4 took 0.41-0.50 s a batch, 1 0.52 s, 8 0.54 s, 16 0.68 s.
BLOCK = 4


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
    B_variable, C_variable = B.dim() > 2, C.dim() > 2
    # channel groups sharing a variable B/C row (the checks made a variable B's and C's agree)
    G = max(M.shape[1] if M.dim() == 4 else 1 for M in (B, C))
    dg = dim // G
    # At least two blocks: a symbolic count whose example value is 1 would be specialised by export
    padded = torch.sym_max((seqlen + BLOCK - 1) // BLOCK, 2) * BLOCK

    dt = delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    uf = u.float()

    # The state is laid out (batch, dstate, G, dim // G): channels innermost, so that every product
    # broadcasts a B/C value over a contiguous run of channels, which runtimes do fast (an outer
    # product over the last two dimensions goes element by element in onnxruntime's Mul, ~10x slower).
    def variable(M: Tensor) -> Tensor:
        # (batch, [G,] dstate, seqlen) -> (nblocks, BLOCK, batch, dstate, G, 1)
        M = M.float().reshape(batch, -1, dstate, seqlen).expand(batch, G, dstate, seqlen)
        return _blocks(M, padded).transpose(-1, -2).unsqueeze(-1)

    def constant(M: Tensor) -> Tensor:
        return M.float().t().reshape(dstate, G, dg).contiguous()  # (dstate, G, dim // G)

    # The body closes over contiguous constants and Python flags only (not over the inputs, whose
    # symbolic strides its trace would have to guard on)
    xs = [_blocks(dt, padded), _blocks(uf, padded)]
    xs += [variable(B)] if B_variable else []
    xs += [variable(C)] if C_variable else []
    A_t = constant(A)
    B_const = None if B_variable else constant(B)
    C_const = None if C_variable else constant(C)

    def step(h: Tensor, blk: list[Tensor]):
        # h: (batch, dstate, G, dg); a block's dt, u: (BLOCK, batch, dim), B/C (BLOCK, batch, dstate, G, 1)
        dt_b, u_b = (t.reshape(BLOCK, batch, 1, G, dg) for t in blk[:2])
        decay = torch.exp(dt_b * A_t)  # (BLOCK, batch, dstate, G, dg)
        drive = (dt_b * u_b) * (blk[2] if B_variable else B_const)
        states = []
        for t in range(BLOCK):
            h = decay[t] * h + drive[t]
            states.append(h)
        H = torch.stack(states)  # (BLOCK, batch, dstate, G, dg)
        y = (H * (blk[-1] if C_variable else C_const)).sum(2)
        return h, y.reshape(BLOCK, batch, dim)

    h0 = (initial_state.float().transpose(1, 2).reshape(batch, dstate, G, dg).contiguous()
          if initial_state is not None else u.new_zeros(batch, dstate, G, dg, dtype=torch.float32))
    h, ys = scan(step, h0, xs)
    last_state = h.reshape(batch, dstate, dim).transpose(1, 2).contiguous()
    # the padding cut off by a negative pad, not a slice: export cannot prove seqlen <= padded for a slice
    y = F.pad(ys.flatten(0, 1).permute(1, 2, 0), (0, seqlen - padded))  # (batch, dim, seqlen)
    if D is not None:
        y = y + D.float()[:, None] * uf
    out = y.to(u.dtype)
    out_z = (y * F.silu(z.float())).to(u.dtype) if z is not None else u.new_empty(0)
    intermediates = u.new_zeros(batch, dim, num_chunks(seqlen) * 2 * dstate, dtype=torch.float32)
    return out, intermediates, out_z, last_state
