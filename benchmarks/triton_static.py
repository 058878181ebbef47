"""A speed estimate of the Triton kernels read off their compiled code: no GPU needed.

    python benchmarks/triton_static.py                 # batch 8, dim 4096, seqlen 4096, dstate 16, bf16
    python benchmarks/triton_static.py --family ssd    # the SSD scan's launches only
    python benchmarks/triton_static.py --family ssd --knob STATE_BLOCK_N=128   # a tuning choice, priced

Compiles the forward and backward launches for sm_90 (benchmarks/triton_aot.py) and
counts the instructions per (step, state) element of the loop over time: the forward's innermost loop,
a tile of steps of every state of a thread's channel; the backward's loops per tile of steps (its first
walk, the walk back and the walks from the checkpoints, each weighted by its trips). An H100 SM issues at
most 4 warp instructions and 16 ex2 (exp2) results per cycle, so a kernel needs at least

    elements * instructions per element / (SMs * 4 * 32 * clock)

seconds (and likewise for ex2), against the bytes it must move at the copy bandwidth.
Printed: those bounds and the fraction of copy bandwidth they would allow (the goals of
benchmarks/gpu.py are 70% forward, 50% backward). The instruction bound ignores memory
latency, atomics and stalls, so a kernel is at best this fast; benchmarks/gpu.py measures
on a GPU. The defaults describe an H100 SXM as the device tool lends it (132 SMs, about
3.0 TB/s device-to-device copy); the clock is its sustained 1.755 GHz.

Then the SSD scan's kernels (Mamba-2) at mamba2-2.7b's layer (batch 8, the given seqlen, nheads 80,
headdim 64, ngroups 1, dstate 128, chunk 256, the given dtype) and the multi-head decoding step: per
launch, registers, spills, warps, and of its tensor-core loop (the shortest loop holding an MMA) the
instructions per trip, the MMAs and lane shuffles among them, and the issue bound programs * trips *
instructions * warps / (SMs * 4 * clock). Against it, the forward's FLOPs (benchmarks/ssd.py's count) at
the dense bf16 rate (`--peak-tflops`).

Then the bounds (issue 41): per launch at the full shape, what the interpreter counted
(benchmarks/triton_counts.py, cached in triton_counts.json and recounted when the kernels change):
the bytes DRAM must move at least (each buffer's distinct bytes, read and written) at the copy rate,
the bytes the SMs request from the L2 (every load, re-reads included) at `--l2-tbps`, the `tl.dot`
FLOPs at the tensor-core rate (`--mma-tflops`, the measured bf16 matmul rate, which wgmma reaches;
the warp-level mma.sync that a kernel without HGMMA uses reaches about `--mma-sync-share` of it), the
SFU results (exp2, ...) at 16 per SM per cycle, and the issue slots (the tensor-core or innermost loop
times its trips; the scan's from its per-element count). Each bound is stretched by the launch's waves:
programs resident per SM from registers, warps and shared memory, and ceil(waves) / waves of the
machine used (a launch of fewer programs than slots leaves SMs idle). A kernel takes at least the
largest bound; a pass at least the sum over its launches. Beside them, the H100 times measured in
issues 41 and 42 (Triton 3.6) and measured / estimate.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from gpu import DTYPES, shape_parser  # (puts the repository on sys.path too)


def parse_args(argv=None):
    p = shape_parser(__doc__)
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--clock-ghz", type=float, default=1.755)
    p.add_argument("--copy-tbps", type=float, default=3.0, help="device-to-device copy, bytes read + written")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 tensor-core rate")
    p.add_argument("--mma-tflops", type=float, default=790.0, help="bf16 matmul rate measured on the H100 (issue 41)")
    p.add_argument("--mma-sync-share", type=float, default=0.6,
                   help="share of that rate the warp-level mma.sync (HMMA) reaches on sm_90 (published figures)")
    p.add_argument("--l2-tbps", type=float, default=5.5, help="L2-to-SM bandwidth (published H100 microbenchmarks)")
    p.add_argument("--count", action="store_true", help="recount the launches under the interpreter first (minutes)")
    p.add_argument("--no-bounds", action="store_true", help="the compiled kernels' tables only")
    p.add_argument("--family", choices=("scan", "ssd"),
                   help="one family's launches only (and --count recounts it alone)")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="price the kernels with this launch knob (a value of its TUNING_SPACE: what SSMOPS_AUTOTUNE=1 "
                        "may choose), recounting them with it (minutes)")
    return p.parse_args(argv)


def _families(args) -> tuple:
    return (args.family,) if args.family else ("scan", "ssd")


def mamba_args(dim: int, seqlen: int, dstate: int, dtype) -> tuple:
    """selective_scan_fwd arguments of one batch row as a Mamba block passes them (variable B/C,
    D, z, delta_bias, softplus). Only dtypes, strides and sizes matter to the compiled code."""
    def randn(*shape, dt=dtype):
        return torch.randn(*shape).to(dt)

    return (randn(1, dim, seqlen), randn(1, dim, seqlen), -torch.rand(dim, dstate) - 0.5, randn(1, dstate, seqlen),
            randn(1, dstate, seqlen), randn(dim, dt=torch.float32), randn(1, dim, seqlen),
            randn(dim, dt=torch.float32), None, True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import triton_aot as aot
    except ImportError as err:
        print(f"needs triton: {err}", file=sys.stderr)
        return 2
    import triton_counts

    triton_counts.set_knobs(args.knob)
    dtype = DTYPES[args.dtype]
    compiled = {}
    if "scan" in _families(args):
        compiled["scan"] = scan_rows(args, aot, dtype)
    if "ssd" in _families(args):
        compiled["ssd"] = ssd_rows(args, aot, dtype)
    if not args.no_bounds:
        bounds(args, aot, compiled)
    return 0


def scan_rows(args, aot, dtype) -> list:
    """The selective scan's compiled forward and backward at the shape of `args`."""
    # the compiled code depends on the sizes only through the tiles and their divisibility by 16, so a
    # narrow input stands for the full shape (dim 256: a whole block of the forward's channels)
    launches = aot.record_scan(mamba_args(min(args.dim, 256), args.seqlen, args.dstate, dtype))
    elements = args.batch * args.dim * args.seqlen * args.dstate
    rows = args.batch * args.dim * args.seqlen
    size = torch.finfo(dtype).bits // 8
    # u delta z | out out_z; + dout | du ddelta dz; a segmented forward's first pass: u delta
    moved = {"forward": rows * size * 5, "forward pass 1": rows * size * 2, "forward pass 2": rows * size * 5,
             "backward": rows * size * 7}
    issue_rate = args.sms * 4 * 32 * args.clock_ghz * 1e9  # lane instructions per second
    ex2_rate = args.sms * 16 * args.clock_ghz * 1e9
    copy_rate = args.copy_tbps * 1e12

    print(f"shape: batch {args.batch}, dim {args.dim}, seqlen {args.seqlen}, dstate {args.dstate}, {args.dtype}, "
          f"variable B/C, D, z, delta_bias; sm_90, {args.sms} SMs at {args.clock_ghz} GHz, copy {args.copy_tbps} TB/s")
    print(f"{'pass':<14} {'regs':>4} {'spill':>5} {'warps':>5} {'steps/thr':>9} {'instr/elt':>9} {'shfl/elt':>8} "
          f"{'ex2/elt':>7} {'ld>use':>7} {'ms issue':>8} {'ms ex2':>7} {'ms copy':>7} {'of copy':>7}")
    scan_compiled = []
    for kernel, kernel_args, meta in launches:
        name = "backward" if kernel.__name__ == "selective_scan_bwd_kernel" else \
            f"forward pass {meta['SEGMENT_PASS']}" if meta["SEGMENT_PASS"] else "forward"
        compiled = aot.compile_launch(kernel, kernel_args, meta, "sm90")
        usage = aot.resource_usage(compiled)
        loops = aot.loop_nest(compiled)
        walk = max(loops, key=lambda loop: sum(loop["own"].values())) if name == "backward" else _walk_loop(loops)
        per_element = _per_element(loops, meta) if name == "backward" else {
            op: count / (meta["BLOCK_T"] * meta["STATES"]) for op, count in walk["own"].items()}
        load_use = _load_use(aot, compiled, walk)
        steps = meta["BLOCK_T"]
        instructions = sum(per_element.values())
        t_issue = elements * instructions / issue_rate
        t_ex2 = elements * per_element.get("MUFU", 0.0) / ex2_rate
        t_copy = moved[name] / copy_rate
        scan_compiled.append(dict(compiled=compiled, usage=usage, meta=meta, issue_s=t_issue))
        print(f"{name:<14} {usage['regs']:>4} {usage['spills']:>5} {meta['num_warps']:>5} {steps:>9} "
              f"{instructions:>9.1f} {per_element.get('SHFL', 0.0):>8.2f} {per_element.get('MUFU', 0.0):>7.2f} "
              f"{load_use:>7} {t_issue * 1e3:>8.2f} {t_ex2 * 1e3:>7.2f} {t_copy * 1e3:>7.2f} "
              f"{t_copy / max(t_issue, t_ex2):>7.0%}")
    return scan_compiled


def _load_use(aot, compiled, loop: dict) -> str:
    """The `ld>use` column: the instructions between each global load of the loop and its first use, min / median."""
    distances = sorted(aot.load_use_distances(compiled, loop)) or [0]
    return f"{distances[0]}/{distances[len(distances) // 2]}"


def _innermost(loops: list) -> list:
    """The indices of the loops (aot.loop_nest's) with no loop inside them."""
    return [i for i in range(len(loops)) if not any(other["inside"] == i for other in loops)]


def _walk_loop(loops: list) -> dict:
    """The forward's loop over a tile of steps (of aot.loop_nest's): its largest innermost loop (a segmented
    forward's second pass also has the short loop over the earlier segments' states)."""
    return max((loops[i] for i in _innermost(loops)), key=lambda loop: sum(loop["own"].values()))


def _per_element(loops: list, meta: dict) -> dict:
    """The backward's instructions per (step, state), from its loops: per tile of steps, a trip of the
    first walk (its innermost loop outside the walk back), a trip of the walk back (the largest loop's own
    instructions: the tile recomputed, the adjoint, the outputs) and, inside it, (SEGMENT - 1) / 2 trips of
    the walk from the tile's checkpoint on average; the first walk's loop over segments once a SEGMENT."""
    back = max(range(len(loops)), key=lambda i: sum(loops[i]["own"].values()))
    innermost = _innermost(loops)
    first = next(i for i in innermost if i != back and loops[i]["inside"] != back)
    weights = {back: 1.0, first: 1.0}
    for i in innermost:  # (with SEGMENT 1 the compiler drops the walk from the checkpoints: no trips)
        if loops[i]["inside"] == back:
            weights[i] = (meta["SEGMENT"] - 1) / 2
    if loops[first]["inside"] is not None:
        weights[loops[first]["inside"]] = 1 / meta["SEGMENT"]
    counts = collections.Counter()
    for i, weight in weights.items():
        for op, count in loops[i]["own"].items():
            counts[op] += weight * count / (meta["BLOCK_T"] * meta["STATES"])
    return dict(counts)


def _ssd_trips(name: str, meta: dict, shape: dict) -> float:
    """Mean trips of a kernel's tensor-core loop per program: over the chunks' blocks for the backward's state
    pass (walking every chunk), over a chunk's blocks for the forward's chunk states, over the blocks before (or
    after) the program's own in the chunk kernels, and its own block's product after the loop, about a trip's
    instructions, as one more; over a run of a group's heads in the backward's group kernels (and then its
    blocks, in ssd_bwd_group_kernel's)."""
    from ssmops.ops.ssd import triton as ssd_triton

    blocks = -(-shape["chunk"] // meta["BLOCK_T"])
    nchunks = -(-shape["seqlen"] // shape["chunk"])
    heads_per_group = shape["nheads"] // shape["ngroups"]
    run = heads_per_group // ssd_triton._head_runs(heads_per_group, ssd_triton.GROUP_HEADS)
    if name == "ssd_state_grads_kernel":
        return nchunks * blocks
    if name == "ssd_chunk_states_kernel":
        return blocks
    if name == "ssd_bwd_dcb_kernel":
        return run
    if name.startswith("ssd_bwd_group_kernel"):
        return run + (blocks + 1) / 2
    return (blocks - 1) / 2 + 1


def ssd_rows(args, aot, dtype) -> None:
    from gpu import SSD_LAYER, ssd_shape
    from ssd import flops

    from ssmops.ops.state_update import triton as state_update_triton

    shape = dict(SSD_LAYER, batch=args.batch, seqlen=args.seqlen)
    h, p, g, n = (shape[k] for k in ("nheads", "headdim", "ngroups", "dstate"))

    def randn(*size, dt=dtype):
        return torch.randn(*size).to(dt)

    # batch and seqlen change no compiled code (the strides keep their divisibility by 16): one row of 512
    b, L = 1, 512
    x, B = randn(b, L, h, p), randn(b, L, g, n)
    fwd_args = (x, randn(b, L, h), -torch.rand(h) - 1, B, randn(b, L, g, n), randn(h, dt=torch.float32),
                randn(b, L, h, p), randn(h, dt=torch.float32), None, None, None, shape["chunk"], True, [])
    launches = aot.record_ssd(fwd_args)
    with aot.recorded_launches() as step:
        state_update_triton.multihead_state_update(
            torch.zeros(b, h, p, n), x[:, 0], fwd_args[1][:, 0], fwd_args[2], B[:, 0], B[:, 0], fwd_args[5], x[:, 0],
            fwd_args[7], None, True)
    grids = _ssd_grids(shape)
    compiled_launches = []
    issue_rate = args.sms * 4 * args.clock_ghz * 1e9  # warp instructions per second
    print(f"\n{ssd_shape(args)}; sm_90; forward {flops(shape) / 1e12:.2f} TFLOP: "
          f"{flops(shape) / (args.peak_tflops * 1e12) * 1e3:.2f} ms at {args.peak_tflops:.0f} TFLOP/s")
    # (cp.async: the loop's asynchronous copies, the loads Triton's pipeliner issued a trip or more ahead;
    # ld>use: instructions between each plain global load of the loop and its first use, min / median)
    print(f"{'kernel':<31} {'regs':>4} {'spill':>5} {'warps':>5} {'programs':>8} {'trips':>5} {'instr':>5} "
          f"{'mma':>4} {'shfl':>4} {'cp.async':>8} {'ld>use':>7} {'ms issue':>8}")
    for (kernel, kernel_args, meta), programs in zip(launches + step, grids):
        compiled = aot.compile_launch(kernel, kernel_args, meta, "sm90")
        usage = aot.resource_usage(compiled)
        mma_loop = aot.gemm_loop(compiled)
        loop = mma_loop["own"] if mma_loop else None
        compiled_launches.append(dict(compiled=compiled, usage=usage, meta=meta, kernel=kernel.__name__,
                                      loop_instructions=sum(loop.values()) if loop else None))
        name = kernel.__name__ + (f" ({meta['MODE']})" if "MODE" in meta else "")
        if loop is None:  # no tensor-core loop (the ddt pass, the decoding step): its size only
            print(f"{name:<31} {usage['regs']:>4} {usage['spills']:>5} {meta['num_warps']:>5} {programs:>8}")
            continue
        trips = _ssd_trips(kernel.__name__, meta, shape)
        instructions = sum(loop.values())
        t_issue = programs * trips * instructions * meta["num_warps"] / issue_rate
        mma = loop["HMMA"] + loop["HGMMA"]
        load_use = _load_use(aot, compiled, mma_loop)
        print(f"{name:<31} {usage['regs']:>4} {usage['spills']:>5} {meta['num_warps']:>5} {programs:>8} {trips:>5.1f} "
              f"{instructions:>5} {mma:>4} {loop['SHFL']:>4} {loop['LDGSTS']:>8} {load_use:>7} "
              f"{t_issue * 1e3:>8.2f}")
    return compiled_launches[:len(launches)]  # (the decoding step has no counts)


def _ssd_grids(shape: dict) -> list:
    """Programs of each launch at the full shape (the recorded launches are of a shorter input)."""
    from ssmops.ops.ssd import triton as ssd_triton

    b, L, h, p, g, n, Q = (shape[k] for k in ("batch", "seqlen", "nheads", "headdim", "ngroups", "dstate", "chunk"))
    nchunks = -(-L // Q)
    knobs = ssd_triton.TUNER.defaults()
    cfg, tiles = ssd_triton._config(Q, p, n, knobs), ssd_triton._state_tiles(p, n, knobs)
    state_programs = b * h * -(-p // tiles["BLOCK_P"]) * -(-n // tiles["BLOCK_N"])
    passing_p = ssd_triton._triton.pow2_tile(p, 16, ssd_triton.PASSING_BLOCK_P)
    passing = b * h * -(-p // passing_p) * -(-n // tiles["BLOCK_N"])
    scan = nchunks * -(-Q // cfg["BLOCK_T"]) * b * h * -(-p // cfg["BLOCK_P"])
    dx = nchunks * -(-Q // min(cfg["BLOCK_T"], ssd_triton.BWD_BLOCK_T)) * b * h
    cb = nchunks * -(-Q // cfg["BLOCK_T"]) * b * g
    group_blocks = -(-Q // ssd_triton._triton.pow2_tile(Q, 16, ssd_triton.GROUP_BLOCK_T))
    runs = b * g * ssd_triton._head_runs(h // g, ssd_triton.GROUP_HEADS)
    dcb, group = nchunks * group_blocks * (group_blocks + 1) // 2 * runs, nchunks * group_blocks * runs
    dt = nchunks * -(-Q // cfg["BLOCK_T"]) * b * h
    gate = -(-L // ssd_triton.GATE_BLOCK_T) * b * h
    return [dt, nchunks * state_programs, passing, cb, scan, dt, cb, gate, state_programs, dx, dcb, group, group,
            nchunks * b * h, b * h]



# H100 times of issues 41 and 42 (one H100 80GB HBM3, Triton 3.6, do_bench medians), per pass in ms
SSD_SHAPES = {  # (batch, seqlen, nheads, headdim, ngroups, dstate): ((forward, forward+backward), mamba_ssm's)
    (8, 4096, 80, 64, 1, 128): ((5.41, 41.7), (1.96, 8.64)),
    (1, 2048, 24, 64, 1, 128): ((0.165, 1.71), (0.687, 3.07)),
    (2, 8192, 64, 64, 8, 128): ((2.20, 17.5), (0.785, 4.11)),
}
# (batch, dim, seqlen, dstate): (forward, forward+backward) ms of the scan's kernels as they are now. The
# H100 times of issue 41 (2.41, 24.0) were the forward before issue 56 rebuilt it: not yet measured since.
SCAN_MEASURED: dict = {}
H100 = dict(regs=65536, warps=64, programs=32, smem=233472)  # per SM


def resident(usage: dict, warps: int, shared: int) -> int:
    """Programs of one launch an SM holds at once: registers (allocated per warp in units of 256),
    warps, shared memory (1 KiB reserved per program)."""
    regs_per_warp = -(-usage["regs"] * 32 // 256) * 256
    limits = [H100["programs"], H100["warps"] // warps, H100["regs"] // (regs_per_warp * warps)]
    if shared:
        limits.append(H100["smem"] // (shared + 1024))
    return max(0, min(limits))


def _counts(args) -> dict:
    """benchmarks/triton_counts.json, recounted (in a child process under the interpreter) when asked or
    missing; where the kernels' source changed since it was written, said (the counts are then stale)."""
    import json
    import os
    import subprocess
    import tempfile

    import triton_counts

    path = triton_counts.COUNTS
    if args.knob:  # (the committed counts are the defaults': these go to a file of their own, every family's)
        path = Path(tempfile.mkdtemp()) / "triton_counts.json"
        knobs = [f"--knob={pair}" for pair in args.knob] + (["--family", args.family] if args.family else [])
        print("\ncounting the launches with the knobs under the interpreter (minutes) ...", flush=True)
        subprocess.run([sys.executable, triton_counts.__file__, *knobs, "--out", str(path)],
                       env=dict(os.environ, TRITON_INTERPRET="1"), check=True, stderr=subprocess.DEVNULL)
    elif args.count or not path.exists():
        print("\ncounting the launches under the interpreter (minutes) ...", flush=True)
        family = ["--family", args.family] if args.family and path.exists() else []
        subprocess.run([sys.executable, triton_counts.__file__, *family], env=dict(os.environ, TRITON_INTERPRET="1"),
                       check=True, stderr=subprocess.DEVNULL)
    counts = json.loads(path.read_text())
    for family in _families(args):
        if counts[family].get("sources") != triton_counts.source_hash(family):
            print(f"\nNOTE: the {family} kernels changed since benchmarks/triton_counts.json was counted: rerun with "
                  "--count")
    return counts


def bounds(args, aot, compiled: dict) -> None:
    """Per launch and per pass at the full shapes: the memory, L2, tensor-core, SFU and issue bounds,
    stretched by the waves, against the measured times."""
    import triton_counts as tc

    from ssmops.ops.ssd import triton as ssd_triton

    counts = _counts(args)
    copy_rate, l2_rate = args.copy_tbps * 1e12, args.l2_tbps * 1e12
    sfu_rate = args.sms * 16 * args.clock_ghz * 1e9
    issue_rate = args.sms * 4 * args.clock_ghz * 1e9
    print(f"\nBounds per launch (ms) from the interpreter's counts ({counts['dtype']}): DRAM = distinct bytes at "
          f"{args.copy_tbps} TB/s, L2 = the 32-byte sectors of every access (atomics included; sect: the share of "
          f"their bytes used) at {args.l2_tbps} TB/s, MMA = tl.dot FLOPs "
          f"at {args.mma_tflops:.0f} TFLOP/s (HGMMA) or {args.mma_sync_share:.0%} of it (HMMA), SFU at 16/SM/clk, "
          "issue from the SASS loop; each x ceil(waves)/waves. /SM: programs resident per SM, occ: their warps of 64 "
          "(the bounds assume the latency hidden, which takes more than a few warps)")
    header = (f"{'launch':<31} {'progs':>7} {'/SM':>3} {'occ':>4} {'waves':>6} {'GB dram':>7} {'GB req':>7} "
              f"{'sect':>5} {'GB atom':>7} {'TFLOP':>6} {'mma':>5} {'Gsfu':>6} {'dram':>6} {'L2':>6} {'mma':>6} "
              f"{'sfu':>6} {'issue':>6} {'bound':>6}  by")

    def launch_rows(family: str, full_args: tuple, units: float, issue_of, group_units: float = 0.0) -> list:
        """group_units: the full shape's units of the launches counted per group (tc.PER_GROUP)."""
        family_counts = counts[family]
        full = tc.recorded(family, full_args)
        rows = []
        for i, ((kernel, grid, kargs, meta), counted, info) in enumerate(zip(full, family_counts["launches"],
                                                                              compiled[family])):
            assert tc.launch_name(kernel, meta) == counted["name"], (tc.launch_name(kernel, meta), counted["name"])
            # (each launch counted at its own small shape, in units per channel or head, or per group)
            scale = (group_units if counted.get("per_group") else units) / counted.get("units", family_counts["units"])
            programs = int(torch.tensor(grid).prod())
            shared = info["compiled"].metadata.shared
            per_sm = resident(info["usage"], meta["num_warps"], shared)
            waves = programs / (args.sms * per_sm)
            stretch = -(-programs // (args.sms * per_sm)) / waves
            dram = sum((b["read"] + b["written"]) / b["nbytes"] * _nbytes(kargs[b["arg"]]) for b in counted["buffers"])
            requested = (counted.get("load", 0) + counted.get("store", 0) + counted.get("atomic", 0)) * scale
            sectors = counted.get("sectors", requested / scale) * scale  # (older counts: bytes only)
            ops = aot.sass_opcodes(info["compiled"])
            mma = "HGMMA" if ops["HGMMA"] else "HMMA" if ops["HMMA"] else "-"
            flop = counted.get("flop", 0) * scale
            mma_rate = args.mma_tflops * 1e12 * (1.0 if mma == "HGMMA" else args.mma_sync_share)
            times = dict(dram=dram / copy_rate, L2=sectors / l2_rate, mma=flop / mma_rate,
                         sfu=counted.get("sfu", 0) * scale / sfu_rate, issue=issue_of(i, info, meta, programs))
            times = {k: (v * stretch if v is not None else None) for k, v in times.items()}
            binding = max((k for k in times if times[k] is not None), key=lambda k: times[k])
            rows.append(dict(name=counted["name"], bound=times[binding]))
            cells = " ".join(f"{v * 1e3:>6.2f}" if v is not None else f"{'-':>6}" for v in times.values())
            print(f"{counted['name']:<31} {programs:>7} {per_sm:>3} {per_sm * meta['num_warps'] / H100['warps']:>4.0%} "
                  f"{waves:>6.1f} {dram / 1e9:>7.2f} "
                  f"{requested / 1e9:>7.2f} {requested / sectors:>5.0%} {counted.get('atomic', 0) * scale / 1e9:>7.2f} "
                  f"{flop / 1e12:>6.3f} "
                  f"{mma:>5} {counted.get('sfu', 0) * scale / 1e9:>6.2f} {cells} {times[binding] * 1e3:>6.2f}  "
                  f"{binding}")
        return rows

    def passes(rows: list, forward_launches: int, measured, outside: float = 0.0) -> None:
        """outside: seconds of the backward's torch operations between the launches."""
        fwd = sum(r["bound"] for r in rows[:forward_launches])
        both = sum(r["bound"] for r in rows) + outside
        for name, est, (mine, peer) in zip(("forward", "forward+backward"), (fwd, both), zip(*measured)):
            measured_cell = f"measured {mine:.3g} ms: {mine / (est * 1e3):.1f}x the estimate" if mine else ""
            measured_cell += f"; mamba_ssm {peer:.3g} ms" if peer else ""
            print(f"  {name:<17} estimate {est * 1e3:7.3f} ms   {measured_cell}")

    if "scan" in compiled:
        b, d, L, n = args.batch, args.dim, args.seqlen, args.dstate
        print(f"\nselective scan: batch {b}, dim {d}, seqlen {L}, dstate {n}")
        print(header)
        rows = launch_rows("scan", tc.scan_inputs(b, d, L, n, DTYPES[args.dtype], device="meta"), b * d * L,
                           lambda i, info, meta, programs: info["issue_s"])
        measured = SCAN_MEASURED.get((b, d, L, n)) if args.dtype == "bfloat16" else None
        passes(rows, sum(row["name"] == "selective_scan_fwd_kernel" for row in rows),
               (measured or (None, None), (None, None)))
    if "ssd" not in compiled:
        return

    # the SSD scan, at the three shapes of issue 41
    def ssd_issue(i, info, meta, programs, shape=None):
        if info["loop_instructions"] is None:
            return None
        return programs * _ssd_trips(info["kernel"], meta, shape) * info["loop_instructions"] * meta["num_warps"] / \
            issue_rate

    for (b, L, h, p, g, n), measured in SSD_SHAPES.items():
        shape = dict(batch=b, seqlen=L, nheads=h, headdim=p, ngroups=g, dstate=n, chunk=256)
        print(f"\nSSD scan: batch {b}, seqlen {L}, nheads {h}, headdim {p}, ngroups {g}, dstate {n}, chunk 256")
        print(header)
        rows = launch_rows("ssd", tc.ssd_inputs(**shape, dtype=DTYPES[args.dtype], device="meta"), b * h * L,
                           lambda i, info, meta, programs: ssd_issue(i, info, meta, programs, shape), b * g * L)
        # the backward's float32 dB and dC, one per run of a group's heads, summed (or converted) by torch: read once
        runs = 2 * ssd_triton._head_runs(h // g, ssd_triton.GROUP_HEADS) * b * L * g * n * 4
        print(f"{'(torch: dB/dC sums over runs)':<31} {runs / 1e9:>33.2f} GB read: "
              f"{runs / copy_rate * 1e3:.2f} ms at the copy rate, in forward+backward")
        # (the forward's launches: those before the backward's own ssd_dt_kernel)
        forward_launches = [row["name"] for row in rows].index("ssd_dt_kernel", 1)
        passes(rows, forward_launches, measured if args.dtype == "bfloat16" else ((None, None), (None, None)),
               runs / copy_rate)


def _nbytes(t) -> int:
    return t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0


if __name__ == "__main__":
    sys.exit(main())
