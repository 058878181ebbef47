"""The fused decoding step of Mamba blocks: schemas and fake kernels.

One call advances one token through the whole mixer (mamba_ssm's `Mamba.step`): in_proj, the
causal conv's window (`conv_state`, updated in place) and its SiLU, x_proj, dt_proj, the
selective state update (`ssm_state`, in place, with A = -exp(A_log)) gated by SiLU(z), and
out_proj. Each projection's
weight is float32, bfloat16, float16 or int8 with a float32 scale per output feature, as in
`weight_only_linear`; everything else is float32. Inference only (no autograd). The C++ library
declares the same schemas.

`mamba_layers_step` is one token through a stack of mamba_ssm's pre-norm `Block`s with RMSNorm:
for each layer, residual += hidden_states (residual = hidden_states at the first layer when no
residual is given), hidden_states = mamba_step(rms_norm(residual) * norm_weight). It returns
(hidden_states, residual) of the last layer, as the blocks do; with `final_norm_weight` (the
model's last norm, `norm_f`) it does the residual add and RMSNorm once more, after the last layer,
and returns (the normed residual, residual). Each mixer argument is a list with one entry per
layer, None where an optional one is left out.
"""

from __future__ import annotations

from .checks import check_mamba_layers_step_inputs, check_mamba_step_inputs

SCHEMA = (
    "mamba_step(Tensor hidden_states, Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor in_proj_weight, "
    "Tensor? in_proj_scale, Tensor? in_proj_bias, Tensor conv_weight, Tensor? conv_bias, Tensor x_proj_weight, "
    "Tensor? x_proj_scale, Tensor dt_proj_weight, Tensor? dt_proj_scale, Tensor? dt_proj_bias, Tensor A_log, "
    "Tensor? D, Tensor out_proj_weight, Tensor? out_proj_scale, Tensor? out_proj_bias) -> Tensor"
)


def fake(*args):
    batch, *_, out_features = check_mamba_step_inputs(*args)
    return args[0].new_empty(batch, out_features)


LAYERS_SCHEMA = (
    "mamba_layers_step(Tensor hidden_states, Tensor? residual, Tensor(a!)[] conv_states, Tensor(b!)[] ssm_states, "
    "Tensor[] norm_weight, float norm_eps, Tensor[] in_proj_weight, Tensor?[] in_proj_scale, Tensor?[] in_proj_bias, "
    "Tensor[] conv_weight, Tensor?[] conv_bias, Tensor[] x_proj_weight, Tensor?[] x_proj_scale, "
    "Tensor[] dt_proj_weight, Tensor?[] dt_proj_scale, Tensor?[] dt_proj_bias, Tensor[] A_log, Tensor?[] D, "
    "Tensor[] out_proj_weight, Tensor?[] out_proj_scale, Tensor?[] out_proj_bias, Tensor? final_norm_weight=None) "
    "-> (Tensor, Tensor)"
)


def layers_fake(*args):
    batch, d_model = check_mamba_layers_step_inputs(*args)
    return args[0].new_empty(batch, d_model), args[0].new_empty(batch, d_model)
