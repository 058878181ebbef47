"""Inputs, timing, tables and peak-memory probes shared by the CPU benchmarks."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

import ssmops  # noqa: E402
from baselines import mamba_ssm_ref, mambapy_pscan  # noqa: E402
from peers import MAMBA_SSM_VERSION, MAMBAPY_VERSION  # noqa: E402

# the peers as published (benchmarks/baselines.py), in every table under these names
REF = "(a) mamba_ssm ref"
PSCAN = "(b) mambapy pscan"


def scan_inputs(batch, dim, seqlen, dstate, requires_grad=False, seed=0):
    """Mamba-shaped fp32 inputs: variable B/C, D, delta_bias, softplus (no z).

    Filled in place, so that making them leaves no temporaries in the peak RSS.
    """
    g = torch.Generator().manual_seed(seed)
    kw = dict(
        u=torch.empty(batch, dim, seqlen).normal_(generator=g),
        delta=torch.empty(batch, dim, seqlen).normal_(-1.0, 0.5, generator=g),
        A=torch.empty(dim, dstate).uniform_(-4.5, -0.5, generator=g),
        B=torch.empty(batch, dstate, seqlen).normal_(generator=g),
        C=torch.empty(batch, dstate, seqlen).normal_(generator=g),
        D=torch.empty(dim).normal_(generator=g),
        delta_bias=torch.empty(dim).normal_(0.0, 0.1, generator=g),
    )
    return {k: v.requires_grad_(requires_grad) for k, v in kw.items()}


def backend_scan(name):
    """selective_scan_fn on one backend, with the baselines' signature (softplus on)."""

    def scan(**kw):
        with ssmops.use_backend(name):
            return ssmops.selective_scan_fn(**kw, delta_softplus=True)

    return scan


def contenders(backends):
    """The given ssmops backends, then the peers (fetched on first use)."""
    named = {name: backend_scan(name) for name in backends}
    named.update({REF: mamba_ssm_ref(), PSCAN: mambapy_pscan()})
    return named


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_bandwidth(x: torch.Tensor, tries: int = 5) -> float:
    """Bytes per second: the fastest of `tries` sums over x (float32, far larger than the caches)."""
    x.sum()
    best = min(seconds(x.sum) for _ in range(tries))
    return x.numel() * 4 / best


def time_call(fn, repeats=3, clock=time.perf_counter) -> float:
    """Median seconds of fn() after one warm-up; a call over 5 s is timed once. `clock`:
    time.perf_counter (wall), or time.process_time (this process's CPU time: on shared cores with
    one thread, the time the work took without the time others held the core)."""
    t0 = clock()
    fn()
    first = clock() - t0
    if first > 5.0:
        return first
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def time_scan(scan, shape, backward: bool, repeats: int) -> float:
    kw = scan_inputs(*shape, requires_grad=backward)
    if not backward:
        with torch.no_grad():
            return time_call(lambda: scan(**kw), repeats)

    def run():
        y = scan(**kw)
        y.backward(torch.ones_like(y))

    return time_call(run, repeats)


def table(title, shape, backward, named, against, repeats=3) -> dict[str, float]:
    """Times every contender on the same shape and prints time, rate and how many times
    slower each is than `against`."""
    batch, dim, seqlen, dstate = shape
    work = batch * dim * seqlen * dstate
    print(f"\n{title}: batch {batch}, dim {dim}, seqlen {seqlen}, dstate {dstate}, fp32")
    print(f"  {'':18s} {'time':>10s} {'G elem/s':>9s} {against + ' speed-up':>18s}")
    times = {name: time_scan(scan, shape, backward, repeats) for name, scan in named.items()}
    for name, t in times.items():
        print(f"  {name:18s} {t * 1e3:8.1f} ms {work / t / 1e9:9.3f} {t / times[against]:17.1f}x")
    return times


_MEMORY_PROBE = """
import json, sys, torch
sys.path.insert(0, {bench_dir!r})
from _common import contenders, scan_inputs
torch.set_num_threads({threads})
scan = contenders([{name!r}] if {is_backend} else [])[{name!r}]

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

small = scan_inputs(1, 16, 64, 4, requires_grad=True)
scan(**small).sum().backward()  # thread pool, allocator, code paths
kw = scan_inputs(*{shape}, requires_grad=True)
dy = torch.ones({shape[0]}, {shape[1]}, {shape[2]})
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM (peak RSS) to the current RSS
before = status("VmRSS:")
y = scan(**kw)
y.backward(dy)
own = y.nbytes + sum(v.grad.nbytes for v in kw.values())
print(json.dumps(dict(growth=status("VmHWM:") - before, inputs=sum(v.nbytes for v in kw.values()) + dy.nbytes,
                      outputs_and_grads=own)))
"""


def peak_memory(name: str, shape, threads: int) -> dict:
    """Peak RSS growth of one forward+backward in a fresh process, with the inputs and
    the output gradient already allocated; also the bytes those occupy."""
    code = _MEMORY_PROBE.format(bench_dir=str(BENCH_DIR), threads=threads, name=name, shape=tuple(shape),
                                is_backend=name in ssmops._registry.BACKEND_NAMES)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def header(threads: int) -> None:
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"peers as published: {REF} (mamba-ssm {MAMBA_SSM_VERSION}'s sdist), {PSCAN} (mambapy {MAMBAPY_VERSION})")
