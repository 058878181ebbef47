"""A small model calling ssmops, shaped like a Mamba mixer, for compile/export tests."""

from __future__ import annotations

import torch
from torch import nn

import ssmops


class TinyScanModel(nn.Module):
    """x (batch, dim, seqlen) -> y (batch, dim, seqlen) through projections and a scan.

    With `full=True` every optional argument is used (D, z, delta_bias, initial_state,
    grouped B/C); with `full=False` none is (constant-free minimal call).
    """

    def __init__(self, dim: int = 8, dstate: int = 4, groups: int = 2, full: bool = True):
        super().__init__()
        self.full, self.groups, self.dstate = full, groups, dstate
        self.delta_proj = nn.Linear(dim, dim)
        self.bc_proj = nn.Linear(dim, 2 * groups * dstate)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, dstate + 1).float()).repeat(dim, 1))
        self.D = nn.Parameter(torch.ones(dim))
        self.delta_bias = nn.Parameter(torch.full((dim,), -1.0))
        self.h0 = nn.Parameter(torch.zeros(1, dim, dstate).normal_(0, 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, dim, seqlen = x.shape
        xt = x.transpose(1, 2)  # (batch, seqlen, dim) for the projections, as in Mamba
        delta = self.delta_proj(xt).transpose(1, 2)
        BC = self.bc_proj(xt).transpose(1, 2).reshape(batch, 2, self.groups, self.dstate, seqlen)
        B, C = BC.unbind(1)
        A = -torch.exp(self.A_log)
        if not self.full:
            return ssmops.selective_scan_fn(x, delta.sigmoid(), A, B[:, 0], C[:, 0])
        y, last = ssmops.selective_scan_fn(
            x, delta, A, B, C, self.D, z=x.flip(-1), delta_bias=self.delta_bias, delta_softplus=True,
            return_last_state=True, initial_state=self.h0.expand(batch, -1, -1),
        )
        return y + last.sum(-1, keepdim=True).to(y.dtype)
