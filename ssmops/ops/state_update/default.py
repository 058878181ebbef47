"""The decoding step in pure PyTorch, any device: the `default` backend's kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_cache_indices
from .checks import check_multihead_inputs, check_state_update_inputs
from .schema import as_multihead


def selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    """One step of the recurrence for every (batch, channel) of Mamba-1's layout: updates `state`
    in place and returns y (batch, dim) in x's dtype; the multi-head step with one channel a head."""
    check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    heads = as_multihead(state, x, dt, A, B, C, D, z, dt_bias)
    return multihead_state_update(*heads, None, dt_softplus).squeeze(-1)


def _per_channel(t: torch.Tensor, batched: bool) -> torch.Tensor:
    """dt (batch, nheads[, headdim]) or D / dt_bias (nheads[, headdim]) as float32 with a headdim axis."""
    t = t.float()
    return t if t.dim() == (3 if batched else 2) else t.unsqueeze(-1)


def multihead_state_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus):
    """One step for every (batch, head, channel) of Mamba-2's layout: updates the state rows of the
    cache in place, in the state's dtype, and returns y (batch, nheads, headdim) in x's dtype. Mamba-1's
    layout (x (batch, dim)): as heads of headdim 1."""
    if x.dim() == 2:
        check_multihead_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
        heads = as_multihead(state, x, dt, A, B, C, D, z, dt_bias)
        return multihead_state_update(*heads, state_batch_indices, dt_softplus).squeeze(-1)
    batch, nheads, headdim, dstate, ngroups, cache_size = check_multihead_inputs(
        state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    if not torch.compiler.is_compiling():  # reads the indices' values: not while traced (ssmops.onnx traces this)
        check_cache_indices("state_batch_indices", state_batch_indices, cache_size, "state")
    dt = _per_channel(dt, batched=True)  # (batch, nheads, headdim or 1)
    if dt_bias is not None:
        dt = dt + _per_channel(dt_bias, batched=False)
    if dt_softplus:
        dt = F.softplus(dt)
    A = A.float() if A.dim() == 3 else A.float()[:, None, None]  # tied: one decay per head
    decay = torch.exp(dt.unsqueeze(-1) * A)  # (batch, nheads, headdim or 1, dstate or 1)
    per_group = nheads // ngroups
    Bh, Ch = (M.float().repeat_interleave(per_group, dim=1).unsqueeze(2) for M in (B, C))  # (b, h, 1, n)
    xf = x.float()
    if state_batch_indices is None:
        rows, valid = state, None
    else:
        # negative (or, unchecked under a CUDA graph's capture, past the cache): a padding row, left alone
        valid = (state_batch_indices >= 0) & (state_batch_indices < cache_size)
        rows = state[state_batch_indices.clamp(0, cache_size - 1).long()]
    new_rows = (rows.float() * decay).addcmul_((dt * xf).unsqueeze(-1), Bh)
    y = (new_rows * Ch).sum(-1)
    if D is not None:
        y = y + _per_channel(D, batched=False) * xf
    if z is not None:
        y = y * F.silu(z.float())
    if valid is None:
        state.copy_(new_rows)
    else:
        state.index_copy_(0, state_batch_indices[valid].long(), new_rows[valid].to(state.dtype))
        y = torch.where(valid[:, None, None], y, 0.0)
    return y.to(x.dtype)
