"""The causal depthwise conv of Mamba's mixers (Dao-AILab's causal-conv1d): forward and backward
operators, and the decoding step. Files: schema.py (schemas, fakes, autograd), checks.py, reference.py
(the oracle), default.py, triton.py (+ triton_kernels.py); the C++ kernels are ssmops/csrc/causal_conv1d/."""

from .._family import Family, Operator
from . import default, schema

FAMILY = Family(
    operators=(
        Operator(schema.FWD_SCHEMA, schema.fwd_fake, default.causal_conv1d_fwd,
                 autograd=schema.autograd_for, backward="causal_conv1d_bwd", onnx=default.causal_conv1d_fwd),
        Operator(schema.BWD_SCHEMA, schema.bwd_fake, default.causal_conv1d_bwd),
        Operator(schema.UPDATE_SCHEMA, schema.update_fake, default.causal_conv1d_update,
                 onnx=default.causal_conv1d_update),
    ),
    triton="ssmops.ops.causal_conv1d.triton",
)
