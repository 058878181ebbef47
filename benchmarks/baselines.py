"""What users without a native kernel run today, as its authors published it (benchmarks/peers.py
fetches it at benchmark time), behind the benchmarks' one signature
`scan(u, delta, A, B, C, D, delta_bias) -> y` (variable B/C `(batch, dstate, seqlen)`, D, no z,
softplus on the step):

* `mamba_ssm_ref`: mamba_ssm's `selective_scan_ref`, a Python step per timestep over
  materialised (batch, dim, seqlen, dstate) tensors; its backward is autograd through that loop.
* `mambapy_pscan`: mambapy's `MambaBlock.selective_scan`, its Blelloch `pscan` over
  (batch, seqlen, dim, dstate) tensors with a hand-written backward. Its caller (`MambaBlock.ssm`)
  applies softplus(delta + bias) first; that line is the one done here.
"""

from __future__ import annotations

import torch.nn.functional as F

import peers


def mamba_ssm_ref():
    selective_scan_ref = peers.selective_scan_ref()

    def scan(u, delta, A, B, C, D, delta_bias):
        return selective_scan_ref(u, delta, A, B, C, D, delta_bias=delta_bias, delta_softplus=True)

    return scan


def mambapy_pscan():
    block = peers.mambapy().MambaBlock

    def scan(u, delta, A, B, C, D, delta_bias):
        dt = F.softplus(delta.transpose(1, 2) + delta_bias)  # (batch, seqlen, dim), as MambaBlock.ssm
        # selective_scan reads nothing of its block: called unbound, with its (batch, seqlen, ...) layout
        y = block.selective_scan(None, u.transpose(1, 2), dt, A, B.transpose(1, 2), C.transpose(1, 2), D)
        return y.transpose(1, 2)

    return scan
