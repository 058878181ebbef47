"""The fused decoding step of a Mamba (Mamba-1) block's mixer (`mamba_step`): in_proj, conv,
x_proj, dt_proj, state update and out_proj in one call, so that a decoding token on CPU pays one
operator call per layer instead of seven; and of a whole stack of pre-norm blocks
(`mamba_layers_step`: each layer's residual add and RMSNorm, then its mixer), one call a token.
Files: schema.py, checks.py, reference.py, default.py; the C++ kernel is ssmops/csrc/mamba_step/."""

from .._family import Family, Operator
from . import default, schema

FAMILY = Family(operators=(Operator(schema.SCHEMA, schema.fake, default.mamba_step, onnx=default.mamba_step),
                           Operator(schema.LAYERS_SCHEMA, schema.layers_fake, default.mamba_layers_step,
                                    onnx=default.mamba_layers_step)))
