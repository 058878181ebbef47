"""From a model that calls ssmops to a `torch.export` program, an AOTInductor package
or a TorchScript file that a C++ process can run.

    import ssmops.export as sx
    ep = sx.export_program(model, (tokens,))                 # seqlen (dim 1) dynamic
    sx.save_program(ep, "model.pt2")
    sx.aoti_package(ep, "model_aoti.pt2")                     # CPU or CUDA, by the inputs' device
    sx.torchscript(model, (tokens,), "model_ts.pt")           # inference only

A C++ program loads the operator library (`ssmops.library_path()`) and then the
package (`examples/cpp`). Inputs are taken to be `(batch, seqlen, ...)` by default;
say otherwise with `seq_dim` / `batch_dim`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .checkpoint import load_state_dict  # noqa: F401  (part of this module's API: the CLI loads with it)


class ExportError(RuntimeError):
    """A model could not be exported; the message names the failing submodule and why."""


@contextmanager
def quiet_torch_deprecations() -> Iterator[None]:
    """Within the block, hides the FutureWarning/DeprecationWarning that torch's own export and
    AOTInductor code raise about torch's internals (torch 2.13's pytree says "`isinstance(treespec,
    LeafSpec)` is deprecated" at every export): they tell a user of ssmops' CLI or demo nothing
    they can act on. Only those categories, only from torch's modules (and that pytree message,
    which typing_extensions attributes to copyreg); every other warning still shows."""
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"torch(\.|$)")
        warnings.filterwarnings("ignore", category=FutureWarning, message=r"`isinstance\(treespec, LeafSpec\)`")
        yield


def _failing_module(model: nn.Module, err: BaseException) -> str | None:
    """The innermost submodule of `model` whose forward is on the error's traceback."""
    names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    found = None
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names:
            found = f"{names[id(owner)]} ({type(owner).__name__})"
        tb = tb.tb_next
    return found


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def dynamic_shapes_for(
    example_inputs: Sequence[torch.Tensor], seq_dim: int = 1, batch_dim: int | None = 0
) -> tuple:
    """One `seqlen` Dim shared by every tensor input's `seq_dim` (it must stay symbolic)
    and `Dim.AUTO` for `batch_dim` (dynamic where the model allows it, and where the
    example batch is not 1, which export always specialises)."""
    seqlen = torch.export.Dim("seqlen", min=2, max=1 << 24)
    shapes = []
    for x in example_inputs:
        if not isinstance(x, torch.Tensor) or x.dim() <= max(seq_dim, batch_dim or 0):
            shapes.append(None)
            continue
        spec = {seq_dim: seqlen}
        if batch_dim is not None and batch_dim != seq_dim and x.shape[batch_dim] > 1:  # 1 is always static
            spec[batch_dim] = torch.export.Dim.AUTO
        shapes.append(spec)
    return tuple(shapes)


def export_program(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    seq_dim: int = 1,
    batch_dim: int | None = 0,
    dynamic_shapes=None,
) -> torch.export.ExportedProgram:
    """`torch.export.export` of `model` in eval mode with a dynamic seqlen (and batch
    where possible). Raises ExportError naming the submodule that failed and why."""
    example_inputs = tuple(example_inputs)
    if dynamic_shapes is None:
        dynamic_shapes = dynamic_shapes_for(example_inputs, seq_dim, batch_dim)
    model = model.eval()
    try:
        with torch.no_grad():
            return torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
    except Exception as err:  # noqa: BLE001 - re-raised with the module named
        where = _failing_module(model, err) or type(model).__name__
        raise ExportError(f"cannot export {type(model).__name__}: {where} failed with {_first_line(err)}") from err


def save_program(ep: torch.export.ExportedProgram, path: str | Path) -> Path:
    torch.export.save(ep, str(path))
    return Path(path)


def aoti_package(ep: torch.export.ExportedProgram, path: str | Path) -> Path:
    """Compiles an exported program with AOTInductor into a `.pt2` package, for the
    device its example inputs were on. Load it with `torch._inductor.aoti_load_package`
    or C++'s `torch::inductor::AOTIModelPackageLoader` (after loading the ops library)."""
    return Path(torch._inductor.aoti_compile_and_package(ep, package_path=str(path)))


def torchscript(model: nn.Module, example_inputs: Sequence[torch.Tensor], path: str | Path) -> Path:
    """Traces `model` (inference only: the scan's backward is not scripted) and saves it."""
    with torch.no_grad():
        traced = torch.jit.trace(model.eval(), tuple(example_inputs), check_trace=False)
    traced.save(str(path))
    return Path(path)


def dynamic_dims(ep: torch.export.ExportedProgram) -> list[list[str]]:
    """For each tensor input of the exported program, its sizes as strings (symbols where dynamic)."""
    user_inputs = set(ep.graph_signature.user_inputs)
    return [
        [str(s) for s in node.meta["val"].shape]
        for node in ep.graph.nodes
        if node.op == "placeholder" and node.name in user_inputs and isinstance(node.meta.get("val"), torch.Tensor)
    ]
