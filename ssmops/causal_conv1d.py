"""`causal_conv1d_fn` and `causal_conv1d_update`: Dao-AILab's causal-conv1d package's functions, on the
ssmops operators (so: on CPU too, differentiable, compiled with `fullgraph=True`, exported)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._registry import call_step, operator_for
from .ops._checks import check_cache_indices, checked_call
from .ops.causal_conv1d.checks import check_activation, check_conv_inputs, check_update_inputs


def conv_taps(weight: Tensor) -> Tensor:
    """weight (dim, width), or nn.Conv1d's depthwise (dim, 1, width) as the mixers hold it."""
    return weight.squeeze(1) if isinstance(weight, Tensor) and weight.dim() == 3 and weight.shape[1] == 1 else weight


def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: Tensor | None = None,
    activation: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Depthwise causal conv; a drop-in for `causal_conv1d.causal_conv1d_fn`.

    x: (batch, dim, seqlen) fp32/fp16/bf16, channel-first or channel-last (a transposed (batch, seqlen,
    dim) tensor: read as it is, and out comes back in the same layout); weight: (dim, width) (or (dim, 1,
    width)); bias: (dim,); seq_idx: (batch, seqlen) int32; initial_states: (batch, dim, width - 1) in x's
    dtype; activation: None, "silu" or "swish". Output t sees inputs t - width + 1 .. t of its own sequence
    (where seq_idx changes, the conv restarts), the initial states before token 0::

        out_t = act(bias + sum_k weight[:, k] * x_{t - width + 1 + k})

    computed in float32, returned in x's dtype. With `return_final_states`, also the last width - 1
    inputs (batch, dim, width - 1) (written into `final_states_out` when given), the state a
    continuation starts from. Unlike the package, seq_idx combines with initial and final states (the
    initial states belong to token 0's sequence; final entries outside the last token's sequence are 0)
    and any layout takes them. Differentiable in x, weight, bias and initial_states.
    """
    silu = check_activation(activation)
    inputs = (x, conv_taps(weight), bias, seq_idx, initial_states)
    # (on GPUs the Triton operator itself, so that compiled graphs launch its kernels)
    out, final_states = checked_call(lambda: operator_for("causal_conv1d_fwd", x)(*inputs, silu),
                                     lambda: check_conv_inputs(*inputs))
    if not return_final_states:
        return out
    if final_states_out is not None:
        final_states = final_states_out.copy_(final_states)
    return out, final_states


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    cache_seqlens: Tensor | None = None,
    conv_state_indices: Tensor | None = None,
) -> Tensor:
    """The decoding step; a drop-in for `causal_conv1d.causal_conv1d_update`.

    x: (batch, dim) or (batch, dim, seqlen), the new tokens; conv_state: (batch, dim, state_len) with
    state_len >= width - 1, UPDATED IN PLACE; weight: (dim, width) (or (dim, 1, width)); bias: (dim,).
    Each token's output reads the width - 1 inputs before it and itself. Without `cache_seqlens` the
    state holds the last state_len inputs, oldest first (shifted left by seqlen, x appended); with
    `cache_seqlens` (batch,) int32 it is a circular buffer, token i of row b going into slot
    (cache_seqlens[b] + i) % state_len. `conv_state_indices` (batch,) int32 picks each row's entry of
    a larger cache (a negative index is padding: output 0, no state changed). Returns x's shape and
    dtype. Inference only (no autograd).
    """
    silu = check_activation(activation)
    weight = conv_taps(weight)
    squeeze = isinstance(x, Tensor) and x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    inputs = (x, conv_state, weight, bias, cache_seqlens, conv_state_indices)

    def check():
        check_update_inputs(*inputs)
        if not torch.compiler.is_compiling():  # it reads the indices: eager only (the kernels check too)
            check_cache_indices("conv_state_indices", conv_state_indices, conv_state.shape[0], "conv_state")

    # (in eager mode on a GPU the Triton launcher itself, as the state's step: `call_step`)
    out = checked_call(lambda: call_step("causal_conv1d_update", x, inputs, (silu,), conv_state), check)
    return out.squeeze(-1) if squeeze else out
