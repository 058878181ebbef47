"""Mamba-2's SSD chunked scan (mamba_ssm's `mamba_chunk_scan_combined`): forward and backward
operators. Files: schema.py (schemas, fakes, autograd), checks.py (arguments, the chunk
contract), reference.py (the oracle, per timestep, and the chunked form), default.py, triton.py
(+ triton_kernels.py); the C++ kernels are ssmops/csrc/ssd/."""

from .._family import Family, Operator
from . import default, onnx, schema

FAMILY = Family(
    operators=(
        Operator(schema.FWD_SCHEMA, schema.fwd_fake, default.ssd_fwd,
                 autograd=schema.autograd_for, backward="ssd_scan_bwd", onnx=onnx.ssd_scan_fwd),
        Operator(schema.BWD_SCHEMA, schema.bwd_fake, default.ssd_bwd),
    ),
    triton="ssmops.ops.ssd.triton",
)
