"""The selective scan in plain PyTorch: the executable form of the contract (docs/design.md).

Slow and obvious on purpose (one Python step per timestep over the whole
`(batch, dim, seqlen, dstate)` tensors); every fast backend is tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _expand_bc(M: Tensor, batch: int, dim: int, seqlen: int, dtype: torch.dtype) -> Tensor:
    """B or C in any accepted layout, as `(batch, dim, dstate, seqlen)` of `dtype`."""
    if dtype.is_complex and M.dim() > 2:  # real, (re, im) pairs interleaved along 2 * seqlen
        M = torch.view_as_complex(M.to(dtype.to_real()).unflatten(-1, (seqlen, 2)).contiguous())
    M = M.to(dtype)
    if M.dim() == 2:  # (dim, dstate): the same for every batch and timestep
        return M[None, :, :, None].expand(batch, dim, M.shape[1], seqlen)
    if M.dim() == 3:  # (batch, dstate, seqlen): shared by every channel
        M = M.unsqueeze(1)
    groups = M.shape[1]  # (batch, groups, dstate, seqlen): dim // groups channels each
    return M.repeat_interleave(dim // groups, dim=1)


def selective_scan_ref(
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
    """Reference selective scan; same signature and results as `selective_scan_fn`.

    u, delta, z: (batch, dim, seqlen); A: (dim, dstate);
    B, C: (dim, dstate) | (batch, dstate, seqlen) | (batch, groups, dstate, seqlen);
    D, delta_bias: (dim,); initial_state: (batch, dim, dstate) of A's dtype.
    Returns y (dtype of u), and the last state (float32, complex64 for complex A) when
    `return_last_state`. Computes in float32 (float64 when u is float64, for gradcheck).

    Complex A (mamba_ssm's complex mode): the state, a constant B/C and initial_state are
    complex; a variable B/C is real with `2 * seqlen` entries along time, the real and
    imaginary parts of each step interleaved; y_t = 2 Re(sum_n h_t[n] C_t[n]) (the state's
    conjugate pair is implied), then D and the gate as in the real case.
    """
    dtype_in = u.dtype
    compute = torch.float64 if dtype_in == torch.float64 else torch.float32
    if A.is_complex():
        compute = compute.to_complex()  # the state's dtype; u, delta, D and z stay real
    batch, dim, seqlen = u.shape
    real = compute.to_real()
    u, delta = u.to(real), delta.to(real)
    if delta_bias is not None:
        delta = delta + delta_bias.to(real)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    Bx = _expand_bc(B, batch, dim, seqlen, compute)
    Cx = _expand_bc(C, batch, dim, seqlen, compute)

    decay = torch.exp(delta[:, :, :, None] * A.to(compute)[None, :, None, :])  # (b, d, l, n)
    drive = (delta * u)[:, :, :, None] * Bx.permute(0, 1, 3, 2)  # (b, d, l, n)
    h = (
        initial_state.to(compute)
        if initial_state is not None
        else u.new_zeros(batch, dim, A.shape[1], dtype=compute)
    )
    ys = []
    for t in range(seqlen):
        h = decay[:, :, t] * h + drive[:, :, t]
        ys.append((h * Cx[:, :, :, t]).sum(-1))
    y = torch.stack(ys, dim=2)
    if y.is_complex():
        y = 2 * y.real
    if D is not None:
        y = y + D.to(real)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(real))
    y = y.to(dtype_in)
    return (y, h) if return_last_state else y
