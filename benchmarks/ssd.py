"""Mamba-2's SSD scan on CPU against mamba_ssm's own pure-PyTorch SSD, and the decoding step.

    python benchmarks/ssd.py [--threads 2] [--quick]

The peer is `ssd_minimal_discrete` (mamba_ssm/modules/ssd_minimal.py), taken from mamba-ssm's
published sdist at run time (benchmarks/peers.py; needs einops) and timed as it is: it takes
discretised inputs (x * dt, A * dt) and B/C per head, and its backward is autograd through it.
ssmops runs `mamba_chunk_scan_combined` on the same values (dt already positive, no softplus,
no D/z) on each CPU backend. Shape: mamba2-130m's layer (batch 1, seqlen 4096, nheads 24,
headdim 64, ngroups 1, dstate 128, chunk 256), fp32. Goals: forward >= 8x the peer and at
>= 50% of torch.mm's 2048x2048 FLOP rate in the same run (counting 4*b*L*h*p*n + 2*b*L*Q*g*n +
b*L*Q*h*p FLOPs); forward+backward >= 5x; peak extra memory of forward+backward at seqlen
16384 <= 1/10 of the peer's. Then the multi-head decoding step at mamba2-130m's shape, native
against default, in microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from _common import BENCH_DIR, time_call

import ssmops  # noqa: E402  (_common puts the repository first on the path)

PEER = "mamba_ssm minimal"
SHAPE = dict(batch=1, seqlen=4096, nheads=24, headdim=64, ngroups=1, dstate=128, chunk=256)


def ssd_inputs(batch, seqlen, nheads, headdim, ngroups, dstate, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    kw = dict(
        x=torch.empty(batch, seqlen, nheads, headdim).normal_(generator=g),
        dt=torch.empty(batch, seqlen, nheads).uniform_(0.001, 0.1, generator=g),
        A=-torch.empty(nheads).uniform_(1.0, 16.0, generator=g),
        B=torch.empty(batch, seqlen, ngroups, dstate).normal_(generator=g),
        C=torch.empty(batch, seqlen, ngroups, dstate).normal_(generator=g),
    )
    return {k: v.requires_grad_(requires_grad) for k, v in kw.items()}


def contenders(chunk: int) -> dict:
    """name -> fn(x, dt, A, B, C) -> y: the peer and every available ssmops CPU backend."""
    from peers import ssd_minimal_discrete

    peer = ssd_minimal_discrete()

    def mamba_ssm_minimal(x, dt, A, B, C):
        nheads = x.shape[2]
        B, C = (M.expand(*M.shape[:2], nheads, M.shape[-1]) for M in (B, C))  # its B/C are per head
        y, _ = peer(x * dt[..., None], A * dt, B, C, chunk)
        return y

    def on(backend):
        def run(x, dt, A, B, C):
            with ssmops.use_backend(backend):
                return ssmops.mamba_chunk_scan_combined(x, dt, A, B, C, chunk)

        return run

    named = {PEER: mamba_ssm_minimal}
    named.update({f"ssmops {b}": on(b) for b in ("default", "cpu") if ssmops.available_backends()[b] == "available"})
    return named


def time_ssd(fn, shape: dict, backward: bool, repeats: int) -> float:
    kw = ssd_inputs(*(shape[k] for k in ("batch", "seqlen", "nheads", "headdim", "ngroups", "dstate")),
                    requires_grad=backward)
    if not backward:
        with torch.no_grad():
            return time_call(lambda: fn(**kw), repeats)
    return time_call(lambda: fn(**kw).sum().backward(), repeats)


def flops(shape: dict) -> float:
    b, L, h, p, g, n, Q = (shape[k] for k in ("batch", "seqlen", "nheads", "headdim", "ngroups", "dstate", "chunk"))
    return 4 * b * L * h * p * n + 2 * b * L * Q * g * n + b * L * Q * h * p


def mm_rate(repeats: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / time_call(lambda: torch.mm(a, b), repeats)


_MEMORY_PROBE = """
import json, sys, torch
sys.path.insert(0, {bench_dir!r})
from ssd import contenders, ssd_inputs
torch.set_num_threads({threads})
fn = contenders({chunk})[{name!r}]

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

fn(**ssd_inputs(1, 2 * {chunk}, 2, 4, 1, 8, requires_grad=True)).sum().backward()  # warm-up
kw = ssd_inputs(*{shape}, requires_grad=True)
dy = torch.ones_like(kw["x"])  # a dense output gradient, as a loss gives
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM (peak RSS) to the current RSS
before = status("VmRSS:")
fn(**kw).backward(dy)
print(json.dumps(dict(growth=status("VmHWM:") - before, inputs=sum(v.nbytes for v in kw.values()) + dy.nbytes)))
"""


def peak_memory(name: str, shape: dict, threads: int) -> dict:
    """Peak RSS growth of one forward+backward in a fresh process, the inputs and the output
    gradient already allocated (as benchmarks/_common.py measures the Mamba-1 scan)."""
    dims = tuple(shape[k] for k in ("batch", "seqlen", "nheads", "headdim", "ngroups", "dstate"))
    code = _MEMORY_PROBE.format(bench_dir=str(BENCH_DIR), threads=threads, name=name, shape=dims, chunk=shape["chunk"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_step(batch: int, repeats: int = 200) -> dict[str, float]:
    """Microseconds per multi-head decoding step at mamba2-130m's shape (dt/A/dt_bias tied per head
    as Mamba2 passes them, D per head, z): each CPU backend's kernel, and the front end
    `selective_state_update` as a model calls it (native where the library is loaded)."""
    h, p, n = SHAPE["nheads"], SHAPE["headdim"], SHAPE["dstate"]
    g = torch.Generator().manual_seed(0)
    kw = dict(state=torch.randn(batch, h, p, n, generator=g), x=torch.randn(batch, h, p, generator=g),
              dt=torch.rand(batch, h, generator=g)[..., None].expand(batch, h, p),
              A=(-torch.rand(h, generator=g))[:, None, None].expand(h, p, n),
              B=torch.randn(batch, 1, n, generator=g), C=torch.randn(batch, 1, n, generator=g),
              D=torch.randn(h, generator=g), z=torch.randn(batch, h, p, generator=g),
              dt_bias=torch.rand(h, generator=g)[:, None].expand(h, p), dt_softplus=True)
    # the operator's arguments: the per-head forms the front end passes for tied views
    args = (kw["state"], kw["x"], kw["dt"][..., 0], kw["A"][:, 0, 0], kw["B"], kw["C"], kw["D"], kw["z"],
            kw["dt_bias"][:, 0], None, True)
    kernels = {"default": ssmops._registry.kernels("default")["multihead_state_update"]}
    if ssmops.available_backends()["cpu"] == "available":
        kernels["native"] = torch.ops.ssmops.multihead_state_update.default  # the library's CPU kernel
    times = {name: time_call(lambda: kernel(*args), repeats) * 1e6 for name, kernel in kernels.items()}
    times["front end"] = time_call(lambda: ssmops.selective_state_update(**kw), repeats) * 1e6
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="seqlen / 4")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = dict(SHAPE, seqlen=SHAPE["seqlen"] // (4 if args.quick else 1))
    named = contenders(shape["chunk"])
    rate = mm_rate(args.repeats)
    print(f"torch {torch.__version__}, {args.threads} threads; torch.mm 2048x2048 fp32: {rate / 1e9:.0f} GFLOP/s")
    print(f"shape {shape}, fp32; {flops(shape) / 1e9:.2f} GFLOP per forward")
    results = {}
    for title, backward in (("forward", False), ("forward+backward", True)):
        times = {name: time_ssd(fn, shape, backward, args.repeats) for name, fn in named.items()}
        print(f"\n{title}:\n  {'':18s} {'time':>10s} {'GFLOP/s':>8s} {'of mm':>6s} {'vs ' + PEER:>21s}")
        for name, t in times.items():
            rates = "" if backward else f"{flops(shape) / t / 1e9:8.1f} {flops(shape) / t / rate:6.0%}"
            print(f"  {name:18s} {t * 1e3:8.1f} ms {rates:>15s} {times[PEER] / t:20.1f}x")
        results[title] = times
    mem_shape = dict(shape, seqlen=16384 // (4 if args.quick else 1))
    print(f"\npeak RSS growth of forward+backward at seqlen {mem_shape['seqlen']} (fresh process, inputs and "
          "output gradient allocated):")
    mem = {name: peak_memory(name, mem_shape, args.threads)["growth"] for name in named}
    for name, growth in mem.items():
        print(f"  {name:18s} {growth / 2**20:9.1f} MiB  ({growth / mem[PEER]:.3f} of the peer's)")
    print("\nmulti-head decoding step (selective_state_update, Mamba-2 layout), microseconds per call:")
    for batch in (1, 16):
        step = decode_step(batch)
        native = f"  (native {step['default'] / step['native']:.1f}x default)" if "native" in step else ""
        print(f"  batch {batch:3d}: " + ", ".join(f"{k} {v:8.1f} us" for k, v in step.items()) + native)

    def best(times: dict) -> tuple[str, float]:
        return min(((n, t) for n, t in times.items() if n != PEER), key=lambda item: item[1])

    (fwd_name, fwd), (_, both) = best(results["forward"]), best(results["forward+backward"])
    print(f"\ngoals (fastest ssmops backend on CPU here: {fwd_name}):")
    print(f"  forward: {results['forward'][PEER] / fwd:.1f}x the peer (goal >= 8), "
          f"{flops(shape) / fwd / rate:.0%} of torch.mm's rate (goal >= 50%)")
    print(f"  forward+backward: {results['forward+backward'][PEER] / both:.1f}x the peer (goal >= 5)")
    print(f"  peak memory: {min(g for n, g in mem.items() if n != PEER) / mem[PEER]:.3f} of the peer's (goal <= 0.1)")

if __name__ == "__main__":
    main()
