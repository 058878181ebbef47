"""The decoding step in pure PyTorch, any device: the `default` backend's kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_state_update_inputs


def selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    """One step of the recurrence for every (batch, channel): updates `state` in place and
    returns y (batch, dim) in x's dtype. Same arithmetic as one timestep of the scan."""
    batch, dim, n, G = check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    dg = dim // G
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    xf = x.float()
    decay = torch.exp(dt.unsqueeze(-1) * A.float())  # (batch, dim, n)
    Bg = B.float().reshape(batch, G, 1, n)
    drive = ((dt * xf).reshape(batch, G, dg, 1) * Bg).reshape(batch, dim, n)
    new_state = drive.addcmul_(decay, state)
    state.copy_(new_state)
    y = torch.einsum("bgdn,bgn->bgd", new_state.reshape(batch, G, dg, n), C.float().reshape(batch, G, n))
    y = y.reshape(batch, dim)
    if D is not None:
        y = y + D.float() * xf
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
