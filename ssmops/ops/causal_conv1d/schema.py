"""The causal depthwise conv's operators: schemas, fake kernels and autograd.

    stream = cat(initial_states or zeros, x)                                 (along time)
    pre_t  = bias + sum_k weight[:, k] * stream[t + k] * [seq_idx of t + k == seq_idx of t]
    out_t  = silu(pre_t) if silu else pre_t;   final_states = the last width - 1 entries of stream

with k = 0 .. width - 1 (stream[t + width - 1] is x_t). The initial states belong to the sequence of
token 0 (they are the inputs before it); the final states keep only the entries in the last token's
sequence (zeros elsewhere), so that a continuation of that sequence starts from them.

The C++ library declares the same schemas. Conventions the schemas cannot express:
* `out` and `dx` have x's layout: channel-last (`x.stride(1) == 1`, a transpose of a (batch, seqlen,
  dim) tensor) gives channel-last outputs, anything else contiguous ones; the kernels read x's strides,
  so a channel-last x is never copied into the other layout;
* `final_states` (batch, dim, width - 1) is always returned (contiguous, x's dtype); the gradients
  `dweight`, `dbias` and `dinitial_states` take their inputs' dtypes, and an absent one (no bias, no
  initial_states) is an empty tensor (numel 0) of x's dtype;
* `causal_conv1d_update` is inference only (no autograd) and updates `conv_state` in place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_conv_grad_inputs, check_conv_inputs, check_update_inputs

FWD_SCHEMA = (
    "causal_conv1d_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? seq_idx, Tensor? initial_states, "
    "bool silu) -> (Tensor out, Tensor final_states)"
)
BWD_SCHEMA = (
    "causal_conv1d_bwd(Tensor x, Tensor weight, Tensor? bias, Tensor? seq_idx, Tensor? initial_states, "
    "Tensor dout, Tensor? dfinal_states, bool silu) -> (Tensor dx, Tensor dweight, Tensor dbias, "
    "Tensor dinitial_states)"
)
UPDATE_SCHEMA = (
    "causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor? cache_seqlens, "
    "Tensor? conv_state_indices, bool silu) -> Tensor"
)


def is_channel_last(x: Tensor) -> bool:
    """x (batch, dim, seqlen) is a transposed (batch, seqlen, dim) tensor: dim is its unit-stride axis.
    (Time's stride is tested first: a contiguous x's stride is then the constant 1, not seqlen,
    which torch.compile keeps symbolic.)"""
    return x.stride(2) != 1 and x.stride(1) == 1


def empty_like_x(x: Tensor) -> Tensor:
    """An output of x's shape and dtype in x's layout: channel-last for a channel-last x, else contiguous."""
    batch, dim, seqlen = x.shape
    if is_channel_last(x):
        return x.new_empty(batch, seqlen, dim).transpose(1, 2)
    return x.new_empty(batch, dim, seqlen)


def absent(x: Tensor) -> Tensor:
    """The gradient of an absent optional input."""
    return x.new_empty(0)


# --- fake kernels: exact output shapes, dtypes and layouts, symbolic seqlen included --------


def fwd_fake(x, weight, bias, seq_idx, initial_states, silu):
    batch, dim, _, width = check_conv_inputs(x, weight, bias, seq_idx, initial_states)
    return empty_like_x(x), x.new_empty(batch, dim, width - 1)


def bwd_fake(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu):
    dims = check_conv_inputs(x, weight, bias, seq_idx, initial_states)
    check_conv_grad_inputs(dims, x, dout, dfinal_states)
    return (
        empty_like_x(x), weight.new_empty(weight.shape), absent(x) if bias is None else bias.new_empty(bias.shape),
        absent(x) if initial_states is None else initial_states.new_empty(initial_states.shape),
    )


def update_fake(x, conv_state, weight, bias, cache_seqlens, conv_state_indices, silu):
    check_update_inputs(x, conv_state, weight, bias, cache_seqlens, conv_state_indices)
    return x.new_empty(x.shape)


# --- autograd: the backward is the backward operator ----------------------------------


def autograd_for(bwd_op):
    """(backward, setup_context) for `causal_conv1d_fwd` whose backward is the operator `bwd_op`."""

    def setup_context(ctx, inputs, output):
        x, weight, bias, seq_idx, initial_states, silu = inputs
        ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
        ctx.silu = silu
        ctx.set_materialize_grads(False)  # no zero-filled gradient for unused final states

    def backward(ctx, dout, dfinal_states):
        x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(x)
        dx, dweight, dbias, dinitial_states = bwd_op(x, weight, bias, seq_idx, initial_states, dout, dfinal_states,
                                                     ctx.silu)
        return (dx, dweight, dbias if bias is not None else None, None,
                dinitial_states if initial_states is not None else None, None)

    return backward, setup_context
