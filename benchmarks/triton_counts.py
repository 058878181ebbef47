"""What each Triton launch of the scans moves and computes, counted by running it under Triton's interpreter.

    TRITON_INTERPRET=1 python benchmarks/triton_counts.py      # rewrites benchmarks/triton_counts.json (minutes)
    TRITON_INTERPRET=1 python benchmarks/triton_counts.py --family ssd   # recounts one family, keeps the other's
    TRITON_INTERPRET=1 python benchmarks/triton_counts.py --family ssd --knob STATE_BLOCK_N=128 --out /tmp/c.json

benchmarks/triton_static.py reads the counts; it reruns this (in a child process, since the interpreter
must be chosen before the kernels are defined) when `--count` is given, and says where a family's kernels
changed since they were counted (each family's entry holds the hash of its sources).

The interpreter runs every program of a launch with numpy, so its loads, stores, atomics, `tl.dot`s and
transcendentals can be counted exactly, loop trips and masks included, at a small shape: the scan's forward at
128 channels of one row (one program's channels, so that the B/C loads the program shares are
counted once for all of them, as at the full shape), forward and backward (two 2048-step chunks, as at the
benchmark shape), the SSD scan at one row of
512 tokens (two 256-token chunks), 16 heads of one group (a run of the backward's group kernels, which read
the group's tiles once for all its heads: counted at one head they would be charged to every head), Mamba-2's
headdim 64 and dstate 128. Per
launch it records

- requested bytes: every element a load, store or atomic touches, as often as it touches it (what the
  SMs ask of the L2; re-reads of B/C by every channel or head of a group are counted each time), and
  the 32-byte sectors each access touches (what the L2 moves for it: more than the bytes where an
  access is strided or scattered; taken over a program's whole tile, so it sees sectors left partly
  unused, not the order in which a warp's lanes ask for them),
- per buffer, the distinct bytes read and written, as a fraction of the buffer (what DRAM must move at
  least, once per buffer),
- FLOPs of `tl.dot` (2 M N K) and the transcendental results (exp, exp2, log, ...: SFU work),

and the work units the counts scale by (per launch, as its shape has them): (batch * dim * seqlen) for
the scan, (batch * nheads * seqlen) for the SSD scan, (batch * ngroups * seqlen) for its C . B^T. Every
kernel's work here is per token and channel, head or group (the state passes walk the chunks, the chunk
kernels take them in parallel), so those counts scale by the units.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
COUNTS = Path(__file__).with_name("triton_counts.json")
SOURCES = {"scan": ("ssmops/ops/selective_scan/triton_kernels.py", "ssmops/ops/selective_scan/triton.py",
                    "ssmops/ops/_triton.py"),
           "ssd": ("ssmops/ops/ssd/triton_kernels.py", "ssmops/ops/ssd/triton.py", "ssmops/ops/_triton.py")}
SCAN_SMALL = dict(batch=1, dim=128, seqlen=4096, dstate=16)
SSD_SMALL = dict(batch=1, seqlen=512, nheads=16, headdim=64, ngroups=1, dstate=128, chunk=256)
_SFU = ("exp", "exp2", "log", "log2", "sin", "cos", "sqrt", "precise_sqrt", "rsqrt")


KNOB_MODULES = {"scan": "ssmops.ops.selective_scan.triton", "ssd": "ssmops.ops.ssd.triton"}


def set_knobs(pairs: list[str]) -> dict:
    """Sets launch knobs (`NAME=VALUE`, a value of the knob's TUNING_SPACE: what SSMOPS_AUTOTUNE=1 may choose) as the
    launchers' defaults, for pricing a choice without a GPU; returns {family: {name: value}}."""
    import importlib

    chosen = collections.defaultdict(dict)
    for pair in pairs:
        name, _, text = pair.partition("=")
        family = next((f for f, m in KNOB_MODULES.items() if name in importlib.import_module(m).TUNING_SPACE), None)
        if family is None:
            raise SystemExit(f"--knob {pair}: not a tuned knob of the scans (their TUNING_SPACEs)")
        module = importlib.import_module(KNOB_MODULES[family])
        space = module.TUNING_SPACE[name]
        value = next((v for v in space if str(v) == text), None)
        if value is None:
            raise SystemExit(f"--knob {pair}: {name} takes one of {space}")
        setattr(module, name, value)
        chosen[family][name] = value
    return dict(chosen)


def source_hash(family: str) -> str:
    digest = hashlib.sha256()
    for name in SOURCES[family]:
        digest.update((REPO / name).read_bytes())
    return digest.hexdigest()[:16]


def scan_inputs(batch: int, dim: int, seqlen: int, dstate: int, dtype, device="cpu") -> tuple:
    """selective_scan_fwd's arguments as a Mamba block passes them (variable B/C, D, z, delta_bias,
    softplus). On the meta device they give the full shape's launches without data."""
    def randn(*shape, dt=dtype):
        return torch.randn(*shape).to(dt) if device == "cpu" else torch.empty(*shape, dtype=dt, device=device)

    return (randn(batch, dim, seqlen), randn(batch, dim, seqlen), randn(dim, dstate, dt=torch.float32),
            randn(batch, dstate, seqlen), randn(batch, dstate, seqlen), randn(dim, dt=torch.float32),
            randn(batch, dim, seqlen), randn(dim, dt=torch.float32), None, True)


def ssd_inputs(batch: int, seqlen: int, nheads: int, headdim: int, ngroups: int, dstate: int, chunk: int, dtype,
               device="cpu") -> tuple:
    """ssd_scan_fwd's arguments as Mamba2 passes them (D per head, z, dt_bias, softplus)."""
    def randn(*shape, dt=dtype):
        return torch.randn(*shape).to(dt) if device == "cpu" else torch.empty(*shape, dtype=dt, device=device)

    b, L, h, p, g, n = batch, seqlen, nheads, headdim, ngroups, dstate
    return (randn(b, L, h, p), randn(b, L, h), randn(h, dt=torch.float32) - 1, randn(b, L, g, n), randn(b, L, g, n),
            randn(h, dt=torch.float32), randn(b, L, h, p), randn(h, dt=torch.float32), None, None, None, chunk, True,
            [])


def recorded(family: str, fwd_args: tuple) -> list:
    """(kernel, grid, args, meta) of the forward's and then the backward's launches, launching nothing
    (the backward given a cotangent for every output)."""
    from ssmops.ops import _triton
    from ssmops.ops.selective_scan import triton as scan_triton
    from ssmops.ops.ssd import triton as ssd_triton

    launches: list = []
    launch = _triton.launch
    _triton.launch = lambda kernel, grid, args, meta: launches.append((kernel, tuple(grid), args, meta))
    try:
        if family == "scan":
            out, x, out_z, last = scan_triton.selective_scan_fwd(*fwd_args)
            scan_triton.selective_scan_bwd(*fwd_args[:9], torch.ones_like(out), x, torch.ones_like(last), fwd_args[9])
        else:
            out, final, states, varlen, ungated = ssd_triton.ssd_fwd(*fwd_args, True)  # (as autograd calls it)
            ssd_triton.ssd_bwd(*fwd_args, torch.ones_like(out), states, torch.ones_like(final), None, ungated)
    finally:
        _triton.launch = launch
    return launches


def launch_name(kernel, meta: dict) -> str:
    name = getattr(kernel, "__name__", None) or kernel.fn.__name__
    if "DB" in meta:
        name += " (dB)" if meta["DB"] else " (dC)"
    return name + (f" ({meta['MODE']})" if "MODE" in meta else "")


class _Counter:
    """Hooks on the interpreter's builder that count one launch's memory traffic, dots and SFU work."""

    def __init__(self):
        from triton.runtime.interpreter import InterpreterBuilder

        self.builder = InterpreterBuilder
        self.saved = {}
        self.reset()

    def reset(self):
        self.counts = collections.Counter()
        self.read, self.written = [], []

    def _hook(self, name, wrapper):
        self.saved[name] = original = getattr(self.builder, name)
        setattr(self.builder, name, wrapper(original))

    def __enter__(self):
        def element_bytes(ptrs):
            return ptrs.get_element_ty().primitive_bitwidth // 8

        def account(kind, ptrs, mask, accesses):
            addresses = ptrs.data[mask].astype(np.uint64)
            self.counts[kind] += addresses.size * element_bytes(ptrs)
            # the 32-byte sectors the program's tile touches: what the L2 moves for it (a scattered or
            # strided access touches more than its bytes)
            self.counts["sectors"] += np.unique(addresses // 32).size * 32
            accesses.append((addresses, element_bytes(ptrs)))

        def load(original):
            def hooked(builder, ptrs, mask, other, *rest):
                account("load", ptrs, mask.data, self.read)
                return original(builder, ptrs, mask, other, *rest)
            return hooked

        def store(original):
            def hooked(builder, ptrs, value, mask, *rest):
                account("store", ptrs, mask.data, self.written)
                return original(builder, ptrs, value, mask, *rest)
            return hooked

        def atomic(original):
            def hooked(builder, op, ptrs, value, mask, *rest):
                m = mask.data if mask is not None else np.ones_like(ptrs.data, dtype=bool)
                account("atomic", ptrs, m, self.written)
                return original(builder, op, ptrs, value, mask, *rest)
            return hooked

        def dot(original):
            def hooked(builder, a, b, *rest):
                self.counts["flop"] += 2 * a.data.shape[-2] * a.data.shape[-1] * b.data.shape[-1]
                return original(builder, a, b, *rest)
            return hooked

        def sfu(original):
            def hooked(builder, arg, *rest):
                self.counts["sfu"] += arg.data.size
                return original(builder, arg, *rest)
            return hooked

        self._hook("create_masked_load", load)
        self._hook("create_masked_store", store)
        self._hook("create_atomic_rmw", atomic)
        self._hook("create_dot", dot)
        for op in _SFU:
            if hasattr(self.builder, f"create_{op}"):
                self._hook(f"create_{op}", sfu)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(self.builder, name, original)

    def buffers(self, args: tuple) -> list:
        """Per distinct storage among the launch's tensor arguments: the first argument using it, its size,
        and the distinct bytes read and written in it."""
        storages = {}
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                storage = arg.untyped_storage()
                storages.setdefault(storage.data_ptr(), (i, storage.nbytes()))

        def distinct(accesses):
            per_storage = collections.Counter()
            if not accesses:
                return per_storage
            starts = np.array(sorted(storages), dtype=np.uint64)
            for size in {s for _, s in accesses}:
                addresses = np.unique(np.concatenate([a for a, s in accesses if s == size]))
                owner = np.searchsorted(starts, addresses, side="right") - 1
                for start, n in zip(*np.unique(owner[owner >= 0], return_counts=True)):
                    per_storage[int(starts[start])] += int(n) * size
            return per_storage

        read, written = distinct(self.read), distinct(self.written)
        return [dict(arg=i, nbytes=nbytes, read=read[ptr], written=written[ptr])
                for ptr, (i, nbytes) in sorted(storages.items(), key=lambda kv: kv[1][0])]


# Launches whose work is per group of heads (C . B^T, shared by a group's heads), not per head: their row's
# `units` is (batch * ngroups * seqlen), and `per_group` says so.
PER_GROUP = ("ssd_cb_kernel",)


def count(names=("scan", "ssd"), dtype=torch.bfloat16) -> dict:
    """Runs the small launches of the families `names` under the interpreter and returns their counts
    (TRITON_INTERPRET=1 needed)."""
    from ssmops.ops import _triton

    if not _triton.INTERPRETED:
        raise RuntimeError("run under TRITON_INTERPRET=1")
    # per family, (shape, its inputs, channels, which of the recorded launches are counted at it)
    families = {
        "scan": [(SCAN_SMALL, scan_inputs(**SCAN_SMALL, dtype=dtype), SCAN_SMALL["dim"], slice(None))],
        "ssd": [(SSD_SMALL, ssd_inputs(**SSD_SMALL, dtype=dtype), SSD_SMALL["nheads"], slice(None))],
    }
    result = dict(dtype=str(dtype).removeprefix("torch."))
    for family in names:
        parts = families[family]
        rows = []
        for shape, fwd_args, channels, launches in parts:
            for kernel, grid, args, meta in recorded(family, fwd_args)[launches]:
                with _Counter() as counter:
                    kernel[grid](*args, **meta)
                per_group = kernel.__name__ in PER_GROUP
                units = shape["batch"] * (shape["ngroups"] if per_group else channels) * shape["seqlen"]
                rows.append(dict(name=launch_name(kernel, meta), programs=int(np.prod(grid)), units=units,
                                 **({"per_group": True} if per_group else {}), **counter.counts,
                                 buffers=counter.buffers(args)))
                print(f"{family}: {rows[-1]['name']}: {dict(counter.counts)}", file=sys.stderr, flush=True)
        shape, _, channels, _ = parts[0]
        result[family] = dict(sources=source_hash(family), shape=shape,
                              units=shape["batch"] * channels * shape["seqlen"], launches=rows)
    return result


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(SOURCES), help="recount this family only (the other's counts are kept)")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="count with this launch knob (a value of its TUNING_SPACE); needs --out")
    p.add_argument("--out", type=Path, default=COUNTS, help="where to write the counts (default: %(default)s)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.knob and args.out.resolve() == COUNTS.resolve():
        p.error("--knob counts go to --out: benchmarks/triton_counts.json holds the defaults' counts")
    set_knobs(args.knob)
    counts = json.loads(args.out.read_text()) if args.family and args.out.exists() else {}
    counts.pop("sources", None)  # (older files: one hash of both families' sources)
    counts.update(count((args.family,) if args.family else tuple(SOURCES)))
    args.out.write_text(json.dumps(counts, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the interpreter must be chosen before the kernels are defined)")
    sys.exit(main())
