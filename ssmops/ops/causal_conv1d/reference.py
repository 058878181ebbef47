"""The causal depthwise conv in plain PyTorch, timestep by timestep: the oracle its backends are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    silu: bool = False,
) -> tuple[Tensor, Tensor]:
    """x (batch, dim, seqlen), weight (dim, width), bias (dim,), seq_idx (batch, seqlen), initial_states
    (batch, dim, width - 1); returns (out (batch, dim, seqlen), final_states (batch, dim,
    width - 1)), both in x's dtype, computed in float32::

        stream = cat(initial_states or zeros, x)     (the initial states are in token 0's sequence)
        pre_t  = bias + sum_k weight[:, k] * stream[t + k] over the k with seq of t + k == seq of t
        out_t  = silu(pre_t) if silu else pre_t
        final_states = the last width - 1 entries of stream, those outside the last token's sequence zeroed
    """
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    w = weight.float()
    init = x.new_zeros(batch, dim, width - 1) if initial_states is None else initial_states
    stream = torch.cat([init.float(), x.float()], dim=-1)  # (batch, dim, width - 1 + seqlen)
    seq = torch.zeros(batch, seqlen, dtype=torch.long) if seq_idx is None else seq_idx.long().cpu()
    stream_seq = torch.cat([seq[:, :1].expand(batch, width - 1), seq], dim=-1).to(x.device)
    outs = []
    for t in range(seqlen):
        pre = torch.zeros(batch, dim, device=x.device) if bias is None else bias.float().expand(batch, dim)
        for k in range(width):
            same = (stream_seq[:, t + k] == stream_seq[:, t + width - 1])[:, None]
            pre = pre + torch.where(same, w[:, k] * stream[:, :, t + k], 0.0)  # (selected: 0 * NaN is NaN)
        outs.append(F.silu(pre) if silu else pre)
    out = torch.stack(outs, dim=-1) if outs else stream[:, :, :0]
    in_last = (stream_seq[:, seqlen:] == stream_seq[:, -1:])[:, None]  # (batch, 1, width - 1)
    final_states = torch.where(in_last, stream[:, :, seqlen:], 0.0)
    return out.to(x.dtype), final_states.to(x.dtype)


def causal_conv1d_update_ref(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    silu: bool = False,
    cache_seqlens: Tensor | None = None,
    conv_state_indices: Tensor | None = None,
) -> Tensor:
    """The decoding step, token by token: x (batch, dim, seqlen) or (batch, dim); conv_state (cache_size, dim,
    state_len), UPDATED IN PLACE in its dtype; returns the conv's output in x's shape and dtype.

    Each token's window is the width - 1 stream entries before it and the token itself. Without
    cache_seqlens the state holds the last state_len entries of the stream, oldest first (each token
    shifts it left by one); with cache_seqlens it is a circular buffer: stream position p lives in slot
    p % state_len, and batch row b's tokens are positions cache_seqlens[b], cache_seqlens[b] + 1, ...
    conv_state_indices picks each row's cache entry; a negative one is padding (output 0, nothing written).
    """
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    batch, dim, seqlen = x.shape
    width, state_len = weight.shape[1], conv_state.shape[-1]
    out = torch.zeros(batch, dim, seqlen, device=x.device)
    for b in range(batch):
        row = b if conv_state_indices is None else int(conv_state_indices[b])
        if row < 0:
            continue
        state = conv_state[row].float()
        circular = cache_seqlens is not None
        position = int(cache_seqlens[b]) if circular else state_len  # the stream position of token 0
        for t in range(seqlen):
            p = position + t
            window = [state[:, (p - j) % state_len] if circular else state[:, state_len - j] for j in
                      range(width - 1, 0, -1)] + [x[b, :, t].float()]
            pre = sum(weight[:, k].float() * window[k] for k in range(width))
            if bias is not None:
                pre = pre + bias.float()
            out[b, :, t] = F.silu(pre) if silu else pre
            if circular:
                state[:, p % state_len] = x[b, :, t].float()
            else:
                state = torch.cat([state[:, 1:], x[b, :, t, None].float()], dim=-1)
        conv_state[row] = state.to(conv_state.dtype)
    out = out.to(x.dtype)
    return out.squeeze(-1) if squeeze else out
