"""Argument checks of the causal depthwise conv (`causal_conv1d_fwd`, `_bwd`, `_update`).

Each failure names the argument, what it got and what was expected (see ssmops/ops/_checks.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import INPUT_DTYPES, check_leading, check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)


class ConvDims(NamedTuple):
    batch: int
    dim: int
    seqlen: int
    width: int


def _check_weight(weight, dim: int, device) -> int:
    """weight (dim, width) with width >= 1, any float dtype; returns width."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.shape[0] != dim or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape (dim, width) with dim={dim} and width >= 1, got "
                         f"{tuple(weight.shape)}")
    check_tensor("weight", weight, INPUT_DTYPES, tuple(weight.shape), device, like="x")
    return weight.shape[1]


def check_conv_inputs(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None,
                      initial_states: Tensor | None) -> ConvDims:
    """Validates the inputs of `causal_conv1d_fwd` and returns their sizes.

    x: (batch, dim, seqlen) fp32/fp16/bf16, any strides (channel-last included); weight: (dim, width)
    and bias: (dim,), each fp32/fp16/bf16; seq_idx: (batch, seqlen) int32/int64; initial_states:
    (batch, dim, width - 1) in x's dtype.
    """
    check_leading("x", x, "(batch, dim, seqlen)")
    batch, dim, seqlen = x.shape
    width = _check_weight(weight, dim, x.device)
    if bias is not None:
        check_tensor("bias", bias, INPUT_DTYPES, (dim,), x.device, like="x", sizes_from="x")
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, INDEX_DTYPES, (batch, seqlen), x.device, like="x", sizes_from="x")
    if initial_states is not None:
        check_tensor("initial_states", initial_states, (x.dtype,), (batch, dim, width - 1), x.device, like="x",
                     sizes_from="x and weight")
    return ConvDims(batch, dim, seqlen, width)


def check_conv_grad_inputs(dims: ConvDims, x: Tensor, dout: Tensor, dfinal_states: Tensor | None) -> None:
    """dout: x's shape and dtype; dfinal_states: (batch, dim, width - 1) in x's dtype."""
    batch, dim, seqlen, width = dims
    check_tensor("dout", dout, (x.dtype,), (batch, dim, seqlen), x.device, like="x", sizes_from="x")
    if dfinal_states is not None:
        check_tensor("dfinal_states", dfinal_states, (x.dtype,), (batch, dim, width - 1), x.device, like="x",
                     sizes_from="x and weight")


class UpdateDims(NamedTuple):
    batch: int
    dim: int
    seqlen: int
    width: int
    state_len: int
    cache_size: int  # conv_state's first dimension (== batch without conv_state_indices)


def check_update_inputs(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                        cache_seqlens: Tensor | None, conv_state_indices: Tensor | None) -> UpdateDims:
    """Validates the inputs of `causal_conv1d_update` and returns their sizes.

    x: (batch, dim, seqlen) fp32/fp16/bf16; conv_state: (cache_size, dim, state_len) with state_len >=
    width - 1, fp32/fp16/bf16 (cache_size == batch unless conv_state_indices is given); weight, bias as
    for the forward; cache_seqlens, conv_state_indices: (batch,) int32/int64.
    """
    check_leading("x", x, "(batch, dim, seqlen)")
    batch, dim, seqlen = x.shape
    width = _check_weight(weight, dim, x.device)
    if not isinstance(conv_state, Tensor) or conv_state.dim() != 3 or conv_state.shape[1] != dim or \
            conv_state.shape[2] < width - 1:
        shape = tuple(conv_state.shape) if isinstance(conv_state, Tensor) else type(conv_state).__name__
        raise ValueError(f"conv_state must have shape (cache_size, dim, state_len) with dim={dim} and state_len >= "
                         f"width - 1 = {width - 1}, got {shape}")
    cache_size, _, state_len = conv_state.shape
    if conv_state_indices is None and cache_size != batch:
        raise ValueError(f"conv_state must have batch {batch} like x (or give conv_state_indices), got "
                         f"{tuple(conv_state.shape)}")
    check_tensor("conv_state", conv_state, INPUT_DTYPES, (cache_size, dim, state_len), x.device, like="x")
    if bias is not None:
        check_tensor("bias", bias, INPUT_DTYPES, (dim,), x.device, like="x", sizes_from="x")
    for name, index in (("cache_seqlens", cache_seqlens), ("conv_state_indices", conv_state_indices)):
        if index is not None:
            check_tensor(name, index, INDEX_DTYPES, (batch,), x.device, like="x", sizes_from="x")
    return UpdateDims(batch, dim, seqlen, width, state_len, cache_size)


def check_activation(activation: str | None) -> bool:
    """The package's activation argument as the operators' `silu` flag."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    return activation is not None
