"""What an operator family tells the registry: its operators and where their kernels are.

A family (`ssmops/ops/<family>/`) describes itself with one `Family` in its `__init__.py`;
`ssmops._registry` reads every family listed in `ssmops.ops.FAMILIES` and does the rest
(defines the schemas the C++ library did not, registers fakes, autograd and the kernels
per device). Nothing here imports a family or the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Devices whose tensors the Triton kernels serve natively ("cuda" is also ROCm's device type).
GPU_DEVICES = ("cuda", "xpu")


def traced() -> bool:
    """Whether a tracer may be recording this call: Dynamo, or a dispatch mode (fake, functional and proxy
    tensors; `use_backend`'s). Eager calls need neither `wrap_triton` nor the dispatcher's route."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


@dataclass(frozen=True)
class Operator:
    """One `torch.ops.ssmops` operator.

    schema: the full schema string, name first (the C++ library declares the same one);
    fake: its fake (meta) kernel; default: its pure-PyTorch kernel, for every device;
    autograd: for a differentiable operator, `autograd(bwd_op) -> (backward, setup_context)`
    whose backward calls `bwd_op`, the operator named by `backward` (or its Triton twin);
    onnx: its decomposition into standard operators for ONNX export (`ssmops.onnx` reads it), or
    None for an operator ONNX export leaves out (a backward).
    """

    schema: str
    fake: Callable
    default: Callable
    autograd: Callable | None = None
    backward: str | None = None
    onnx: Callable | None = None

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


@dataclass(frozen=True)
class Family:
    """The operators of one family and the module of its Triton kernels.

    `triton` names a module that is imported only where Triton can run; it defines
    `KERNELS` (operator name -> launcher with the operator's signature) and `TRITON_OPS`
    (operator name -> its `torch.library.triton_op`, named `ssmops::<name>_triton`).
    """

    operators: tuple[Operator, ...]
    triton: str | None = None
