"""The native `cpu` backend against `default` and the baselines users run today.

    python benchmarks/cpu.py [--threads 2] [--quick] [--plot FILE.png]

Peers as in benchmarks/default.py, as published: (a) mamba_ssm's selective_scan_ref,
(b) mambapy's pscan (benchmarks/baselines.py; fetched on first run). Rates are in
G (batch * dim * seqlen * dstate) / s. Goals (2 threads, fp32): forward at
1x2048x2048x16 >= 1.5 G/s, ~50x (a) and ~14x (b); forward+backward at 1x512x512x16
>= 4x (b); peak memory growth of forward+backward at seqlen 65536 (dim 256) within 2x
of what inputs, outputs and gradients occupy. `--plot` draws forward time against
seqlen (log-log) for every contender.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import ssmops
from _common import PSCAN, REF, contenders, header, peak_memory, table, time_scan


def native_isa() -> str:
    """The instruction-set path the library's dispatcher picked (SSMOPS_CPU_ISA forces one)."""
    try:
        fn = ctypes.CDLL(ssmops.library_path()).ssmops_cpu_isa
    except (OSError, AttributeError, FileNotFoundError) as err:
        return f"unknown ({err})"
    fn.restype = ctypes.c_char_p
    return fn().decode()


def plot(path: str, named: dict, seqlens) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); no plot written")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, scan in named.items():
        times = [time_scan(scan, (1, 256, L, 16), False, 1) for L in seqlens]
        ax.loglog(seqlens, [t * 1e3 for t in times], marker="o", label=name)
    ax.set_xlabel("seqlen (batch 1, dim 256, dstate 16)")
    ax.set_ylabel("forward time (ms)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    print(f"\nplot written to {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--plot", metavar="FILE.png", help="also plot forward time against seqlen")
    args = parser.parse_args()
    if ssmops.available_backends()["cpu"] != "available":
        sys.exit(f"the cpu backend is not available: {ssmops.available_backends()['cpu']}")
    header(args.threads)
    print(f"ssmops cpu kernel path: {native_isa()} (SSMOPS_CPU_ISA={os.environ.get('SSMOPS_CPU_ISA', 'auto')})")
    named = contenders(["cpu", "default"])
    scale = 4 if args.quick else 1
    fwd_shape = (1, 2048 // scale, 2048 // scale, 16)
    fwd = table("forward", fwd_shape, False, named, "cpu", repeats=5)
    both = table("forward+backward", (1, 512 // scale, 512 // scale, 16), True, named, "cpu", repeats=5)
    mem_shape = (1, 256, 65536 // scale, 16)
    mem = peak_memory("cpu", mem_shape, args.threads)
    own = mem["inputs"] + mem["outputs_and_grads"]
    print(f"\npeak RSS growth of forward+backward at {mem_shape} (fresh process, inputs and dout allocated):")
    print(f"  cpu {mem['growth'] / 2**20:.1f} MiB; inputs {mem['inputs'] / 2**20:.1f} MiB, outputs + gradients "
          f"{mem['outputs_and_grads'] / 2**20:.1f} MiB")
    print("\ngoals:")
    print(f"  forward rate {fwd_shape[1] * fwd_shape[2] * fwd_shape[3] / fwd['cpu'] / 1e9:.2f} G/s (goal >= 1.5)")
    print(f"  forward {fwd[REF] / fwd['cpu']:.1f}x (a) (goal ~50), {fwd[PSCAN] / fwd['cpu']:.1f}x (b) (goal ~14)")
    print(f"  forward+backward {both[PSCAN] / both['cpu']:.1f}x (b) (goal >= 4)")
    print(f"  peak memory growth / (inputs + outputs + gradients) = {mem['growth'] / own:.2f} (goal <= 2)")
    if args.plot:
        plot(args.plot, named, [256, 1024, 4096] if args.quick else [256, 1024, 4096, 16384])


if __name__ == "__main__":
    main()
