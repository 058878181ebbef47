"""The `default` (pure-PyTorch) backend against what users without a native kernel run today.

    python benchmarks/default.py [--threads 2] [--quick]

Peers, as published (benchmarks/baselines.py; fetched from the package registry on first run):
(a) mamba_ssm's selective_scan_ref, a Python step per timestep over materialised
(batch, dim, seqlen, dstate) tensors; (b) mambapy's pscan, a Blelloch scan over
(batch, seqlen, dim, dstate) tensors. fp32, variable B/C, D, delta_bias, softplus.
Goals (2 threads): forward at 1x2048x2048x16 >= 3x (b) and >= 8x (a); forward+backward at
1x512x512x16 >= 1.5x (b); peak extra memory of forward+backward at seqlen 16384 (dim 256) under
a quarter of (b)'s.
"""

from __future__ import annotations

import argparse

from _common import PSCAN, REF, contenders, header, peak_memory, table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    args = parser.parse_args()
    header(args.threads)
    named = contenders(["default"])
    scale = 4 if args.quick else 1
    fwd = table("forward", (1, 2048 // scale, 2048 // scale, 16), False, named, "default")
    both = table("forward+backward", (1, 512 // scale, 512 // scale, 16), True, named, "default")
    mem_shape = (1, 256, 16384 // scale, 16)
    print(f"\npeak RSS growth of forward+backward at {mem_shape} (fresh process, inputs allocated):")
    mem = {name: peak_memory(name, mem_shape, args.threads) for name in ("default", PSCAN)}
    for name, m in mem.items():
        print(f"  {name:10s} {m['growth'] / 2**20:8.1f} MiB (its outputs and gradients: "
              f"{m['outputs_and_grads'] / 2**20:.1f} MiB)")
    ratio = mem["default"]["growth"] / mem[PSCAN]["growth"]
    print("\ngoals:")
    print(f"  forward: {fwd[PSCAN] / fwd['default']:.1f}x (b) (goal >= 3), "
          f"{fwd[REF] / fwd['default']:.1f}x (a) (goal >= 8)")
    print(f"  forward+backward: {both[PSCAN] / both['default']:.1f}x (b) (goal >= 1.5)")
    print(f"  peak memory: {ratio:.3f} of (b)'s (goal < 0.25)")


if __name__ == "__main__":
    main()
