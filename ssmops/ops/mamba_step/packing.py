"""What a caller of `mamba_step` needs besides the operator: its arguments after the states, in the
schema's order, from a mixer's parameters; and the rule for when one call serves a decoding token.
The Mamba block (`modules/mamba.py`), the LM's stacked step (`models/mixer_seq_simple.py`) and
transformers' mixers (`integrations/transformers.py`) all pack and decide through these."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

# Beyond this many sequences a decoding step's projections are matmuls (weight_only_linear streams the
# weights for up to 16 rows of activations), so the unfused step serves them.
FUSED_STEP_MAX_BATCH = 16


def step_arguments(in_proj: tuple, conv_weight: Tensor, conv_bias: Tensor | None, x_proj: tuple, dt_proj: tuple,
                   A_log: Tensor, D: Tensor | None, out_proj: tuple) -> tuple:
    """`mamba_step`'s arguments after (hidden_states, conv_state, ssm_state). Each projection is its
    (weight, int8 scale or None, bias or None); x_proj's bias is never read (Mamba's has none); the conv's
    weight is (d_inner, d_conv)."""
    return (*in_proj, conv_weight, conv_bias, *x_proj[:2], *dt_proj, A_log, D, *out_proj)


def fused_step_serves(hidden_states: Tensor, states: tuple, small: tuple, parameters: Iterable[Tensor]) -> bool:
    """Whether one `mamba_step` call serves a decoding token: on CPU (elsewhere the operators it fuses have
    kernels of their own, and torch.compile fuses the rest), up to FUSED_STEP_MAX_BATCH rows, outside
    autograd (the operator has none), with float32 activations, `states` and `small` parameters (the
    projections' weights may be in any format); `parameters`: the mixer's, read only if the rest allows."""
    if hidden_states.device.type != "cpu" or hidden_states.shape[0] > FUSED_STEP_MAX_BATCH:
        return False
    if torch.is_grad_enabled() and any(p.requires_grad for p in parameters):
        return False
    return all(t is None or t.dtype == torch.float32 for t in (hidden_states, *states, *small))
