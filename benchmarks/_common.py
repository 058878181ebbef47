"""Timing, peak-memory and input helpers shared by the benchmarks."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


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


def time_call(fn, repeats=3, warmup=1) -> float:
    """Median wall time of fn() in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fwd_bwd(scan, kw):
    """One forward and backward through scan(**kw) with a fixed upstream gradient."""

    def run():
        y = scan(**kw)
        y.backward(torch.ones_like(y))

    return run


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_peak_extra_mib(script: str, threads: int) -> float:
    """Runs `script` in a fresh interpreter; it must print json {"extra_mib": ...}."""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True,
        env={"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_mib"]
