"""The gated norms of Mamba-2 (mamba_ssm's `ops.triton.layernorm_gated`), in plain PyTorch.

Plain tensor code: differentiable, compiles into the surrounding graph and exports; the
arithmetic runs in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def layernorm_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    z: Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    is_rms_norm: bool = False,
) -> Tensor:
    """LayerNorm (or RMSNorm when `is_rms_norm`) of x over groups of `group_size` features
    (None: all of the last dimension), scaled by `weight` (+ `bias`), gated by silu(z) after
    the norm when `norm_before_gate`, before it otherwise::

        norm_before_gate: out = norm(x) * silu(z)
        else:             out = norm(x * silu(z))

    x, z: (..., hidden); weight, bias: (hidden,). Returns x's dtype."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    group_size = hidden if group_size is None else group_size
    if group_size <= 0 or hidden % group_size:
        raise ValueError(f"group_size must divide x's last dimension {hidden}, got {group_size}")
    if is_rms_norm and z is None and bias is None and group_size == hidden:
        # the models' plain RMSNorm: one aten operator, the same sums (half the time of the steps
        # below for a decoding token's (1, 768), which it is 25 times a token at mamba-130m's shape)
        return F.rms_norm(x.float(), (hidden,), weight.float(), eps).to(x.dtype)
    out = x.float()
    gate = F.silu(z.float()) if z is not None else None
    if gate is not None and not norm_before_gate:
        out = out * gate
    if hidden != group_size:  # (the views of a strided x's groups: torch 2.11's export cannot prove its own
        # guards on their strides, `1 % min(L, 4 L) != 0` for a transposed (batch, L, hidden) x)
        out = out.contiguous()
    groups = out.unflatten(-1, (hidden // group_size, group_size))
    if is_rms_norm:  # one aten operator for the sums (a decoding token's norm is a chain of tiny calls)
        groups = F.rms_norm(groups, (group_size,), None, eps)
    else:
        groups = groups - groups.mean(-1, keepdim=True)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    out = groups.flatten(-2) * weight.float()
    if bias is not None:
        out = out + bias.float()
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)


def rmsnorm_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    z: Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> Tensor:
    """`layernorm_fn` with is_rms_norm=True: x / sqrt(mean(x^2) + eps) per group, gated."""
    return layernorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm=True)


class RMSNorm(nn.Module):
    """mamba_ssm's gated RMSNorm module (`RMSNormGated` in its Mamba2): `weight` (ones), no
    bias; `forward(x, z=None)` is `rmsnorm_fn` with this module's settings."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        return rmsnorm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                          norm_before_gate=self.norm_before_gate)
