"""The `default` (pure-PyTorch) backend against what users without a native kernel run today.

    python benchmarks/default.py [--threads 2] [--quick]

Baselines (benchmarks/baselines.py, our own code): (a) mamba_ssm's selective_scan_ref
style, a Python step per timestep over materialised (batch, dim, seqlen, dstate)
tensors; (b) mambapy's pscan style, a Blelloch scan over the same tensors; plus
mambapy itself where it is installed. fp32, variable B/C, D, delta_bias, softplus.
Prints times, the speed-up of `default` over each, and peak extra memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ssmops  # noqa: E402
from _common import fwd_bwd, measure_peak_extra_mib, scan_inputs, time_call  # noqa: E402
from baselines import mambapy_scan, pscan_scan, ref_loop_scan  # noqa: E402


def default_scan(**kw):
    with ssmops.use_backend("default"):
        return ssmops.selective_scan_fn(**kw, delta_softplus=True)


def contenders():
    named = {"default": default_scan, "(a) ref-loop": ref_loop_scan, "(b) pscan": pscan_scan}
    if mambapy_scan() is not None:
        named["mambapy"] = mambapy_scan()
    return named


def bench(title, shape, mode, repeats):
    batch, dim, seqlen, dstate = shape
    print(f"\n{title}: batch {batch}, dim {dim}, seqlen {seqlen}, dstate {dstate}, fp32")
    times = {}
    for name, scan in contenders().items():
        kw = scan_inputs(*shape, requires_grad=mode == "fwd+bwd")
        if mode == "fwd":
            with torch.no_grad():
                t = time_call(lambda: scan(**kw), repeats=repeats)
        else:
            t = time_call(fwd_bwd(scan, kw), repeats=repeats)
        times[name] = t
        rate = batch * dim * seqlen * dstate / t / 1e9
        print(f"  {name:14s} {mode:8s} {t * 1e3:9.1f} ms   {rate:6.3f} G elem/s")
    for name, t in times.items():
        if name != "default":
            print(f"  default is {t / times['default']:5.1f}x faster than {name}")
    return times


_MEMORY_SCRIPT = """
import json, torch, sys
sys.path.insert(0, "benchmarks")
import ssmops
from _common import scan_inputs, peak_rss_mib
from baselines import pscan_scan
from default import default_scan
scan = {{"default": default_scan, "pscan": pscan_scan}}["{name}"]
def run(shape):
    kw = scan_inputs(*shape, requires_grad=True)
    y = scan(**kw)
    y.backward(torch.ones_like(y))
run((1, 8, 64, 4))  # load every code path before the baseline reading
kw = scan_inputs(*{shape}, requires_grad=True)
before = peak_rss_mib()
y = scan(**kw)
y.backward(torch.ones_like(y))
print(json.dumps({{"extra_mib": peak_rss_mib() - before}}))
"""


def memory(shape, threads):
    batch, dim, seqlen, dstate = shape
    print(f"\npeak extra memory of forward+backward: batch {batch}, dim {dim}, seqlen {seqlen}, dstate {dstate}")
    io_mib = (3 * batch * dim * seqlen + 2 * batch * dstate * seqlen) * 4 * 2 / 2**20  # inputs + grads
    extra = {name: measure_peak_extra_mib(_MEMORY_SCRIPT.format(name=name, shape=shape), threads)
             for name in ("default", "pscan")}
    for name, mib in extra.items():
        print(f"  {name:8s} {mib:8.1f} MiB above its inputs (inputs+outputs+grads themselves: {io_mib:.1f} MiB)")
    print(f"  default uses {extra['default'] / extra['pscan']:.3f} of (b) pscan's extra memory")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smaller shapes, one repetition")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if args.quick:
        bench("forward", (1, 256, 256, 16), "fwd", 1)
        bench("forward+backward", (1, 128, 256, 16), "fwd+bwd", 1)
        memory((1, 64, 2048, 16), args.threads)
        return
    bench("forward", (1, 2048, 2048, 16), "fwd", 3)
    bench("forward+backward", (1, 512, 512, 16), "fwd+bwd", 3)
    memory((1, 256, 16384, 16), args.threads)


if __name__ == "__main__":
    main()
