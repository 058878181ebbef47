"""The decoding step in plain PyTorch, formula by formula: the oracle its backends are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def selective_state_update_ref(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
) -> Tensor:
    """Same arguments as `ssmops.selective_state_update` (3-D state layout); updates `state` in
    place and returns y (batch, dim) in x's dtype::

        dt    = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias
        state = exp(dt * A) * state + dt * B * x          (B, C: a channel's group's row)
        y     = <state, C> + D * x,  times silu(z) when z is given
    """
    batch, dim, dstate = state.shape
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dt = F.softplus(dt)
    B, C = (M.float().reshape(batch, -1, dstate) for M in (B, C))
    B, C = (M.repeat_interleave(dim // M.shape[1], dim=1) for M in (B, C))  # (batch, dim, dstate)
    new_state = torch.exp(dt[..., None] * A) * state + (dt * x.float())[..., None] * B
    state.copy_(new_state)
    y = (new_state * C).sum(-1)
    if D is not None:
        y = y + D.float() * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
