"""The decoding projections at batch 1 against the memory's read bandwidth: ssmops'
`weight_only_linear` with fp32, bf16 and int8 weights, torch's `nn.Linear` (fp32), and torchao's
int8 weight-only quantization as published (`quantize_(layer, Int8WeightOnlyConfig())`, eager and
under `torch.compile`), at mamba-130m's matrix shapes.

    python benchmarks/linear.py [--threads 2] [--batch 1] [--repeats 20] [--quick]

Why it exists: a decoding token multiplies every weight once, so an int8 layer can be up to 4x an
fp32 one, and decoding's int8 goal (2.5x fp32's tokens/s) needs a layer that streams its int8
weights at the memory's speed. PyTorch's own library for weight-only quantization is torchao, which
ssmops would use rather than its own kernels if it got there on CPU; this prints how far it gets.
Each row: the median time of a call (after warm-up), the weights' bytes over that time, and that as
a share of the read bandwidth (`torch.sum` over 512 MiB, the fastest of five, measured before and
after each shape's rows: the highest is taken). The rows of a shape take turns, `--repeats` rounds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
from _common import read_bandwidth, seconds  # noqa: E402

from ssmops.modules.linear import quantize_int8  # noqa: E402

# mamba-130m's projections: (name, out_features, in_features)
SHAPES = [("in_proj", 3072, 768), ("x_proj", 80, 1536), ("out_proj", 768, 1536), ("lm_head", 50280, 768)]
QUICK_SHAPES = [("in_proj", 1024, 256)]  # one shape: a smoke test (each shape compiles torchao's layer anew)


def contenders(weight: torch.Tensor, torchao) -> dict:
    """name -> (bytes of weights a call reads, fn(x)), all computing x @ weight.T (int8: rounded)."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight)
    int8, scale = quantize_int8(weight)
    bf16 = weight.bfloat16()
    quantized = copy.deepcopy(layer)
    torchao.quantization.quantize_(quantized, torchao.quantization.Int8WeightOnlyConfig())
    ops = torch.ops.ssmops
    n = weight.numel()
    return {
        "torch nn.Linear fp32": (4 * n, layer),
        "ssmops fp32": (4 * n, lambda x: ops.weight_only_linear(x, weight, None, None)),
        "ssmops bf16": (2 * n, lambda x: ops.weight_only_linear(x, bf16, None, None)),
        "ssmops int8": (n + 4 * weight.shape[0], lambda x: ops.weight_only_linear(x, int8, scale, None)),
        "torchao int8 (eager)": (n + 4 * weight.shape[0], quantized),
        "torchao int8 (compiled)": (n + 4 * weight.shape[0], torch.compile(quantized, fullgraph=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="rows of x (sequences decoded together)")
    parser.add_argument("--repeats", type=int, default=20, help="rounds of calls, the contenders in turn")
    parser.add_argument("--quick", action="store_true", help="small shapes, few rounds (a smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")  # torchao's, under torch.compile
    torchao = peers.torchao()
    shapes, repeats = (QUICK_SHAPES, 3) if args.quick else (SHAPES, args.repeats)
    probe = torch.ones((64 if args.quick else 512) * 2**20 // 4)
    print(f"torch {torch.__version__}, torchao {torchao.__version__}, {args.threads} threads, batch {args.batch}")
    print(f"\n  {'layer':9s} {'shape':>12s} {'contender':24s} {'us':>9s} {'GB/s':>6s} {'of bandwidth':>12s} "
          f"{'vs ssmops int8':>14s}")
    gen = torch.Generator().manual_seed(0)
    slowest_torchao = 0.0
    with torch.inference_mode():
        for name, out_features, in_features in shapes:
            weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
            x = torch.randn(args.batch, in_features, generator=gen)
            rows = contenders(weight, torchao)
            expected = x @ weight.T
            for label, (_, fn) in rows.items():  # warm-up (and compile), and the same product from each
                got = fn(x)
                error = (got - expected).abs().max() / expected.abs().max()
                if error > (2e-2 if "int8" in label or "bf16" in label else 1e-5):
                    sys.exit(f"{label} computes another product at {name}: relative error {error:.2e}")
            times = {label: [] for label in rows}
            bandwidth = read_bandwidth(probe)
            for _ in range(repeats):
                for label, (_, fn) in rows.items():
                    times[label].append(seconds(lambda fn=fn: fn(x)))
            bandwidth = max(bandwidth, read_bandwidth(probe))
            medians = {label: statistics.median(t) for label, t in times.items()}
            for label, (weight_bytes, _) in rows.items():
                rate = weight_bytes / medians[label]
                ratio = medians["ssmops int8"] / medians[label]
                print(f"  {name:9s} {f'{out_features}x{in_features}':>12s} {label:24s} {medians[label] * 1e6:9.1f} "
                      f"{rate / 1e9:6.1f} {rate / bandwidth:11.0%} {ratio:13.3f}x", flush=True)
                if label.startswith("torchao"):
                    slowest_torchao = max(slowest_torchao, medians[label] / medians["torch nn.Linear fp32"])
            print(f"  {'':9s} {'':12s} (read bandwidth {bandwidth / 1e9:.1f} GB/s)")
    print(f"\ntorchao's int8 layers take up to {slowest_torchao:.2f}x the time of torch's fp32 nn.Linear on the same "
          "shape (an int8 layer that streams its weights would take ~0.25x)")


if __name__ == "__main__":
    main()
