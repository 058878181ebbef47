"""The causal depthwise conv in pure PyTorch, any device: the `default` backend's kernels.

Shift and add over time, vectorised over batch and channels, in float32: tap k of output t reads
stream entry t + k (stream = initial states, then x). The work runs in x's own layout (time last for
a channel-first x, time in the middle for a channel-last one, where each tap reads contiguous rows), so
no layout is transposed into the other; outputs are written in x's layout (schema.empty_like_x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check_cache_indices
from .checks import check_conv_grad_inputs, check_conv_inputs, check_update_inputs
from .schema import absent, empty_like_x, is_channel_last


class _Layout:
    """x's layout: the axis of time in the working view (2 for (batch, dim, seqlen), 1 for a channel-last x
    seen as (batch, seqlen, dim)) and the conversions of the (batch, dim, *) tensors into it and back."""

    def __init__(self, x: Tensor):
        self.time = 1 if is_channel_last(x) else 2

    def view(self, t: Tensor) -> Tensor:  # (batch, dim, n) -> the working view
        return t.transpose(1, 2) if self.time == 1 else t

    def back(self, t: Tensor) -> Tensor:  # the working view -> (batch, dim, n)
        return t.transpose(1, 2) if self.time == 1 else t

    def channels(self, v: Tensor) -> Tensor:  # (dim,) broadcast over the view
        return v if self.time == 1 else v[:, None]

    def per_token(self, mask: Tensor) -> Tensor:  # (batch, n) -> broadcast over channels
        return mask.unsqueeze(3 - self.time)


def _stream(x: Tensor, initial_states: Tensor | None, width: int, layout: _Layout) -> Tensor:
    """cat(initial states or zeros, x) along time, float32, in the working view."""
    xv = layout.view(x).float()
    if initial_states is None:
        pad = [0, 0, width - 1, 0] if layout.time == 1 else [width - 1, 0]
        return F.pad(xv, pad)
    return torch.cat([layout.view(initial_states).float(), xv], dim=layout.time)


def _same_sequence(seq_idx: Tensor | None, width: int, seqlen: int) -> tuple[list, Tensor | None]:
    """For each tap k < width - 1, whether stream entry t + k is in token t's sequence, (batch, seqlen);
    and whether each of the last width - 1 stream entries is in the last token's (batch, width - 1).
    None for all of them without seq_idx."""
    if seq_idx is None:
        return [None] * (width - 1), None
    stream_seq = torch.cat([seq_idx[:, :1].expand(-1, width - 1), seq_idx], dim=1)
    taps = [stream_seq[:, k:k + seqlen] == seq_idx for k in range(width - 1)]
    return taps, stream_seq[:, seqlen:] == seq_idx[:, -1:]


def _pre_activation(stream: Tensor, weight: Tensor, bias: Tensor | None, masks: list, seqlen: int,
                    layout: _Layout) -> Tensor:
    width = weight.shape[1]
    w = weight.float()
    current = stream.narrow(layout.time, width - 1, seqlen)  # always in its own sequence
    pre = current * layout.channels(w[:, width - 1])
    if bias is not None:
        pre += layout.channels(bias.float())
    for k, mask in enumerate(masks):
        window = stream.narrow(layout.time, k, seqlen)
        if mask is not None:  # selected, not multiplied: an earlier sequence's NaN must not reach (0 * NaN)
            window = torch.where(layout.per_token(mask), window, 0.0)
        pre.addcmul_(window, layout.channels(w[:, k]))
    return pre


def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, silu):
    batch, dim, seqlen, width = check_conv_inputs(x, weight, bias, seq_idx, initial_states)
    layout = _Layout(x)
    stream = _stream(x, initial_states, width, layout)
    masks, final_mask = _same_sequence(seq_idx, width, seqlen)
    pre = _pre_activation(stream, weight, bias, masks, seqlen, layout)
    out = F.silu(pre) if silu else pre
    final = stream.narrow(layout.time, seqlen, width - 1)
    if final_mask is not None:
        final = torch.where(layout.per_token(final_mask), final, 0.0)
    return (empty_like_x(x).copy_(layout.back(out)),
            x.new_empty(batch, dim, width - 1).copy_(layout.back(final)))


def causal_conv1d_bwd(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu):
    dims = check_conv_inputs(x, weight, bias, seq_idx, initial_states)
    check_conv_grad_inputs(dims, x, dout, dfinal_states)
    batch, dim, seqlen, width = dims
    layout = _Layout(x)
    stream = _stream(x, initial_states, width, layout)
    masks, final_mask = _same_sequence(seq_idx, width, seqlen)
    dpre = layout.view(dout).float()
    if silu:  # silu'(p) = s (1 + p (1 - s)), s = sigmoid(p)
        pre = _pre_activation(stream, weight, bias, masks, seqlen, layout)
        s = torch.sigmoid(pre)
        dpre = dpre * s * (1 + pre * (1 - s))
    w = weight.float()
    dstream = torch.zeros_like(stream)
    dweight = torch.empty(dim, width, device=x.device)
    reduce = (0, layout.time)
    for k, mask in enumerate(masks + [None]):
        grad = dpre if mask is None else torch.where(layout.per_token(mask), dpre, 0.0)
        dstream.narrow(layout.time, k, seqlen).addcmul_(grad, layout.channels(w[:, k]))
        product = grad * stream.narrow(layout.time, k, seqlen)  # (an entry of another sequence may be NaN)
        dweight[:, k] = (product if mask is None else torch.where(layout.per_token(mask), product, 0.0)).sum(reduce)
    if dfinal_states is not None:
        dfinal = layout.view(dfinal_states).float()
        if final_mask is not None:
            dfinal = torch.where(layout.per_token(final_mask), dfinal, 0.0)
        dstream.narrow(layout.time, seqlen, width - 1).add_(dfinal)
    dx = empty_like_x(x).copy_(layout.back(dstream.narrow(layout.time, width - 1, seqlen)))
    dbias = absent(x) if bias is None else dpre.sum(reduce).to(bias.dtype)
    dinitial_states = absent(x) if initial_states is None else \
        initial_states.new_empty(initial_states.shape).copy_(layout.back(dstream.narrow(layout.time, 0, width - 1)))
    return dx, dweight.to(weight.dtype), dbias, dinitial_states


def causal_conv1d_update(x, conv_state, weight, bias, cache_seqlens, conv_state_indices, silu):
    """Every token of x (batch, dim, seqlen) through the conv from conv_state, which is updated in place."""
    batch, dim, seqlen, width, state_len, cache_size = check_update_inputs(
        x, conv_state, weight, bias, cache_seqlens, conv_state_indices)
    if not torch.compiler.is_compiling():  # reads the indices' values: not while traced (ssmops.onnx traces this)
        check_cache_indices("conv_state_indices", conv_state_indices, cache_size, "conv_state")
    if conv_state_indices is None:
        rows, valid = conv_state, None
    else:
        # negative (or, unchecked under a CUDA graph's capture, past the cache): a padding row, left alone
        valid = (conv_state_indices >= 0) & (conv_state_indices < cache_size)
        rows = conv_state[conv_state_indices.clamp(0, cache_size - 1).long()]
    state, xf = rows.float(), x.float()
    if cache_seqlens is None:  # the state holds the stream's last state_len entries, oldest first
        before = state[:, :, state_len - (width - 1):]
        new_state = torch.cat([state, xf], dim=-1)[:, :, -state_len:]
    else:  # a circular buffer: stream position p in slot p % state_len
        start = cache_seqlens.long()[:, None]
        read = torch.remainder(start + torch.arange(-(width - 1), 0, device=x.device), state_len)
        before = state.gather(2, read[:, None, :].expand(-1, dim, -1))
        kept = min(seqlen, state_len)  # the tokens that stay in the buffer (earlier ones are overwritten)
        write = torch.remainder(start + torch.arange(seqlen - kept, seqlen, device=x.device), state_len)
        new_state = state.scatter(2, write[:, None, :].expand(-1, dim, -1), xf[:, :, seqlen - kept:])
    window = torch.cat([before, xf], dim=-1)  # (batch, dim, width - 1 + seqlen)
    w = weight.float()
    out = window[:, :, width - 1:] * w[:, width - 1, None]
    for k in range(width - 1):
        out.addcmul_(window[:, :, k:k + seqlen], w[:, k, None])
    if bias is not None:
        out += bias.float()[:, None]
    if silu:
        out = F.silu(out)
    if valid is None:
        conv_state.copy_(new_state)
    else:
        conv_state.index_copy_(0, conv_state_indices[valid].long(), new_state[valid].to(conv_state.dtype))
        out = torch.where(valid[:, None, None], out, 0.0)
    return out.to(x.dtype)
