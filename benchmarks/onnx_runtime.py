"""onnxruntime (CPU) on ssmops' standard-operator ONNX graphs against ssmops eager, same models.

    python benchmarks/onnx_runtime.py [--threads 1] [--d-model 256] [--layers 4] [--seqlen 512]
    python benchmarks/onnx_runtime.py --threads 1 --scaling 128 512 2048 4096   # one graph, many lengths

Rows: a Mamba LM's prefill (tokens/s) and its one-token decoding step (tokens/s), a Mamba-2 LM's
prefill, and a VMamba-style vision model scanning a patch grid four ways (images/s). The ratio is
onnxruntime's throughput over eager's (>= 1.0: onnxruntime no slower); issue 44's goal is >= 1/3.
(Named onnx_runtime.py, not onnx.py: run as a script from this folder, that would shadow the onnx
package.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ssmops  # noqa: E402
import ssmops.export as sx  # noqa: E402
from _common import time_call as _time_call  # noqa: E402
from ssmops.models import MambaConfig, MambaLMHeadModel  # noqa: E402


class VisionMamba(nn.Module):
    """Patches, then blocks that read the patch grid in four directions (rows and columns, each both
    ways) with one selective scan of 4 * dim channels, as VMamba's SS2D does; a classifier head."""

    def __init__(self, dim: int = 96, dstate: int = 16, layers: int = 2, patch: int = 4, classes: int = 1000):
        super().__init__()
        self.dim, self.dstate = dim, dstate
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.ModuleList(_SS2D(dim, dstate) for _ in range(layers))
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch(images)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3)))


class _SS2D(nn.Module):
    def __init__(self, dim: int, dstate: int):
        super().__init__()
        self.dim, self.dstate = dim, dstate
        self.norm = nn.GroupNorm(1, dim)
        self.x_proj = nn.Linear(dim, 4 * (dim + 2 * dstate), bias=False)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, dstate + 1).float()).repeat(4 * dim, 1))
        self.D = nn.Parameter(torch.ones(4 * dim))
        self.dt_bias = nn.Parameter(torch.full((4 * dim,), -3.0))

    def forward(self, x):
        batch, dim, H, W = x.shape
        L, n = H * W, self.dstate
        x = self.norm(x)
        rows, cols = x.flatten(2), x.transpose(2, 3).flatten(2)
        xs = torch.stack([rows, cols, rows.flip(-1), cols.flip(-1)], 1)  # (batch, 4, dim, L)
        proj = self.x_proj(rows.transpose(1, 2)).transpose(1, 2).reshape(batch, 4, dim + 2 * n, L)
        dts, Bs, Cs = proj.split([dim, n, n], 2)
        y = ssmops.selective_scan_fn(xs.reshape(batch, 4 * dim, L), dts.reshape(batch, 4 * dim, L),
                                     -torch.exp(self.A_log), Bs, Cs, self.D, delta_bias=self.dt_bias,
                                     delta_softplus=True).reshape(batch, 4, dim, L)

        def to_rows(t):
            return t.reshape(batch, dim, W, H).transpose(2, 3).reshape(batch, dim, L)

        merged = y[:, 0] + to_rows(y[:, 1]) + y[:, 2].flip(-1) + to_rows(y[:, 3].flip(-1))
        return merged.reshape(batch, dim, H, W)


def time_call(fn) -> float:
    return _time_call(fn, repeats=5)


def _session(path: Path, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _feed(session, inputs):
    return {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}


def _row(name: str, unit: str, count: int, eager_s: float, ort_s: float) -> None:
    eager, onnx = count / eager_s, count / ort_s
    print(f"| {name} | {eager:,.0f} {unit} | {onnx:,.0f} {unit} | {onnx / eager:.2f} |", flush=True)


def lm_rows(model: MambaLMHeadModel, name: str, out: Path, seqlen: int, decode: bool, threads: int) -> None:
    files = sx.lm_onnx(model, out / name, batch_size=1, max_seqlen=seqlen + 64)
    prompt = torch.randint(0, model.config.vocab_size, (1, seqlen), generator=torch.Generator().manual_seed(0))
    prefill = _session(files["prefill"], threads)
    with torch.inference_mode():
        eager = time_call(lambda: model(prompt, num_last_tokens=1))
    onnx = time_call(lambda: prefill.run(None, _feed(prefill, [prompt])))
    _row(f"{name} prefill, {seqlen} tokens", "tokens/s", seqlen, eager, onnx)
    if not decode:
        return
    outputs = prefill.run(None, _feed(prefill, [prompt]))
    step = _session(files["decode"], threads)
    token, positions = torch.tensor([[1]]), torch.tensor([seqlen])
    feed = _feed(step, [token, positions, *(torch.from_numpy(c) for c in outputs[1:])])
    tokens = 32
    onnx = time_call(lambda: [step.run(None, feed) for _ in range(tokens)])
    # eager's own token after a prompt (what generate() runs on CPU): the caches advanced in place
    memory = model.allocate_inference_cache(1, seqlen + 64)
    eager_step = model.decoding_step(memory, 1) or (lambda ids: sx.step_logits(model, memory, ids, positions))
    with torch.inference_mode():
        eager = time_call(lambda: [eager_step(token) for _ in range(tokens)])
    _row(f"{name} decoding step", "tokens/s", tokens, eager, onnx)


def scaling_rows(model: MambaLMHeadModel, name: str, out: Path, seqlens: list[int], threads: int) -> None:
    """One prefill graph (seqlen dynamic) at several prompt lengths: tokens/s should stay flat."""
    import onnx

    files = sx.lm_onnx(model, out / name, batch_size=1, max_seqlen=max(seqlens) + 64)
    graph = onnx.load(str(files["prefill"])).graph
    print(f"{name} prefill graph: {len(graph.node)} nodes, {sum(n.op_type == 'Scan' for n in graph.node)} Scan")
    prefill = _session(files["prefill"], threads)
    for seqlen in seqlens:
        prompt = torch.randint(0, model.config.vocab_size, (1, seqlen), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            eager = time_call(lambda: model(prompt, num_last_tokens=1))
        onnx_s = time_call(lambda: prefill.run(None, _feed(prefill, [prompt])))
        _row(f"{name} prefill, {seqlen} tokens", "tokens/s", seqlen, eager, onnx_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--image", type=int, default=64, help="image side (pixels); 4x4 patches")
    parser.add_argument("--images", type=int, default=8, help="images per batch")
    parser.add_argument("--scaling", type=int, nargs="*", metavar="SEQLEN",
                        help="instead: the LMs' prefill graphs at these prompt lengths (e.g. 128 512 2048 4096)")
    args = parser.parse_args()
    import onnxruntime

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, {args.threads} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| model | ssmops eager | onnxruntime | ratio (onnxruntime / eager) |")
    print("| --- | --- | --- | --- |")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, sx.quiet_torch_deprecations():
        out = Path(tmp)
        vocab = 1024
        mamba = MambaLMHeadModel(MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=vocab)).eval()
        mamba2 = MambaLMHeadModel(MambaConfig(
            d_model=args.d_model, n_layer=args.layers, vocab_size=vocab,
            ssm_cfg={"layer": "Mamba2", "d_state": 64, "headdim": 32, "chunk_size": 64})).eval()
        if args.scaling:
            for model, name in ((mamba, "Mamba LM"), (mamba2, "Mamba-2 LM")):
                scaling_rows(model, f"{name} d{args.d_model}x{args.layers}", out, args.scaling, args.threads)
            return
        lm_rows(mamba, f"Mamba LM d{args.d_model}x{args.layers}", out, args.seqlen, decode=True, threads=args.threads)
        lm_rows(mamba2, f"Mamba-2 LM d{args.d_model}x{args.layers}", out, args.seqlen, decode=False,
                threads=args.threads)
        vision = VisionMamba().eval()
        images = torch.randn(args.images, 3, args.image, args.image)
        path = sx.onnx_file(vision, (images,), out / "vision.onnx", dynamic_shapes=({},))
        session = _session(path, args.threads)
        with torch.inference_mode():
            eager = time_call(lambda: vision(images))
        onnx = time_call(lambda: session.run(None, _feed(session, [images])))
        _row(f"VMamba-style, 2 blocks, {args.image}x{args.image} images", "images/s", args.images, eager, onnx)


if __name__ == "__main__":
    main()
