"""From a model that calls ssmops to a `torch.export` program, an AOTInductor package
or a TorchScript file that a C++ process can run.

    import ssmops.export as sx
    ep = sx.export_program(model, (tokens,))                 # seqlen (dim 1) dynamic
    sx.save_program(ep, "model.pt2")
    sx.aoti_package(ep, "model_aoti.pt2")                     # CPU or CUDA, by the inputs' device
    sx.torchscript(model, (tokens,), "model_ts.pt")           # inference only
    sx.onnx_file(model, (tokens,), "model.onnx")              # standard ONNX operators (ssmops.onnx)

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

from ._errors import ExportError
from .checkpoint import load_state_dict  # noqa: F401  (part of this module's API: the CLI loads with it)
from .models.generation import InferenceParams, step_logits


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


class LMPrefill(nn.Module):
    """An LM's prompt pass as a function, for export: `input_ids (batch, seqlen) -> (logits of the
    last token (batch, vocab), *caches)`, the caches being what `LMDecodingStep` takes."""

    def __init__(self, model: nn.Module, max_seqlen: int):
        super().__init__()
        self.model, self.max_seqlen = model, max_seqlen

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = InferenceParams(max_seqlen=self.max_seqlen, max_batch_size=input_ids.shape[0])
        logits = self.model(input_ids, inference_params=params, num_last_tokens=1).logits[:, -1]
        return (logits, *_flat_caches(params.key_value_memory_dict))


class LMDecodingStep(nn.Module):
    """One decoding token of an LM as a function, for export:
    `(input_ids (batch, 1), positions (batch,) int64, *caches) -> (logits (batch, vocab), *caches)`.

    `positions` is each sample's number of tokens already in the caches. The caches are, layer
    by layer, the tensors of the model's `allocate_inference_cache` (Mamba: conv and ssm states;
    attention: the KV cache of `max_seqlen` positions, then its conv state when it has one);
    the updated ones are returned, the inputs are left as they were."""

    def __init__(self, model: nn.Module, batch_size: int, max_seqlen: int):
        super().__init__()
        self.model, self.max_seqlen = model, max_seqlen
        caches = model.allocate_inference_cache(batch_size, max_seqlen)
        self.layout = [(layer, tuple(s is not None for s in states)) for layer, states in caches.items()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *caches: torch.Tensor):
        updated = iter([c.clone() for c in caches])  # the step writes in place: into copies
        memory = {layer: tuple(next(updated) if present else None for present in presence)
                  for layer, presence in self.layout}
        logits = step_logits(self.model, memory, input_ids, positions)
        return (logits, *_flat_caches(memory))


def _flat_caches(memory: dict) -> list[torch.Tensor]:
    """The caches in layer order, contiguous: a package reads its inputs with the strides it was
    traced with (contiguous), so what one step returns must be what the next one can take."""
    return [s.contiguous() for layer in sorted(memory) for s in memory[layer] if s is not None]


def decoding_step_program(model: nn.Module, batch_size: int, max_seqlen: int,
                          example_position: int = 16) -> torch.export.ExportedProgram:
    """`LMDecodingStep` of `model` exported with static shapes (the caches' are fixed by
    `batch_size` and `max_seqlen`), on the device the model is on."""
    device = next(model.parameters()).device
    step = LMDecodingStep(model.eval(), batch_size, max_seqlen)
    caches = _flat_caches(model.allocate_inference_cache(batch_size, max_seqlen))
    positions = torch.full((batch_size,), example_position, dtype=torch.long, device=device)
    token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # contiguous, as callers pass it
    return export_program(step, (token, positions, *caches), dynamic_shapes=(None, None, (None,) * len(caches)))


def lm_packages(model: nn.Module, out_dir: str | Path, *, batch_size: int = 1, max_seqlen: int = 2048,
                example_prompt_len: int = 16) -> dict[str, Path]:
    """AOTInductor packages of a language model's prefill (prompt length dynamic, 2 ..
    max_seqlen - 1) and one-token decoding step, for the device the model is on:
    {"prefill": out_dir/prefill.pt2, "decode": out_dir/decode.pt2}. A C++ program runs the
    prefill, then feeds the step its last token, positions and the caches it returned. A model
    whose weights were converted (`convert_weights("int8")`, ...) is packaged with them so."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    model = model.eval()
    prompt = torch.zeros(batch_size, example_prompt_len, dtype=torch.long, device=device)
    seqlen = torch.export.Dim("seqlen", min=2, max=max_seqlen - 1)  # leaves room to decode a token
    prefill = export_program(LMPrefill(model, max_seqlen), (prompt,), dynamic_shapes=({1: seqlen},))
    decode = decoding_step_program(model, batch_size, max_seqlen, example_prompt_len)
    return {"prefill": aoti_package(prefill, out_dir / "prefill.pt2"),
            "decode": aoti_package(decode, out_dir / "decode.pt2")}


def onnx_file(model: nn.Module, example_inputs: Sequence[torch.Tensor], path: str | Path, *, seq_dim: int = 1,
              batch_dim: int | None = 0, dynamic_shapes=None, optimize: bool = True) -> Path:
    """An ONNX file of `model` in standard ONNX operators (`ssmops.onnx`), seqlen dynamic as in
    `export_program`; needs the onnx and onnxscript packages (and onnxruntime to run it)."""
    from . import onnx as ssmops_onnx

    with ssmops_onnx.standard_ops():
        ep = export_program(model, example_inputs, seq_dim=seq_dim, batch_dim=batch_dim, dynamic_shapes=dynamic_shapes)
    ssmops_onnx.export(ep, optimize=optimize).save(str(path))
    return Path(path)


def lm_onnx(model: nn.Module, out_dir: str | Path, *, batch_size: int = 1, max_seqlen: int = 2048,
            example_prompt_len: int = 16, optimize: bool = True) -> dict[str, Path]:
    """A language model's prefill and one-token step as two ONNX files in standard operators, with
    the inputs and outputs of `lm_packages`' (the prompt length dynamic, 2 .. max_seqlen - 1):
    {"prefill": out_dir/prefill.onnx, "decode": out_dir/decode.onnx}. Float weights only (a
    converted model's int8 or bf16 projections are exported as the float products they compute)."""
    from . import onnx as ssmops_onnx

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    model = model.eval()
    prompt = torch.zeros(batch_size, example_prompt_len, dtype=torch.long, device=device)
    seqlen = torch.export.Dim("seqlen", min=2, max=max_seqlen - 1)
    with ssmops_onnx.standard_ops():
        prefill = export_program(LMPrefill(model, max_seqlen), (prompt,), dynamic_shapes=({1: seqlen},))
        decode = decoding_step_program(model, batch_size, max_seqlen, example_prompt_len)
    files = {"prefill": out_dir / "prefill.onnx", "decode": out_dir / "decode.onnx"}
    ssmops_onnx.export(prefill, optimize=optimize).save(str(files["prefill"]))
    ssmops_onnx.export(decode, optimize=optimize).save(str(files["decode"]))
    return files
