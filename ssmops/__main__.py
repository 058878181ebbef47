"""`ssmops` command line (also `python -m ssmops`).

    ssmops export my_models:build_model --checkpoint model.safetensors \\
        --input 1x64:int64 --format aoti --format torchscript --format onnx --out exported/
    ssmops export-lm CHECKPOINT_DIR --format onnx --out exported/   # prefill.onnx + decode.onnx
    ssmops generate CHECKPOINT_DIR --prompt "The for statement" --max-new-tokens 200 --top-k 10

`module:factory` names a function that returns the nn.Module (called with no
arguments); the checkpoint's state_dict is loaded into it strictly. `generate` reads a
Mamba LM checkpoint directory (mamba_ssm's or transformers' layout) and streams text.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .textgen import GenerateError, add_generate_parser, add_weights_argument, generate_command, load_checkpoint

FORMATS = ("pt2", "aoti", "torchscript", "onnx")
LM_FORMATS = ("aoti", "onnx")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
           "int32": torch.int32}


class _Progress:
    """Numbered steps with elapsed time, and a summary of what was written."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream = total, 0, stream

    @contextmanager
    def step(self, what: str):
        self.done += 1
        print(f"[{self.done}/{self.total}] {what} ...", end="", file=self.stream, flush=True)
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            print(" failed", file=self.stream, flush=True)
            raise
        print(f" done ({time.perf_counter() - t0:.1f} s)", file=self.stream, flush=True)


def _parse_input(spec: str) -> torch.Tensor:
    """'2x64' or '2x64:int64' -> a random example tensor (ints in [0, 100))."""
    shape_text, _, dtype_name = spec.partition(":")
    try:
        shape = [int(s) for s in shape_text.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input must look like 2x64 or 2x64:int64, got {spec!r}") from None
    dtype_name = dtype_name or "float32"
    if dtype_name not in _DTYPES:
        raise argparse.ArgumentTypeError(f"--input dtype must be one of {', '.join(_DTYPES)}, got {dtype_name!r}")
    dtype = _DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen, dtype=dtype)


def _load_factory(target: str):
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"error: model must be given as module:factory, got {target!r}")
    sys.path.insert(0, str(Path.cwd()))
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"error: cannot load {target}: {err}") from None


def export_command(args: argparse.Namespace) -> int:
    from . import export as sx

    formats = args.format or ["pt2"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = "pt2" in formats or "aoti" in formats
    progress = _Progress(total=2 + traces + sum(f in formats for f in ("aoti", "torchscript", "onnx")))
    with progress.step(f"building {args.model}"):
        model = _load_factory(args.model)()
        if not isinstance(model, torch.nn.Module):
            raise SystemExit(f"error: {args.model} returned a {type(model).__name__}, not an nn.Module")
    with progress.step(f"loading {args.checkpoint}" if args.checkpoint else "no checkpoint: keeping initial weights"):
        if args.checkpoint:
            model.load_state_dict(sx.load_state_dict(args.checkpoint))
    model = model.to(args.device).eval()
    inputs = tuple(x.to(args.device) for x in args.input)
    written = []
    ep = None
    if traces:
        with progress.step("tracing with torch.export (seqlen dynamic)"):
            ep = sx.export_program(model, inputs, seq_dim=args.seq_dim, batch_dim=args.batch_dim)
    if "pt2" in formats:
        written.append(sx.save_program(ep, out / "model.pt2"))
    if "aoti" in formats:
        with progress.step(f"compiling and packaging with AOTInductor for {args.device}"):
            written.append(sx.aoti_package(ep, out / "model_aoti.pt2"))
    if "torchscript" in formats:
        with progress.step("tracing with TorchScript (inference only)"):
            written.append(sx.torchscript(model, inputs, out / "model_ts.pt"))
    if "onnx" in formats:
        with progress.step("exporting to ONNX in standard operators (seqlen dynamic)"):
            written.append(sx.onnx_file(model, inputs, out / "model.onnx", seq_dim=args.seq_dim,
                                        batch_dim=args.batch_dim))
    example = out / "example_inputs.pt"
    torch.save([x.cpu() for x in inputs], example)
    written.append(example)

    print("\nwrote:")
    for path in written:
        print(f"  {path}  ({path.stat().st_size / 2**20:.1f} MiB)")
    if ep is not None:
        for i, dims in enumerate(sx.dynamic_dims(ep)):
            print(f"  input {i}: shape ({', '.join(dims)}) -- symbols are dynamic")
    print(f"  operator library for C++: {_library_or_reason()}")
    return 0


def export_lm_command(args: argparse.Namespace) -> int:
    """`ssmops export-lm`: a checkpoint directory's LM as the prefill and decoding-step packages
    (AOTInductor) or ONNX files."""
    from . import export as sx

    progress = _Progress(total=2)
    with progress.step(f"loading {args.checkpoint_dir}"):
        model = load_checkpoint(args.checkpoint_dir, args.weights).to(args.device)
    if args.format == "onnx":
        with progress.step("exporting the prefill and the decoding step to ONNX"):
            written = sx.lm_onnx(model, args.out, batch_size=args.batch_size, max_seqlen=args.max_seqlen)
    else:
        with progress.step(f"exporting and packaging the prefill and the decoding step for {args.device}"):
            written = sx.lm_packages(model, args.out, batch_size=args.batch_size, max_seqlen=args.max_seqlen)
    print("\nwrote:")
    for what, path in written.items():
        print(f"  {path}  ({path.stat().st_size / 2**20:.1f} MiB): the {what}")
    print(f"  prefill: input_ids ({args.batch_size}, 2..{args.max_seqlen - 1}) int64 -> last logits, caches; "
          f"decode: token ({args.batch_size}, 1), positions ({args.batch_size},), caches -> logits, caches")
    if args.format != "onnx":
        print(f"  operator library for C++: {_library_or_reason()}")
    return 0


def _library_or_reason() -> str:
    from . import library_path

    try:
        return library_path()
    except FileNotFoundError as err:
        return f"none ({err})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ssmops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="export a model to torch.export / AOTInductor / TorchScript / ONNX")
    exp.add_argument("model", help="module:factory returning the nn.Module")
    exp.add_argument("--checkpoint", help="state_dict as .pt/.pth/.bin or .safetensors")
    exp.add_argument("--input", action="append", type=_parse_input, required=True,
                     help="an example input as SHAPE[:DTYPE], e.g. 1x64:int64; repeat for several")
    exp.add_argument("--format", action="append", choices=FORMATS, help="what to write (default pt2); repeatable")
    exp.add_argument("--out", default="exported", help="output folder")
    exp.add_argument("--device", default="cpu", help="device to export and compile for (cpu, cuda)")
    exp.add_argument("--seq-dim", type=int, default=1, help="the inputs' seqlen dimension (kept dynamic)")
    exp.add_argument("--batch-dim", type=int, default=0, help="the inputs' batch dimension (dynamic where possible)")
    lm = sub.add_parser("export-lm", help="a language model checkpoint as AOTInductor prefill and decoding-step "
                        "packages, or as two ONNX files")
    lm.add_argument("checkpoint_dir", help="any layout MambaLMHeadModel.from_pretrained reads")
    lm.add_argument("--out", default="exported", help="output folder")
    lm.add_argument("--batch-size", type=int, default=1, help="the packages' batch size")
    lm.add_argument("--max-seqlen", type=int, default=2048, help="the KV caches' length (prompt + generated)")
    lm.add_argument("--device", default="cpu", help="device to export and compile for (cpu, cuda)")
    lm.add_argument("--format", choices=LM_FORMATS, default="aoti",
                    help="aoti: prefill.pt2 + decode.pt2 (default); onnx: prefill.onnx + decode.onnx")
    add_weights_argument(lm)
    add_generate_parser(sub)
    args = parser.parse_args(argv)
    from .export import ExportError, quiet_torch_deprecations

    try:
        if args.command == "generate":
            return generate_command(args)
        with quiet_torch_deprecations():
            return export_lm_command(args) if args.command == "export-lm" else export_command(args)
    except (ExportError, GenerateError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
