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
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """Same arguments and layouts as `ssmops.selective_state_update`; updates `state` in place (in
    its dtype) and returns y in x's dtype::

        dt    = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias
        state = exp(dt * A) * state + dt * B * x          (B, C: a channel's group's row)
        y     = <state, C> + D * x,  times silu(z) when z is given

    Mamba-2's layout is Mamba-1's with the (head, channel) pairs as channels: a head's group is
    its channels' group. A negative `state_batch_indices` entry is padding: y is 0 there.
    """
    if state.dim() == 4:
        batch, nheads, headdim = x.shape
        dstate = state.shape[-1]

        def per_channel(t: Tensor | None, *lead: int) -> Tensor | None:
            """(*lead, nheads) tied or (*lead, nheads, headdim) -> (*lead, nheads * headdim)."""
            return None if t is None else t.reshape(*lead, nheads, -1).expand(*lead, nheads, headdim).flatten(-2)

        A_channels = A.reshape(nheads, -1, A.shape[-1] if A.dim() == 3 else 1).expand(nheads, headdim, dstate)
        y = selective_state_update_ref(
            state.view(state.shape[0], nheads * headdim, dstate), x.reshape(batch, -1), per_channel(dt, batch),
            A_channels.flatten(0, 1), B, C, per_channel(D), per_channel(z, batch), per_channel(dt_bias),
            dt_softplus, state_batch_indices,
        )
        return y.view(batch, nheads, headdim)
    batch, dim = x.shape
    dstate = state.shape[-1]
    rows = torch.arange(batch, device=x.device) if state_batch_indices is None else state_batch_indices.long()
    valid = rows >= 0
    h = state[rows.clamp(min=0)].float()
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dt = F.softplus(dt)
    B, C = (M.float().reshape(batch, -1, dstate) for M in (B, C))
    B, C = (M.repeat_interleave(dim // M.shape[1], dim=1) for M in (B, C))  # (batch, dim, dstate)
    new_h = torch.exp(dt[..., None] * A) * h + (dt * x.float())[..., None] * B
    state[rows[valid]] = new_h[valid].to(state.dtype)
    y = (new_h * C).sum(-1)
    if D is not None:
        y = y + D.float() * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return torch.where(valid[:, None], y, 0.0).to(x.dtype)
