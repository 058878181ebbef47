"""The decoding step (mamba_ssm's `selective_state_update`): one timestep of the scan, in place
on the state. Files: schema.py, checks.py, reference.py, default.py, triton.py (+ triton_kernels.py);
the C++ kernel is ssmops/csrc/state_update/."""

from .._family import Family, Operator
from . import default, schema

FAMILY = Family(
    operators=(
        Operator(schema.SCHEMA, schema.fake, default.selective_state_update,
                 onnx=default.selective_state_update),
        Operator(schema.MULTIHEAD_SCHEMA, schema.multihead_fake, default.multihead_state_update,
                 onnx=default.multihead_state_update),
    ),
    triton="ssmops.ops.state_update.triton",
)
