"""The causal conv operator's CPU backends against PyTorch's depthwise conv, at Mamba's shapes.

    python benchmarks/conv.py [--threads 1] [--quick]

Rows: Mamba-1 130m's conv (d_inner 1536, x the channel-last view of in_proj's output that the mixer
passes) and Mamba-2 780m's (xBC, conv_dim 3328, channel-last), width 4, SiLU, fp32, forward and
forward+backward (gradients of x, weight and bias). Columns: ms of the `cpu` backend (the C++ kernel),
the `default` backend (shift and add in PyTorch, the conv ssmops ran before the operator) and PyTorch's
F.conv1d(groups=dim, padding=width - 1) cut to seqlen (the causal-conv1d package's own reference), and
the speed-ups of `cpu` over each. Median of a few calls after a warm-up, in this process's CPU time (on
shared cores the time the work took, not the time other processes held the cores; with one thread, the
default, that is its wall time on an idle core).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ssmops  # noqa: E402


def conv1d_baseline(x, weight, bias):
    seqlen, width = x.shape[-1], weight.shape[1]
    return F.silu(F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])[..., :seqlen])


def on_backend(name):
    def conv(x, weight, bias):
        with ssmops.use_backend(name):
            return ssmops.causal_conv1d_fn(x, weight, bias, activation="silu")

    return conv


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e3 * statistics.median(times)


def inputs(batch, seqlen, features, dim, grad):
    """x: the first `dim` channels of a (batch, seqlen, features) projection, as a (batch, dim, seqlen) view."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seqlen, features, generator=g)[..., :dim].transpose(1, 2).requires_grad_(grad)
    return x, torch.randn(dim, 4, generator=g).requires_grad_(grad), torch.randn(dim, generator=g).requires_grad_(grad)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contenders = {"cpu": on_backend("cpu"), "default": on_backend("default"), "F.conv1d": conv1d_baseline}
    seqlen = 128 if args.quick else 1024
    shapes = {"mamba-130m x": (2 * 1536, 1536), "mamba2-780m xBC": (3072 + 3328 + 48, 3328)}  # (z, xBC, dt)
    print(f"threads {args.threads}, batch 1, seqlen {seqlen}, width 4, fp32, silu; CPU ms (median)")
    print(f"{'shape':18s} {'pass':17s}" + "".join(f"{name:>10s}" for name in contenders) + "  cpu vs default, F.conv1d")
    for label, (features, dim) in shapes.items():
        for grad in (False, True):
            x, weight, bias = inputs(1, seqlen, features, dim, grad)

            def run(conv):
                out = conv(x, weight, bias)
                if grad:
                    torch.autograd.grad(out.sum(), (x, weight, bias))

            ms = {name: median_ms(lambda c=conv: run(c), 3 if args.quick else 7) for name, conv in contenders.items()}
            print(f"{label:18s} {'forward+backward' if grad else 'forward':17s}"
                  + "".join(f"{v:10.3f}" for v in ms.values())
                  + f"  {ms['default'] / ms['cpu']:.2f}x, {ms['F.conv1d'] / ms['cpu']:.2f}x")


if __name__ == "__main__":
    main()
