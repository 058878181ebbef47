"""What users without a native kernel run today, written the way those projects work.

* `ref_loop_scan`: like mamba_ssm's `selective_scan_ref` — materialise exp(delta*A)
  and delta*B*u for the whole sequence as (batch, dim, seqlen, dstate), then one
  Python step per timestep; its backward is autograd through that loop.
* `pscan_scan`: like mambapy's `pscan` — materialise the same two tensors as
  (batch, seqlen, dim, dstate), then a Blelloch up-sweep/down-sweep over the whole
  (power-of-two padded) sequence, in place, with a hand-written backward that runs
  the same scan in reverse.

Variable B/C `(batch, dstate, seqlen)`, D, z-free, softplus: the shapes the benchmarks use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ref_loop_scan(u, delta, A, B, C, D, delta_bias):
    dt = F.softplus(delta + delta_bias[:, None])
    decay = torch.exp(torch.einsum("bdl,dn->bdln", dt, A))
    drive = torch.einsum("bdl,bnl,bdl->bdln", dt, B, u)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = decay[:, :, t] * h + drive[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=2) + D[:, None] * u


def _blelloch_(a, x):
    """In place over dim 1 (a power of two): x_t <- a_t * x_{t-1} + x_t; a is clobbered."""
    L = x.shape[1]
    levels = L.bit_length() - 1
    for k in range(levels):  # up-sweep: each right child absorbs its left sibling
        s = 1 << k
        ak, xk = a[:, s - 1 :: s], x[:, s - 1 :: s]
        xk[:, 1::2].add_(ak[:, 1::2] * xk[:, 0::2])
        ak[:, 1::2].mul_(ak[:, 0::2])
    for k in range(levels - 2, -1, -1):  # down-sweep: left children take their prefix
        s = 1 << k
        ak, xk = a[:, s - 1 :: s], x[:, s - 1 :: s]
        xk[:, 2::2].add_(ak[:, 2::2] * xk[:, 1:-1:2])


class _PScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, decay, drive):  # (b, L, d, n), L a power of two
        h = drive.clone()
        _blelloch_(decay.clone(), h)
        ctx.save_for_backward(decay, h)
        return h

    @staticmethod
    def backward(ctx, dh):
        decay, h = ctx.saved_tensors
        # g_t = dh_t + decay_{t+1} g_{t+1}: the same scan, reversed in time
        shifted = torch.zeros_like(decay)
        shifted[:, :-1] = decay[:, 1:]
        g = dh.flip(1).contiguous()
        _blelloch_(shifted.flip(1).contiguous(), g)
        g = g.flip(1)
        h_prev = torch.zeros_like(h)
        h_prev[:, 1:] = h[:, :-1]
        return g * h_prev, g


def pscan_scan(u, delta, A, B, C, D, delta_bias):
    seqlen = u.shape[2]
    padded = 1 << max(seqlen - 1, 1).bit_length()
    dt = F.softplus(delta + delta_bias[:, None]).transpose(1, 2)  # (b, l, d)
    decay = torch.exp(dt.unsqueeze(-1) * A)  # (b, l, d, n)
    drive = (dt * u.transpose(1, 2)).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(2)
    pad = (0, 0, 0, 0, 0, padded - seqlen)
    h = _PScan.apply(F.pad(decay, pad, value=1.0), F.pad(drive, pad))[:, :seqlen]
    y = torch.matmul(h, C.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)
    return y + D[:, None] * u


def mambapy_scan():
    """mambapy's own pscan as a scan function, or None where mambapy is not installed."""
    try:
        from mambapy.pscan import pscan
    except ImportError:
        return None

    def scan(u, delta, A, B, C, D, delta_bias):
        dt = F.softplus(delta + delta_bias[:, None]).transpose(1, 2)  # (b, l, d)
        decay = torch.exp(dt.unsqueeze(-1) * A)
        drive = (dt * u.transpose(1, 2)).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(2)
        h = pscan(decay, drive)  # (b, l, d, n)
        y = (h @ C.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)
        return y + D[:, None] * u

    return scan
