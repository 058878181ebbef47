"""ONNX export of models that call ssmops operators: standard ONNX operators only.

    import ssmops.onnx
    program = ssmops.onnx.export(model, (x,), dynamic_shapes=({1: torch.export.Dim("seqlen")},))
    program.save("model.onnx")          # any ONNX runtime runs it: no custom domain

`export` is `torch.export.export` under `standard_ops()`, then `torch.onnx.export(program,
dynamo=True)`. Under `standard_ops()` every ssmops operator call runs its decomposition
(`decompositions()`) into aten operators (and, for the scans, one `scan` over blocks of time, which
torch.onnx writes as one ONNX `Scan`), so the exporter meets nothing but operators it knows. To
drive torch.onnx yourself:

    with torch.no_grad(), ssmops.onnx.standard_ops():
        ep = torch.export.export(model, args, dynamic_shapes=...)
    with torch.no_grad():  # torch.onnx retraces; a scan over parameters that need grad has no backward
        onnx_program = torch.onnx.export(ep, dynamo=True)

A program already exported with ssmops operators in it is decomposed by `decompose(ep)`
(`ExportedProgram.run_decompositions`), except the in-place decoding steps, which export wraps in
`auto_functionalized` where no decomposition table reaches them: trace those under `standard_ops()`.

Why not plain `torch.onnx.export(model, args, dynamo=True)`: it would find the decompositions
only in `torch._decomp.decomposition_table` (private), which FakeTensor also consults, before an
operator's own fake kernel, whenever shapes are symbolic; registering there would replace the
ssmops fake kernels in every torch.export and torch.compile trace. torch.onnx's own translation
registry is private too, and `custom_translation_table` has to be passed by the caller anyway.

Not exported: a complex `A`, the SSD scan's `cu_seqlens` (varlen states), and backward operators
(ONNX export is for inference).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._errors import ExportError
from .ops import FAMILIES

__all__ = ["decompositions", "export", "ONNXExportError"]


class ONNXExportError(ExportError):
    """torch.onnx could not translate the (decomposed) program; the message says where."""


def decompositions() -> dict[torch._ops.OpOverload, Callable]:
    """{ssmops operator: its decomposition into aten operators}, for
    `ExportedProgram.run_decompositions` ahead of `torch.onnx.export`: each family's `Operator.onnx`
    (ssmops/ops/<family>/__init__.py). The decoding steps, the projection, the fused Mamba steps and the
    causal conv (a shift and add over its few taps) are their `default` kernels (loop-free); the scans
    are their block-wise forms (ssmops/ops/selective_scan/onnx.py, ops/ssd/onnx.py)."""
    return {getattr(torch.ops.ssmops, op.name).default: op.onnx
            for family in FAMILIES for op in family.operators if op.onnx is not None}


class _Decomposing(TorchFunctionMode):
    """Calls of ssmops operators run their decompositions instead (at the Python level, so that a
    tracer records aten operators, and an in-place decoding step is functionalised like any
    in-place aten op)."""

    def __init__(self):
        super().__init__()
        self.table = decompositions()
        self.packets = {op.overloadpacket for op in self.table}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = func.default if isinstance(func, torch._ops.OpOverloadPacket) and func in self.packets else func
        decomposition = self.table.get(target)
        if decomposition is not None:
            return decomposition(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def standard_ops() -> Iterator[None]:
    """Within the block, every ssmops operator call runs as its decomposition into standard
    (aten) operators: `torch.export.export` under it records a program that torch.onnx translates
    as it is. Eager calls give the same results (slower: the scans' block-wise forms)."""
    with _Decomposing():
        yield


def _is_ssmops(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "ssmops"


def decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` with every ssmops operator decomposed (and torch.export's default decompositions)."""
    table = torch.export.default_decompositions()
    for op, fn in decompositions().items():
        table[op] = fn
    with torch.no_grad():  # an inference graph: a scan over parameters that require grad has no backward
        return program.run_decompositions(table)


def export(
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    optimize: bool = True,
    strict: bool = False,
) -> torch.onnx.ONNXProgram:
    """Exports `model` (or an ExportedProgram) to ONNX with every ssmops operator written in
    standard ONNX operators, traced without gradients. `dynamic_shapes` is torch.export's (e.g.
    `({1: torch.export.Dim("seqlen")},)`). Returns torch.onnx's `ONNXProgram` (`.save(path)`,
    `.model_proto`)."""
    if isinstance(model, torch.export.ExportedProgram):
        program = model
    elif isinstance(model, torch.nn.Module):
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of the model's inputs, got {type(args).__name__}")
        with standard_ops(), torch.no_grad():
            program = torch.export.export(model, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
    else:
        raise TypeError(f"model must be an nn.Module or a torch.export.ExportedProgram, got {type(model).__name__}")
    if any(_is_ssmops(node.target) for node in program.graph.nodes if node.op == "call_function"):
        program = decompose(program)  # a program exported without standard_ops
    try:
        with torch.no_grad():  # torch.onnx decomposes again; the same reason as in decompose
            return torch.onnx.export(
                program, dynamo=True, input_names=input_names, output_names=output_names, optimize=optimize,
                verbose=False,
            )
    except Exception as e:  # torch.onnx raises its own (private) error types
        raise ONNXExportError(f"torch.onnx.export failed: {e}") from e
