"""Mamba-1's selective scan: forward and backward operators. Files: schema.py (schemas, fakes,
autograd), checks.py (arguments, the chunk contract), reference.py (the oracle), default.py,
triton.py (+ triton_kernels.py); the C++ kernels are ssmops/csrc/selective_scan/."""

from .._family import Family, Operator
from . import default, onnx, schema

FAMILY = Family(
    operators=(
        Operator(schema.FWD_SCHEMA, schema.fwd_fake, default.selective_scan_fwd,
                 autograd=schema.autograd_for, backward="selective_scan_bwd", onnx=onnx.selective_scan_fwd),
        Operator(schema.BWD_SCHEMA, schema.bwd_fake, default.selective_scan_bwd),
    ),
    triton="ssmops.ops.selective_scan.triton",
)
