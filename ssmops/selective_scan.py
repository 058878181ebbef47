"""`selective_scan_fn`: mamba_ssm's function of that name, on the ssmops operators."""

from __future__ import annotations

import torch
from torch import Tensor

from ._registry import operator_for
from .ops._autograd import contiguous_when_compiling_backward
from .ops._checks import checked_call
from .ops.selective_scan.checks import check_scan_inputs


def selective_scan_fn(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    initial_state: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Selective scan; a drop-in for `mamba_ssm.ops.selective_scan_interface.selective_scan_fn`.

    u, delta, z: (batch, dim, seqlen) in fp32/fp16/bf16; A: (dim, dstate) float32 or complex64;
    B, C: (dim, dstate) | (batch, dstate, seqlen) | (batch, groups, dstate, seqlen);
    D, delta_bias: (dim,) float32; initial_state: (batch, dim, dstate) of A's dtype
    (an ssmops extension). Computes in float32; returns y in u's dtype, gated by
    SiLU(z) when z is given, plus the last state `(batch, dim, dstate)` (A's dtype) when
    `return_last_state`. Differentiable in every tensor argument, last state included.

    With complex A (mamba_ssm's complex mode) the state is complex, a constant B/C is
    complex64 and a variable one is real with `2 * seqlen` steps along time (the real and
    imaginary parts of each step, interleaved), and y = 2 Re(sum_n h[n] C[n]) + D u.
    The cpu and default backends serve it; the Triton kernels do not (NotImplementedError).
    """
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)

    def scan():
        # (on GPUs the Triton operator itself, so that compiled graphs launch its kernels)
        forward = operator_for("selective_scan_fwd", u)
        return forward(*contiguous_when_compiling_backward(*inputs), delta_softplus)

    out, _, out_z, last_state = checked_call(scan, lambda: check_scan_inputs(*inputs))
    y = out_z if z is not None else out
    return (y, last_state) if return_last_state else y
