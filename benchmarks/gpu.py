"""GPU benchmark of the Triton backend: time, effective bandwidth and speed-ups.

    python benchmarks/gpu.py                       # batch 8, dim 4096, seqlen 4096, dstate 16, bf16
    python benchmarks/gpu.py --seqlen 2048 --dtype float16
    python benchmarks/gpu.py --sweep --skip-baselines   # also time other tile sizes
    python benchmarks/gpu.py --autotune                 # also the scans with SSMOPS_AUTOTUNE=1, and their choices

Prints, for forward and backward: the time of the Triton operators, their effective
bandwidth (the bytes the operator must read and write, divided by its time) as a
fraction of the GPU's measured copy bandwidth (a large `empty_like(x).copy_(x)`), and
the speed-up over the `default` backend and over the torch.compile'd reference. The
compiled reference unrolls one step per timestep, so it is compiled and timed at
`--ref-seqlen` steps and scaled linearly to the full seqlen (marked `~`).
Goals (issue 42): forward >= 50% of copy bandwidth, forward+backward >= 25%. Then Mamba-1's
decoding step (`selective_state_update`, dim 5120, dstate 16, float32 state) at batch 1 and 64,
eager and replayed from a CUDA graph, against mamba_ssm's Triton step. `--sweep` times the
scan kernels with other warp counts, tiles, checkpoint segments and dB/dC sums in place of the
launchers' choice, and the SSD scan's with other warps, tiles and pipelining stages (ssd_sweep()), to retune
them (`python benchmarks/gpu.py --sweep --skip-baselines`).

Then Mamba-2's SSD scan at the three shapes of issue 41 (SSD_SHAPES: mamba2-2.7b's layer at batch 8,
seqlen 4096; mamba2-130m's at batch 1, seqlen 2048; 64 heads of 8 groups at batch 2, seqlen 8192; chunk
256; D per head, z, dt_bias, softplus, as Mamba2 calls it): forward
and forward+backward of `mamba_chunk_scan_combined` on the Triton kernels, in ms and TFLOP/s
(benchmarks/ssd.py's FLOP count; forward+backward counted as 3x the forward), against
mamba_ssm's `mamba_chunk_scan_combined` when it is installed, the `default` backend and a
torch.compile'd chunked reference (not with --skip-baselines), and the fraction of the bf16 matmul
rate measured here (8192^3). Goals on an H100 (issue 41): forward >= 1.5x mamba_ssm, forward+backward
>= 1.3x. Then the multi-head decoding step at mamba2-2.7b's layer in microseconds, batch 1 and 64,
eager and graphed, against mamba_ssm's.

Then the causal conv (issue 60) over mamba2-2.7b's xBC: forward and forward+backward of its front end on the
Triton kernels, on the `default` backend (the shift-and-add ssmops ran before the operator) and F.conv1d.

Then whole-model decoding (issue 57): `generate` of a Mamba and a Mamba-2 LM at the shapes of
mamba-130m / mamba2-130m (d_model 768, 24 layers) and mamba-2.8b / mamba2-2.7b (d_model 2560, 64 layers),
random weights in the given dtype, batch 1, a 16-token prompt: tokens per second eager and with `cg=True`
(the whole token one compiled graph, compiled before timing), prefill excluded. `--decoding` runs only the
decoding rows (both steps and generate), `--lm-shapes 130m` only the small models.

Then each Triton pass kernel by kernel (`--parts kernels`, torch.profiler): the Mamba-1 scan's forward and
backward, and the SSD's forward+backward at each --ssd-shapes, every kernel's time a call.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shape_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the benchmark shape (also benchmarks/triton_static.py's)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--dstate", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    return p


def parse_args(argv=None):
    p = shape_parser(__doc__)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ref-seqlen", type=int, default=256, help="seqlen at which the compiled reference is timed")
    p.add_argument("--skip-baselines", action="store_true", help="time the Triton operators only")
    p.add_argument("--sweep", action="store_true", help="also time the kernels with other warp counts")
    p.add_argument("--autotune", action="store_true",
                   help="also time the scans with SSMOPS_AUTOTUNE=1 (choices kept in a temporary file)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 rate (H100 SXM: 989)")
    p.add_argument("--decoding", action="store_true", help="only the decoding rows: both steps and generate")
    p.add_argument("--lm-shapes", default=",".join(LM_SHAPES), help="the LM shapes generate runs (comma-separated)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generate decodes per timed run")
    p.add_argument("--parts", help=f"what to time, comma-separated, of {', '.join(PARTS)} (default: all but the "
                   "sweeps; with --sweep, the sweeps too; with --decoding, decode,ssd-decode,generate)")
    p.add_argument("--ssd-shapes", default=",".join(map(str, range(len(SSD_SHAPES)))),
                   help="the SSD rows' and sweep's shapes, as indices into SSD_SHAPES (comma-separated)")
    p.add_argument("--sweep-values", default="",
                   help="the knob values the scans' sweeps time, as NAME=VALUE,... (NAME=VALUE+NAME=VALUE: a row that "
                        "sets both; default: each knob's every value)")
    args = p.parse_args(argv)
    if args.parts is None:
        parts = ["decode", "ssd-decode", "generate"] if args.decoding else [p for p in PARTS if p not in SWEEPS]
        args.parts = ",".join(parts + (SWEEPS if args.sweep else []))
    args.ssd_shapes = [SSD_SHAPES[int(i)] for i in args.ssd_shapes.split(",")]
    return args


def make_inputs(batch, dim, seqlen, dstate, dtype, device="cuda", seed=0):
    """Mamba-shaped inputs: variable B/C, D, z, delta_bias, softplus."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device=device).to(dt)

    return dict(
        u=randn(batch, dim, seqlen), delta=(randn(batch, dim, seqlen, dt=torch.float32) * 0.5 - 1.0).to(dtype),
        A=-torch.rand(dim, dstate, generator=g, device=device) * 4 - 0.5,
        B=randn(batch, dstate, seqlen), C=randn(batch, dstate, seqlen),
        D=randn(dim, dt=torch.float32), z=randn(batch, dim, seqlen),
        delta_bias=randn(dim, dt=torch.float32) * 0.1, delta_softplus=True,
    )


def cuda_time(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` CUDA-event-timed calls, after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 1 << 31, repeats: int = 20) -> float:
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.random_()
    y = torch.empty_like(x)
    return 2 * nbytes / cuda_time(lambda: y.copy_(x), repeats)  # read + write


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def op_args(kw):
    return (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"], None,
            kw["delta_softplus"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA (or ROCm) device; none is available here.", file=sys.stderr)
        return 2
    import ssmops

    status = ssmops.available_backends()["triton"]
    if status != "available":
        print(f"the triton backend is not available: {status}", file=sys.stderr)
        return 2
    if args.autotune:  # (nothing read from, or left in, the user's file of choices)
        os.environ["SSMOPS_TUNING_CACHE"] = os.path.join(tempfile.mkdtemp(), "tuning.json")
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"--parts: unknown {unknown}; the parts are {', '.join(PARTS)}", file=sys.stderr)
        return 2
    args.copy_rate = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}\n"
          f"copy bandwidth: {args.copy_rate / 1e9:.0f} GB/s")
    for part in PARTS:  # in this order, whatever the order asked
        if part in parts:
            PARTS[part](args)
    return 0


def scan_launches(args) -> tuple:
    """The Mamba-1 scan's Triton operators at the benchmark's shape: (their arguments, forward and backward,
    and the bytes each must move: every input read once, every output written once)."""
    kw = make_inputs(args.batch, args.dim, args.seqlen, args.dstate, DTYPES[args.dtype])
    fargs = op_args(kw)
    out, x, out_z, last = torch.ops.ssmops.selective_scan_fwd_triton.default(*fargs)
    bargs = fargs[:9] + (torch.randn_like(out_z), x, None, kw["delta_softplus"])
    grads = torch.ops.ssmops.selective_scan_bwd_triton.default(*bargs)
    fwd_bytes = nbytes(*[a for a in fargs if isinstance(a, torch.Tensor)], out, x, out_z, last)
    bwd_bytes = nbytes(*[a for a in bargs if isinstance(a, torch.Tensor)], *grads)
    return fargs, bargs, fwd_bytes, bwd_bytes


def scan_rows(args) -> None:
    """The Mamba-1 scan's table (the module's docstring), and with --autotune its tuned rows."""
    dtype = DTYPES[args.dtype]
    fwd_op = torch.ops.ssmops.selective_scan_fwd_triton.default
    bwd_op = torch.ops.ssmops.selective_scan_bwd_triton.default
    fargs, bargs, fwd_bytes, bwd_bytes = scan_launches(args)
    t_fwd = cuda_time(lambda: fwd_op(*fargs), args.repeats)
    t_bwd = cuda_time(lambda: bwd_op(*bargs), args.repeats)
    # the other way to sum variable dB/dC (BACKWARD_ATOMIC): atomically after a sum over BACKWARD_REDUCE channels,
    # or over each program's block of channels into rows of its own (as the deterministic path does)
    from ssmops.ops.selective_scan import triton as scan_triton

    scan_triton.BACKWARD_ATOMIC = not scan_triton.BACKWARD_ATOMIC
    try:
        t_bwd_other = cuda_time(lambda: bwd_op(*bargs), args.repeats)
    finally:
        scan_triton.BACKWARD_ATOMIC = not scan_triton.BACKWARD_ATOMIC

    rows = [("forward", t_fwd, fwd_bytes, 0.50), ("backward", t_bwd, bwd_bytes, None),
            ("fwd+bwd", t_fwd + t_bwd, fwd_bytes + bwd_bytes, 0.25)]
    base = {}
    if not args.skip_baselines:
        import ssmops

        main_fwd, main_bwd = torch.ops.ssmops.selective_scan_fwd.default, torch.ops.ssmops.selective_scan_bwd.default
        with ssmops.use_backend("default"):
            base["default"] = (cuda_time(lambda: main_fwd(*fargs), 3), cuda_time(lambda: main_bwd(*bargs), 3))
        base["compiled ref"] = _compiled_ref_times(args, dtype)

    print(f"\nMamba-1 scan: batch {args.batch}, dim {args.dim}, seqlen {args.seqlen}, dstate {args.dstate}, "
          f"{args.dtype}, variable B/C, D, z, delta_bias, softplus")
    header = f"{'pass':<9} {'time ms':>9} {'GB moved':>9} {'GB/s':>7} {'of copy':>8} {'goal':>5}"
    for name in base:
        header += f" {'x ' + name:>17}"
    print(header)
    for i, (name, t, moved, goal) in enumerate(rows):
        frac = moved / t / args.copy_rate
        verdict = "-" if goal is None else "ok" if frac >= goal else "MISS"
        line = f"{name:<9} {t * 1e3:9.3f} {moved / 1e9:9.2f} {moved / t / 1e9:7.0f} {frac:7.0%} {verdict:>5}"
        for bname, times in base.items():
            approx = "~" if bname == "compiled ref" and args.ref_seqlen < args.seqlen else " "
            base_t = times[i] if i < 2 else times[0] + times[1]
            line += f" {approx}{base_t / t:15.1f}x"
        print(line)
    print(f"backward with BACKWARD_ATOMIC={not scan_triton.BACKWARD_ATOMIC} (dB/dC summed "
          f"{'in rows of their own' if scan_triton.BACKWARD_ATOMIC else 'atomically'}): {t_bwd_other * 1e3:.3f} ms, "
          f"{t_bwd / t_bwd_other:.2f}x the default's speed")
    if args.autotune:
        scan_tuned_rows(lambda: fwd_op(*fargs), lambda: bwd_op(*bargs), fwd_bytes, bwd_bytes, args)


def sweep_scan(args) -> None:
    """The scan's knobs one at a time at the benchmark's shape (sweep_tiles)."""
    fargs, bargs = scan_launches(args)[:2]
    sweep_tiles(lambda: torch.ops.ssmops.selective_scan_fwd_triton.default(*fargs),
                lambda: torch.ops.ssmops.selective_scan_bwd_triton.default(*bargs), args.repeats, args.sweep_values)


@contextlib.contextmanager
def autotuning():
    """SSMOPS_AUTOTUNE=1 for the calls inside (a launcher's first call on a layer's sizes then tunes its knobs,
    which cuda_time's warm-up leaves out)."""
    from ssmops.ops._tuning import AUTOTUNE_ENV

    os.environ[AUTOTUNE_ENV] = "1"
    try:
        yield
    finally:
        del os.environ[AUTOTUNE_ENV]


def print_choices(ops) -> None:
    """The knobs a family's launchers (`ops`, its triton module) chose away from their defaults, per layer and GPU."""
    for (device, key), phases in ops.TUNER.choices().items():
        print(f"  {key} on {device}: " + ", ".join(f"{knob} {value}" for knobs in phases.values()
                                                  for knob, value in knobs.items() if value != getattr(ops, knob)))


def scan_tuned_rows(fwd, bwd, fwd_bytes: int, bwd_bytes: int, args) -> None:
    """The scan's forward and backward again with SSMOPS_AUTOTUNE=1, as fractions of the copy rate, and the knobs
    chosen."""
    from ssmops.ops.selective_scan import triton as ops

    try:
        with autotuning():
            t_fwd, t_bwd = cuda_time(fwd, args.repeats), cuda_time(bwd, args.repeats)
    except Exception as err:  # (a failure here must not cost the tables after it)
        print(f"tuned: {type(err).__name__}: {str(err)[:100]}")
        return
    for name, t, moved in (("forward", t_fwd, fwd_bytes), ("fwd+bwd", t_fwd + t_bwd, fwd_bytes + bwd_bytes)):
        print(f"{name} with SSMOPS_AUTOTUNE=1: {t * 1e3:.3f} ms, {moved / t / args.copy_rate:.0%} of copy")
    print("scan knobs chosen by SSMOPS_AUTOTUNE=1 (the others as the launchers' defaults):")
    print_choices(ops)


def time_decode_steps(contenders: dict, state, kw: dict, repeats: int) -> tuple[dict, str]:
    """Each contender's step(state, **kw) timed eager and replayed from a CUDA graph: (seconds by name,
    a printable summary)."""
    times = {}
    for name, step in contenders.items():
        def call(step=step):
            return step(state, **kw)

        times[name] = (cuda_time(call, repeats), cuda_time(graphed(call), repeats))
    cells = ", ".join(f"{name} {eager * 1e6:.1f} us eager, {graph * 1e6:.1f} us graphed"
                      for name, (eager, graph) in times.items())
    return times, cells


def compare_decode_steps(times: dict) -> None:
    if "mamba_ssm" in times:
        ours, theirs = times["ssmops"], times["mamba_ssm"]
        print(f"  ssmops vs mamba_ssm: eager {theirs[0] / ours[0]:.2f}x, graphed {theirs[1] / ours[1]:.2f}x "
              "(goal >= 1x)")


MAMBA1_STEP_SHAPE = (5120, 16)  # (dim, dstate) of issue 42's decoding step


def mamba1_step_inputs(batch: int, dtype) -> tuple:
    """(state, keyword arguments) of Mamba-1's decoding step at MAMBA1_STEP_SHAPE: a float32 state, activations
    in `dtype`, D, z, dt_bias and softplus."""
    g = torch.Generator(device="cuda").manual_seed(0)
    d, n = MAMBA1_STEP_SHAPE

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device="cuda").to(dt)

    state = randn(batch, d, n, dt=torch.float32)
    return state, dict(x=randn(batch, d), dt=randn(batch, d), A=-randn(d, n, dt=torch.float32).abs(),
                       B=randn(batch, n), C=randn(batch, n), D=randn(d, dt=torch.float32), z=randn(batch, d),
                       dt_bias=randn(d, dt=torch.float32), dt_softplus=True)


def bare_launch_time(repeats: int) -> float:
    """Seconds of the batch-1 Mamba-1 step's kernel launched with its arguments worked out beforehand
    (decode_overhead.py's `launch` stage, `kernel[grid](...)`): what an eager step cannot go under."""
    from decode_overhead import layouts, stages

    mamba1 = next(iter(layouts(1, "cuda").values()))
    return cuda_time(stages(*mamba1)["launch"], repeats)


def decode_step(args) -> None:
    """Mamba-1's decoding step as issue 42 times it (dim 5120, dstate 16, float32 state, activations in
    the given dtype; D, z, dt_bias, softplus), batch 1 and 64, microseconds per call, eager and replayed
    from a CUDA graph: ssmops' front end against mamba_ssm's Triton `selective_state_update` as
    published, and the fraction of copy bandwidth the state's read and write reach."""
    import ssmops

    d, n = MAMBA1_STEP_SHAPE
    contenders = {"ssmops": ssmops.selective_state_update}
    peer = peer_function("selective_state_update", "selective_state_update")
    if peer is not None:
        contenders["mamba_ssm"] = peer
    for b in (1, 64):
        state, kw = mamba1_step_inputs(b, DTYPES[args.dtype])
        moved = nbytes(state, state, kw["x"], kw["dt"], kw["z"], kw["x"])  # state in and out; y out
        times, cells = time_decode_steps(contenders, state, kw, args.repeats)
        print(f"decode step (batch {b}, dim {d}, dstate {n}): {cells}; ssmops graphed at "
              f"{moved / times['ssmops'][1] / args.copy_rate:.0%} of copy bandwidth")
        compare_decode_steps(times)
        if b == 1:
            eager, graph = times["ssmops"]
            launch = bare_launch_time(args.repeats)
            print(f"  the step's kernel launched bare: {launch * 1e6:.1f} us; ssmops eager over graphed + that launch: "
                  f"{eager / (graph + launch):.2f} (goal <= 1.3)")


SWEEP_STEP_TILES = (256, 512, 1024, 2048, 4096)
SWEEP_STEP_WARPS = (1, 2, 4, 8)


def sweep_decode_step(args) -> None:
    """Mamba-1's decoding step (decode_step's shape) replayed from a CUDA graph at batch 1 and 64, in us, with
    each (MAMBA1_STEP_TILE, MAMBA1_STEP_WARPS) of the sweep in place of the launcher's (the first row)."""
    import ssmops
    from ssmops.ops import _triton
    from ssmops.ops.state_update import triton as ops

    d, n = MAMBA1_STEP_SHAPE
    steps = {}
    for b in (1, 64):
        state, kw = mamba1_step_inputs(b, DTYPES[args.dtype])
        steps[b] = lambda state=state, kw=kw: ssmops.selective_state_update(state, **kw)

    def cell(step) -> str:
        try:
            return f"{cuda_time(graphed(step), args.repeats) * 1e6:>12.2f}"
        except Exception as err:  # e.g. triton's OutOfResources
            return f"{type(err).__name__:>12}"

    def row(name: str) -> None:
        _triton._plans.clear()  # (a launch plan is kept per signature of the arguments: worked out again)
        print(f"{name:<26}" + "".join(f" {cell(step)}" for step in steps.values()))

    chosen = ops.MAMBA1_STEP_TILE, ops.MAMBA1_STEP_WARPS
    print(f"\nMamba-1 decoding step (dim {d}, dstate {n}), graphed, us: tile and warps of its program")
    print(f"{'tile, warps':<26}" + "".join(f" {'batch ' + str(b):>12}" for b in steps))
    row("chosen by the launcher")
    try:
        for tile in SWEEP_STEP_TILES:
            for warps in SWEEP_STEP_WARPS:
                ops.MAMBA1_STEP_TILE, ops.MAMBA1_STEP_WARPS = tile, warps
                row(f"{tile}, {warps}")
    finally:
        ops.MAMBA1_STEP_TILE, ops.MAMBA1_STEP_WARPS = chosen
        _triton._plans.clear()


def knob_values(space: dict, chosen: dict, asked: str) -> list[tuple]:
    """The rows of a sweep over `space`, each the (knob, value) pairs it sets: those of --sweep-values `asked`
    ("NAME=VALUE,...", and "A=1+B=2" for a row that sets two knobs) whose knobs are all in it, else every value but
    the chosen one of each knob."""
    if not asked:
        return [((knob, value),) for knob, values in space.items() for value in values if value != chosen[knob]]
    rows = [tuple((knob, ast.literal_eval(value)) for knob, value in (pair.split("=") for pair in row.split("+")))
            for row in asked.split(",")]
    return [row for row in rows if all(knob in space for knob, _ in row)]


@contextlib.contextmanager
def knobs_set(module, row: tuple) -> Iterator[str]:
    """A sweep row's knobs set on the launchers' module, restored after; yields the row's label."""
    saved = {knob: getattr(module, knob) for knob, _ in row}
    try:
        for knob, value in row:
            setattr(module, knob, value)
        yield " + ".join(f"{knob} {value}" for knob, value in row)
    finally:
        for knob, value in saved.items():
            setattr(module, knob, value)


def sweep_tiles(fwd, bwd, repeats: int, sweep_values: str = "") -> None:
    """Forward and backward ms with each value of each knob of the scan's TUNING_SPACE (what SSMOPS_AUTOTUNE=1
    times) in place of the launchers' choice (the first row), the others as chosen: warps (a program takes 32
    channels a warp), FORWARD_TILE and BACKWARD_TILE ((step, state) pairs a thread's tile of steps holds),
    BACKWARD_SEGMENT (tiles between checkpoints) and BACKWARD_REDUCE (channels summed in a program before an
    atomic add of dB/dC)."""
    from ssmops.ops.selective_scan import triton as ops

    chosen = {knob: getattr(ops, knob) for knob in ops.TUNING_SPACE}

    def cell(fn) -> str:
        try:
            return f"{cuda_time(fn, repeats) * 1e3:.3f}"
        except Exception as err:  # e.g. triton's OutOfResources
            return type(err).__name__

    print("scan knobs (ssmops/ops/selective_scan/triton.py)   forward ms  backward ms")
    print(f"{'chosen by the launchers':<26} {cell(fwd):>11} {cell(bwd):>12}")
    for row in knob_values(ops.TUNING_SPACE, chosen, sweep_values):
        forward = {knob in ops.FORWARD_KNOBS for knob, _ in row}
        with knobs_set(ops, row) as label:
            cells = f"{cell(fwd) if True in forward else '':>11} {cell(bwd) if False in forward else '':>12}"
            print(f"{label:<26} {cells}")


def ssd_sweep() -> dict:
    """The SSD launcher's knobs and their values to time: what SSMOPS_AUTOTUNE=1 tunes (TUNING_SPACE), and the
    precision of C.B^T's tiles."""
    from ssmops.ops.ssd import triton as ops

    return {**ops.TUNING_SPACE, "CB_IN_OPERAND_DTYPE": (False, True)}


def sweep_ssd_knobs(args) -> None:
    """The SSD scan's forward and forward+backward ms at each of --ssd-shapes with each value of ssd_sweep()'s
    knobs in place of the launchers' (the first row), the other knobs as chosen."""
    from ssmops.ops.ssd import triton as ops

    fn = ssd_contenders(skip_baselines=True)["ssmops triton"]
    dtype = DTYPES[args.dtype]

    def cell(shape) -> str:
        try:
            t_fwd, t_both = ssd_times(fn, shape, dtype, args.repeats)
        except Exception as err:  # e.g. triton's OutOfResources
            return f"{type(err).__name__:>21}"
        return f"{t_fwd * 1e3:>9.3f} {t_both * 1e3:>11.3f}"

    sweep = ssd_sweep()
    chosen = {knob: getattr(ops, knob) for knob in sweep}
    print("\nSSD knobs (ssmops/ops/ssd/triton.py), one at a time; forward and forward+backward ms at each shape")
    names = (f"b{s['batch']} L{s['seqlen']} h{s['nheads']} g{s['ngroups']}" for s in args.ssd_shapes)
    print(f"{'knob':<26}" + "".join(f" {name:>21}" for name in names))
    print(f"{'chosen by the launchers':<26}" + "".join(f" {cell(s)}" for s in args.ssd_shapes))
    for row in knob_values(sweep, chosen, args.sweep_values):
        with knobs_set(ops, row) as label:
            print(f"{label:<26}" + "".join(f" {cell(s)}" for s in args.ssd_shapes))


SSD_LAYER = dict(nheads=80, headdim=64, ngroups=1, dstate=128, chunk=256)  # mamba2-2.7b


def ssd_shape(args) -> str:
    """The SSD rows' shape, in words (also benchmarks/triton_static.py's)."""
    layer = ", ".join(f"{k} {v}" for k, v in SSD_LAYER.items())
    return f"SSD scan: batch {args.batch}, seqlen {args.seqlen}, {layer}, {args.dtype}"


def ssd_inputs(batch: int, seqlen: int, dtype, requires_grad: bool = False, layer: dict = SSD_LAYER) -> dict:
    """mamba_chunk_scan_combined's keyword arguments as Mamba2 passes them, at `layer`'s sizes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h, p, n, ng = (layer[k] for k in ("nheads", "headdim", "dstate", "ngroups"))

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device="cuda").to(dt)

    kw = dict(x=randn(batch, seqlen, h, p), dt=randn(batch, seqlen, h) - 2.0,
              A=-torch.rand(h, generator=g, device="cuda") * 15 - 1, B=randn(batch, seqlen, ng, n),
              C=randn(batch, seqlen, ng, n), D=randn(h, dt=torch.float32), z=randn(batch, seqlen, h, p),
              dt_bias=randn(h, dt=torch.float32) * 0.1)
    for v in kw.values():
        v.requires_grad_(requires_grad)
    return kw


def peer_function(module: str, name: str):
    """mamba_ssm's published Triton function `name`: from an installed mamba_ssm, else from its sdist in
    build/peers (benchmarks/peers.py); None, said once, where neither is here."""
    try:
        return getattr(importlib.import_module(f"mamba_ssm.ops.triton.{module}"), name)
    except ImportError:
        pass
    from peers import mamba_ssm_triton as from_sdist

    try:
        return getattr(from_sdist(module), name)
    except ImportError as err:
        print(f"(mamba_ssm's {name} is not timed: {err})")
        return None


def ssd_contenders(skip_baselines: bool = False, autotune: bool = False) -> dict:
    """name -> fn(**ssd_inputs) -> out: ssmops on Triton (and with autotune, again with SSMOPS_AUTOTUNE=1),
    mamba_ssm's when installed, ssmops' default backend, and torch.compile of the chunked reference."""
    import ssmops
    from ssmops.ops.ssd.reference import ssd_chunked_ref

    chunk = SSD_LAYER["chunk"]
    named = {"ssmops triton": lambda **kw: ssmops.mamba_chunk_scan_combined(**kw, chunk_size=chunk, dt_softplus=True)}
    if autotune:
        def tuned(**kw):
            with autotuning():
                return named["ssmops triton"](**kw)

        named["ssmops tuned"] = tuned
    peer = peer_function("ssd_combined", "mamba_chunk_scan_combined")
    if peer is not None:
        named["mamba_ssm"] = lambda **kw: peer(**kw, chunk_size=chunk, dt_softplus=True)
    if skip_baselines:
        return named

    def default(**kw):
        with ssmops.use_backend("default"):
            return ssmops.mamba_chunk_scan_combined(**kw, chunk_size=chunk, dt_softplus=True)

    named["ssmops default"] = default
    compiled = torch.compile(ssd_chunked_ref)
    named["compiled ref"] = lambda **kw: compiled(**kw, chunk_size=chunk, dt_softplus=True)
    return named


# the shapes of issue 41 (batch, seqlen and the layer), chunk 256
SSD_SHAPES = [
    dict(batch=8, seqlen=4096, nheads=80, headdim=64, ngroups=1, dstate=128, chunk=256),  # mamba2-2.7b
    dict(batch=1, seqlen=2048, nheads=24, headdim=64, ngroups=1, dstate=128, chunk=256),  # mamba2-130m
    dict(batch=2, seqlen=8192, nheads=64, headdim=64, ngroups=8, dstate=128, chunk=256),
]


def matmul_rate(dtype=torch.bfloat16, size: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of a size^3 matmul in dtype: the tensor-core rate the GPU reaches here."""
    a, b = (torch.randn(size, size, device="cuda", dtype=dtype) for _ in range(2))
    return 2 * size**3 / cuda_time(lambda: a @ b, repeats)


def ssd_times(fn, shape: dict, dtype, repeats: int) -> tuple[float, float]:
    """Seconds of fn(**ssd_inputs) at `shape`: the forward without autograd, and forward+backward."""
    with torch.no_grad():
        kw = ssd_inputs(shape["batch"], shape["seqlen"], dtype, layer=shape)
        t_fwd = cuda_time(lambda: fn(**kw), repeats)
    kw = ssd_inputs(shape["batch"], shape["seqlen"], dtype, requires_grad=True, layer=shape)
    return t_fwd, cuda_time(lambda: fn(**kw).backward(torch.ones_like(kw["x"])), repeats)


def ssd_rows(args) -> None:
    """The SSD table (see the module's docstring) at each of --ssd-shapes."""
    from ssd import flops

    dtype = DTYPES[args.dtype]
    rate = matmul_rate()
    print(f"\nbf16 matmul 8192^3: {rate / 1e12:.0f} TFLOP/s measured")
    contenders = ssd_contenders(args.skip_baselines, args.autotune)
    for shape in args.ssd_shapes:
        fwd_flops = flops(shape)
        layer = ", ".join(f"{k} {v}" for k, v in shape.items())
        print(f"\nSSD scan: {layer}, {args.dtype}; {fwd_flops / 1e12:.3f} TFLOP forward")
        print(f"{'contender':<15} {'fwd ms':>8} {'TFLOP/s':>8} {'of mm':>6} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
        times = {}
        for name, fn in contenders.items():
            try:
                t_fwd, t_both = ssd_times(fn, shape, dtype, args.repeats)
            except Exception as err:  # e.g. out of memory for the compiled reference
                print(f"{name:<15} {type(err).__name__}: {str(err)[:60]}")
                continue
            times[name] = (t_fwd, t_both)
            print(f"{name:<15} {t_fwd * 1e3:8.3f} {fwd_flops / t_fwd / 1e12:8.1f} {fwd_flops / t_fwd / rate:6.1%} "
                  f"{t_both * 1e3:11.3f} {3 * fwd_flops / t_both / 1e12:8.1f}")
        ours = [name for name in ("ssmops triton", "ssmops tuned") if name in times]
        for mine in ours:
            for name, (t_fwd, t_both) in times.items():
                if name not in ours:
                    goal = " (goals 1.5x, 1.3x)" if name == "mamba_ssm" else ""
                    print(f"{mine} vs {name}: forward {t_fwd / times[mine][0]:.2f}x, "
                          f"forward+backward {t_both / times[mine][1]:.2f}x{goal}")
    if args.autotune:
        from ssmops.ops.ssd import triton as ops

        print("\nSSD knobs chosen by SSMOPS_AUTOTUNE=1 (the others as the launchers' defaults):")
        print_choices(ops)


def graphed(fn):
    """fn captured once into a CUDA graph; returns its replay (what generate(cg=True) runs per token)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up (Triton compiles) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def ssd_decode_step(args) -> None:
    """The multi-head decoding step at SSD_LAYER's shape as Mamba2.step calls it (dt, A, D, dt_bias tied
    per head as stride-0 expansions; float32 state), microseconds per call, eager and replayed from a
    CUDA graph: ssmops' front end against mamba_ssm's Triton `selective_state_update` as published."""
    import ssmops

    dtype = DTYPES[args.dtype]
    h, p, n, ng = (SSD_LAYER[k] for k in ("nheads", "headdim", "dstate", "ngroups"))
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device="cuda").to(dt)

    contenders = {"ssmops": ssmops.selective_state_update}
    peer = peer_function("selective_state_update", "selective_state_update")
    if peer is not None:
        contenders["mamba_ssm"] = peer
    for batch in (1, 64):
        state = randn(batch, h, p, n, dt=torch.float32)
        kw = dict(x=randn(batch, h, p), dt=randn(batch, h)[..., None].expand(batch, h, p),
                  A=(-torch.rand(h, device="cuda") - 0.1)[:, None, None].expand(h, p, n), B=randn(batch, ng, n),
                  C=randn(batch, ng, n), D=randn(h, dt=torch.float32)[:, None].expand(h, p), z=randn(batch, h, p),
                  dt_bias=randn(h, dt=torch.float32)[:, None].expand(h, p), dt_softplus=True)
        times, cells = time_decode_steps(contenders, state, kw, args.repeats)
        print(f"multi-head decode step (batch {batch}, nheads {h}, headdim {p}, dstate {n}): {cells}")
        compare_decode_steps(times)


# LM shapes of generate's rows: (d_model, n_layer) of mamba_ssm's checkpoints of that size
LM_SHAPES = {"130m": (768, 24), "2.7b": (2560, 64)}


def lm(layer: str, d_model: int, n_layer: int, dtype, device):
    """A MambaLMHeadModel with random weights: mamba_ssm's config of that size for `layer` ("Mamba1": mamba-130m,
    mamba-2.8b; "Mamba2": mamba2-130m, mamba2-2.7b, headdim 64, d_state 128), in dtype, for inference."""
    from ssmops.models import MambaConfig, MambaLMHeadModel

    torch.manual_seed(0)
    ssm_cfg = {"layer": layer} if layer == "Mamba1" else {"layer": layer, "d_state": 128, "headdim": 64}
    config = MambaConfig(d_model=d_model, n_layer=n_layer, vocab_size=50277, ssm_cfg=ssm_cfg)
    return MambaLMHeadModel(config, device=device, dtype=dtype).eval()


def decode_rate(model, prompt: torch.Tensor, new_tokens: int, cg: bool, repeats: int = 3) -> float:
    """Tokens per second of `model.generate` after the prompt, prefill excluded: (the fastest of `repeats` runs
    of new_tokens - the fastest of 1) / (new_tokens - 1), after a warm-up run (which compiles, with cg)."""
    import time

    def run(n: int) -> float:
        synchronize = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
        synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, max_length=prompt.shape[1] + n, cg=cg)
        synchronize()
        return time.perf_counter() - t0

    run(new_tokens)
    many = min(run(new_tokens) for _ in range(repeats))
    one = min(run(1) for _ in range(repeats))
    return (new_tokens - 1) / max(many - one, 1e-9)


def generate_rows(args) -> None:
    """Whole-model decoding tokens/s (the module's docstring), eager and cg=True, for each LM of --lm-shapes."""
    dtype = DTYPES[args.dtype]
    print(f"\ngenerate, batch 1, 16-token prompt, {args.new_tokens} new tokens, random weights, {args.dtype}: "
          "tokens/s eager and with cg=True")
    for shape in args.lm_shapes.split(","):
        for layer in ("Mamba1", "Mamba2"):
            model = lm(layer, *LM_SHAPES[shape], dtype, "cuda")
            prompt = torch.randint(0, 50277, (1, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
            with torch.inference_mode():
                eager = decode_rate(model, prompt, args.new_tokens, cg=False)
                graph = decode_rate(model, prompt, args.new_tokens, cg=True)
            print(f"  {layer} {shape:>5} (d_model {model.config.d_model}, {model.config.n_layer} layers): "
                  f"{eager:8.1f} tok/s eager, {graph:8.1f} tok/s cg=True ({graph / eager:.2f}x)", flush=True)
            del model
            torch.cuda.empty_cache()


# mamba2-2.7b's conv over xBC: d_inner 5120 + 2 x (1 group x 128 states), width 4, SiLU, channel-last (a view of
# in_proj's output, as Mamba2 passes it)
CONV_SHAPE = dict(batch=8, seqlen=4096, dim=5376, width=4)


def conv_rows(args) -> None:
    """The causal conv (issue 60) at CONV_SHAPE: forward and forward+backward ms of ssmops' front end on the
    Triton kernels, on the `default` backend (the shift-and-add in PyTorch that ssmops ran before the operator)
    and PyTorch's F.conv1d(groups=dim) cut to seqlen, and the share of the copy rate the Triton forward reaches
    (x read and out written once)."""
    import torch.nn.functional as F

    import ssmops

    b, L, d, w = (CONV_SHAPE[k] for k in ("batch", "seqlen", "dim", "width"))
    dtype = DTYPES[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, L, d, generator=g, device="cuda").to(dtype).transpose(1, 2).requires_grad_()
    weight = (torch.randn(d, w, generator=g, device="cuda") * 0.3).requires_grad_()
    bias = torch.randn(d, generator=g, device="cuda").requires_grad_()
    dout = torch.randn(b, d, L, generator=g, device="cuda").to(dtype)

    def conv1d(x, weight, bias, activation):
        return F.silu(F.conv1d(x, weight[:, None].to(x.dtype), bias.to(x.dtype), padding=w - 1, groups=d)[..., :L])

    contenders = {"ssmops triton": (ssmops.causal_conv1d_fn, "triton"),
                  "ssmops default": (ssmops.causal_conv1d_fn, "default"), "F.conv1d": (conv1d, None)}
    print(f"\ncausal conv: batch {b}, seqlen {L}, dim {d}, width {w}, SiLU, {args.dtype}, channel-last")
    print(f"{'contender':<15} {'fwd ms':>8} {'fwd+bwd ms':>11}")
    times = {}
    for name, (fn, backend) in contenders.items():
        def forward(fn=fn):
            return fn(x, weight, bias, activation="silu")

        def both(forward=forward):
            torch.autograd.grad(forward(), (x, weight, bias), dout)

        with ssmops.use_backend(backend), torch.no_grad():
            t_fwd = cuda_time(forward, args.repeats)
        with ssmops.use_backend(backend):
            t_both = cuda_time(both, args.repeats)
        times[name] = (t_fwd, t_both)
        print(f"{name:<15} {t_fwd * 1e3:8.3f} {t_both * 1e3:11.3f}")
    fwd, both = times["ssmops triton"]
    print(f"ssmops triton: {2 * x.numel() * x.element_size() / fwd / args.copy_rate:.0%} of copy forward; "
          + ", ".join(f"{name} {t[0] / fwd:.2f}x / {t[1] / both:.2f}x" for name, t in times.items()
                      if name != "ssmops triton"))


def kernel_table(title: str, fn, repeats: int = 5, activity: str = "CUDA") -> dict:
    """fn's kernels, each with its time a call (torch.profiler's events of `activity`, after a warm-up call),
    printed largest first and returned as {name: seconds}: where a pass's time goes, which its total does not
    say (a run that timed only totals could not tell which of the SSD's kernels fell short of its estimate)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize = torch.cuda.synchronize if activity == "CUDA" else (lambda: None)
    synchronize()
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        for _ in range(repeats):
            fn()
        synchronize()
    seconds: dict = {}
    for event in prof.events():
        if event.device_type == getattr(DeviceType, activity):
            seconds[event.name] = seconds.get(event.name, 0.0) + event.time_range.elapsed_us() * 1e-6 / repeats
    total = sum(seconds.values())
    print(f"\n{title}: {total * 1e3:.3f} ms of kernels a call")
    for name, t in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"  {name[:64]:<64} {t * 1e3:8.3f} ms {t / total:6.1%}")
    return seconds


def kernel_rows(args) -> None:
    """The kernels of the Mamba-1 scan's Triton operators at the benchmark's shape, and of
    mamba_chunk_scan_combined's forward+backward on Triton at each --ssd-shapes, each with its time."""
    fwd_op = torch.ops.ssmops.selective_scan_fwd_triton.default
    bwd_op = torch.ops.ssmops.selective_scan_bwd_triton.default
    fargs, bargs, _, _ = scan_launches(args)
    kernel_table("Mamba-1 scan forward", lambda: fwd_op(*fargs))
    kernel_table("Mamba-1 scan backward", lambda: bwd_op(*bargs))
    ssd = ssd_contenders(skip_baselines=True)["ssmops triton"]
    for shape in args.ssd_shapes:
        kw = ssd_inputs(shape["batch"], shape["seqlen"], DTYPES[args.dtype], requires_grad=True, layer=shape)
        kernel_table(f"SSD forward+backward at {', '.join(f'{k} {v}' for k, v in shape.items())}",
                     lambda: ssd(**kw).backward(torch.ones_like(kw["x"])))


# what the benchmark times, in this order: --parts names some (default: all but the sweeps; --sweep adds these)
PARTS = {"scan": scan_rows, "decode": decode_step, "ssd": ssd_rows, "ssd-decode": ssd_decode_step, "conv": conv_rows,
         "generate": generate_rows, "kernels": kernel_rows, "sweep-scan": sweep_scan, "sweep-ssd": sweep_ssd_knobs,
         "sweep-decode": sweep_decode_step}
SWEEPS = [part for part in PARTS if part.startswith("sweep-")]


def _compiled_ref_times(args, dtype) -> tuple[float, float]:
    """Forward and backward seconds of torch.compile(selective_scan_ref), scaled to the full seqlen."""
    import ssmops

    seqlen = min(args.ref_seqlen, args.seqlen)
    kw = make_inputs(args.batch, args.dim, seqlen, args.dstate, dtype)
    ref = torch.compile(ssmops.selective_scan_ref)
    with torch.no_grad():
        t_fwd = cuda_time(lambda: ref(**kw), 3)
    leaves = {k: v.requires_grad_() for k, v in kw.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}

    def fwd_bwd():
        y = ref(**kw)
        torch.autograd.grad(y, list(leaves.values()), torch.ones_like(y))

    t_both = cuda_time(fwd_bwd, 3)
    scale = args.seqlen / seqlen
    return t_fwd * scale, max(t_both - t_fwd, 0.0) * scale


if __name__ == "__main__":
    sys.exit(main())
