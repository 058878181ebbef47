"""Small models calling ssmops, shaped like Mamba mixers, for compile/export tests."""

from __future__ import annotations

import torch
from torch import nn

import ssmops
from ssmops.mamba_inner import _scan_layout


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


class TinySsdModel(nn.Module):
    """x (batch, seqlen, d_model) -> (batch, seqlen, d_model) through projections and the SSD scan
    (Mamba-2's), every optional argument used with `full=True` (D per channel, z, dt_bias,
    softplus, a dt_limit, learned initial states, the final states), none with `full=False`."""

    def __init__(self, d_model: int = 8, nheads: int = 4, headdim: int = 4, ngroups: int = 2, dstate: int = 4,
                 chunk_size: int = 16, full: bool = True):
        super().__init__()
        self.full, self.nheads, self.headdim, self.ngroups, self.dstate = full, nheads, headdim, ngroups, dstate
        self.chunk_size = chunk_size
        d_inner = nheads * headdim
        self.in_proj = nn.Linear(d_model, 2 * d_inner + 2 * ngroups * dstate + nheads)
        self.out_proj = nn.Linear(d_inner, d_model)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1, 4, nheads)))
        self.D = nn.Parameter(torch.ones(nheads, headdim))
        self.dt_bias = nn.Parameter(torch.full((nheads,), -1.0))
        self.h0 = nn.Parameter(torch.zeros(1, nheads, headdim, dstate).normal_(0, 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seqlen, _ = x.shape
        d_inner, gn = self.nheads * self.headdim, self.ngroups * self.dstate
        xs, z, B, C, dt = self.in_proj(x).split([d_inner, d_inner, gn, gn, self.nheads], dim=-1)
        xs = xs.reshape(batch, seqlen, self.nheads, self.headdim)
        B, C = (M.reshape(batch, seqlen, self.ngroups, self.dstate) for M in (B, C))
        A = -torch.exp(self.A_log)
        if not self.full:
            y = ssmops.mamba_chunk_scan_combined(xs, dt.sigmoid(), A, B, C, self.chunk_size)
            return self.out_proj(y.reshape(batch, seqlen, d_inner))
        y, final = ssmops.mamba_chunk_scan_combined(
            xs, dt, A, B, C, self.chunk_size, D=self.D, z=z.reshape(xs.shape), dt_bias=self.dt_bias,
            initial_states=self.h0.expand(batch, -1, -1, -1), dt_softplus=True, dt_limit=(0.0, 10.0),
            return_final_states=True,
        )
        return self.out_proj(y.reshape(batch, seqlen, d_inner)) + final.sum((1, 2, 3))[:, None, None]


class TinyComplexScanModel(nn.Module):
    """x (batch, seqlen, dim) -> (batch, seqlen, dim) through mamba_ssm's complex mode of the scan: complex
    A and constant C (built from real parameters), a variable real B with (re, im) pairs along time."""

    def __init__(self, dim: int = 8, dstate: int = 4):
        super().__init__()
        self.dstate = dstate
        self.delta_proj = nn.Linear(dim, dim)
        self.b_proj = nn.Linear(dim, 2 * dstate)
        self.A_re = nn.Parameter(-0.5 * torch.arange(1, dstate + 1).float().repeat(dim, 1))
        self.A_im = nn.Parameter(torch.pi * torch.arange(dstate).float().repeat(dim, 1))  # S4D-Lin-like
        self.C_re = nn.Parameter(torch.randn(dim, dstate))
        self.C_im = nn.Parameter(torch.randn(dim, dstate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = self.delta_proj(x).transpose(1, 2)
        A, C = torch.complex(self.A_re, self.A_im), torch.complex(self.C_re, self.C_im)
        B = _scan_layout(self.b_proj(x), A)  # as mamba_inner_fn lays out x_proj's columns for a complex A
        return ssmops.selective_scan_fn(x.transpose(1, 2), delta, A, B, C, delta_softplus=True).transpose(1, 2)


class ScanAndSsdModels(nn.Module):
    """Mamba-1's and Mamba-2's test models, each with every optional argument and with none, and Mamba-1's
    complex mode, side by side on one input (batch, seqlen, 8): one package holds the five calls (a
    package's wrapper is most of its compile, and the five need one)."""

    OUTPUTS = ("scan", "minimal scan", "SSD", "minimal SSD", "complex-A scan")

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scans = nn.ModuleList([TinyScanModel(full=full) for full in (True, False)])
        self.ssds = nn.ModuleList([TinySsdModel(full=full) for full in (True, False)])
        self.complex_scan = TinyComplexScanModel()

    def forward(self, x):
        channels_first = x.transpose(1, 2).contiguous()  # TinyScanModel's layout, (batch, 8, seqlen)
        return (tuple(m(channels_first) for m in self.scans) + tuple(m(x) for m in self.ssds)
                + (self.complex_scan(x),))
