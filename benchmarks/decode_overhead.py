"""What an eager decoding step costs before its kernel launch, stage by stage, on the Triton backend.

    python benchmarks/decode_overhead.py [--calls 2000] [--repeats 7] [--batch 1] [--profile]

People decode eagerly (transformers' `generate`, notebooks, servers without CUDA graphs), one
`selective_state_update` per layer per token; at batch 1 its kernel takes ~7 us on an H100, so whatever
Python runs before the launch decides the step's time. For each layout of issue 57 (Mamba-1: dim 5120,
dstate 16; Mamba-2: mamba2-2.7b's 80 heads of 64, dstate 128, dt/A/D/dt_bias tied per head as stride-0
expansions, as mamba_ssm's Mamba2.step passes them, and per head, as ssmops' does; bf16 activations,
float32 state) it times, in microseconds per call, each stage from the bare launch up to the public function:

* launch: the kernel's launch with the step's exact arguments worked out beforehand (`kernel[grid](...)`);
* launcher: the family's Triton launcher (checks, tiles, output buffer, launch; ops/state_update/triton.py);
* triton operator: `torch.ops.ssmops.<op>_triton`, the dispatcher's route to the launcher (torch's
  custom-operator layers), which eager calls took before issue 57;
* front end: `ssmops.selective_state_update` (`ssmops.causal_conv1d_update`), as users and the blocks call it;

under `torch.inference_mode()` (as ssmops' generate decodes) and in plain grad mode (as benchmarks/gpu.py
times the step), with the front end's cost over the bare launch and as a multiple of it, the launches
and the allocations (aten::empty) one front-end call makes, and with --profile cProfile's largest entries.

On a GPU every stage launches the kernel for real (timed on the CPU's clock, synchronising after each
turn: the step is bound by its Python at batch 1). Without one (CI, a laptop) CPU tensors stand in for
CUDA ones as in tests/test_triton.py (the registry is told a GPU is present and takes CPU tensors for GPU
ones) and the launch is replaced by a no-op that counts: every stage's Python is measured, Triton's own
launch cost is not (its row is the no-op's call), so the multiples need a GPU run:

    python benchmarks/decode_overhead.py          # on the GPU machine, ssmops' checkout as the cwd
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ON_GPU = torch.cuda.is_available()
# without a GPU, this process's CPU time: on shared cores, the time others hold the core is not the step's
CLOCK = time.perf_counter if ON_GPU else time.process_time


def fake_a_gpu() -> None:
    """Without a GPU: registers the Triton kernels as for one, lets CPU tensors take the GPU route, and makes
    the launch a no-op."""
    import ssmops._registry as registry

    registry._gpu_present = lambda: True
    if registry.load_triton() is not None:
        sys.exit(f"the Triton backend cannot be loaded: {registry.available_backends()['triton']}")
    registry.GPU_DEVICES = (*registry.GPU_DEVICES, "cpu")
    from ssmops.ops import _triton

    _triton.launch = lambda kernel, grid, args, meta: None


def layouts(batch: int, device: str) -> dict:
    """name -> (operator name, its arguments, the front end's call): issue 57's two layouts, and the conv's
    step of a Mamba-2 2.7b layer (its xBC: 5376 channels, width 4), which a decoding token runs beside each."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    d, n = 5120, 16
    mamba1 = (randn(batch, d, n, dtype=torch.float32), randn(batch, d), randn(batch, d),
              -randn(d, n, dtype=torch.float32).abs(), randn(batch, n), randn(batch, n), randn(d, dtype=torch.float32),
              randn(batch, d), randn(d, dtype=torch.float32), True)
    h, p, n = 80, 64, 128
    dt, A = randn(batch, h), -randn(h, dtype=torch.float32).abs()
    D, bias = randn(h, dtype=torch.float32), randn(h, dtype=torch.float32)
    heads = (randn(batch, h, p, n, dtype=torch.float32), randn(batch, h, p))
    B, C = randn(batch, 1, n), randn(batch, 1, n)
    tied = (*heads, dt[..., None].expand(batch, h, p), A[:, None, None].expand(h, p, n), B, C,
            D[:, None].expand(h, p), None, bias[:, None].expand(h, p), True)
    per_head = (*heads, dt, A, B, C, D, None, bias, True)
    conv_dim = 5376
    conv = (randn(batch, conv_dim), randn(batch, conv_dim, 4), randn(conv_dim, 4), randn(conv_dim))

    def state_step(args: tuple):  # the operators' argument order: the multi-head one takes state_batch_indices
        name = "selective_state_update" if args[0].dim() == 3 else "multihead_state_update"
        op_args = args if name == "selective_state_update" else (*args[:9], None, args[9])
        return name, op_args, lambda: ssmops.selective_state_update(*args)

    import ssmops

    return {f"Mamba-1, dim {d}, dstate 16, batch {batch}": state_step(mamba1),
            f"Mamba-2, 80 x 64 heads, dstate 128, tied as stride-0 views (mamba_ssm's Mamba2.step), batch {batch}":
                state_step(tied),
            f"Mamba-2, the same per head (ssmops' Mamba2.step), batch {batch}": state_step(per_head),
            f"causal conv step, {conv_dim} channels, width 4, silu, batch {batch}":
                ("causal_conv1d_update", (conv[0][..., None], *conv[1:], None, None, True),
                 lambda: ssmops.causal_conv1d_update(*conv, activation="silu"))}


def stages(op_name: str, op_args: tuple, front_end) -> dict:
    """stage name -> a call of it with the layout's arguments."""
    from ssmops import _registry
    from ssmops.ops import _triton

    launcher = _registry.kernels("triton")[op_name]
    operator = getattr(torch.ops.ssmops, f"{op_name}_triton").default

    launch = _triton.launch
    made: list = []
    _triton.launch = lambda kernel, grid, launch_args, meta: made.append((kernel, grid, launch_args, meta))
    try:  # the launch the launcher makes, recorded once
        launcher(*op_args)
    finally:
        _triton.launch = launch
    kernel, grid, launch_args, meta = made[0]
    if ON_GPU:  # made as it is
        bare = lambda: kernel[grid](*launch_args, **meta)  # noqa: E731
    else:  # the no-op launch, with the same arguments
        bare = lambda: launch(kernel, grid, launch_args, meta)  # noqa: E731
    return {
        "launch": bare,
        "launcher": lambda: launcher(*op_args),
        "triton operator": lambda: operator(*op_args),
        "front end": front_end,
    }


def per_call_us(calls: dict, n: int, repeats: int) -> dict:
    """Microseconds per call of each, the fastest of `repeats` turns of n calls (taking turns: the machine
    may be shared; the fastest turn is the least disturbed), on CLOCK."""
    best = dict.fromkeys(calls, float("inf"))
    for fn in calls.values():
        for _ in range(20):
            fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            if ON_GPU:
                torch.cuda.synchronize()
            t0 = CLOCK()
            for _ in range(n):
                fn()
            if ON_GPU:
                torch.cuda.synchronize()
            best[name] = min(best[name], (CLOCK() - t0) / n * 1e6)
    return best


def count_per_call(fn) -> tuple[int, dict]:
    """(launches, {aten op: calls}) of one call: the launches counted at the launch site (`_triton.launch`,
    made as before), the allocations and copies from the profiler's record."""
    from torch.profiler import ProfilerActivity, profile

    from ssmops.ops import _triton

    launch, launches = _triton.launch, []

    def counted(*args):
        launches.append(args[0])
        return launch(*args)

    _triton.launch = counted
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        _triton.launch = launch
    made = {e.key: e.count for e in prof.key_averages()
            if e.key in ("aten::empty", "aten::empty_strided", "aten::copy_", "aten::clone", "aten::contiguous")}
    return len(launches), made


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls a turn")
    parser.add_argument("--repeats", type=int, default=7, help="turns of each stage (the fastest is shown)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="cProfile the front end's calls")
    args = parser.parse_args(argv)
    if not ON_GPU:
        fake_a_gpu()
    import ssmops

    if ssmops.available_backends()["triton"] != "available":
        print(f"the triton backend is not available: {ssmops.available_backends()['triton']}", file=sys.stderr)
        return 2
    device = "cuda" if ON_GPU else "cpu"
    where = (f"GPU {torch.cuda.get_device_name()}" if ON_GPU else
             "no GPU: CPU tensors on the GPU route, the launch a no-op (its row is not Triton's launch)")
    print(f"torch {torch.__version__}, {where}; microseconds per call, the fastest of {args.repeats} turns of "
          f"{args.calls} calls")
    for name, layout in layouts(args.batch, device).items():
        calls = stages(*layout)
        print(f"\n{name}")
        print(f"  {'stage':<18} {'inference_mode':>15} {'grad mode':>10}")
        with torch.inference_mode():
            inference = per_call_us(calls, args.calls, args.repeats)
        grad = per_call_us(calls, args.calls, args.repeats)
        for stage in calls:
            print(f"  {stage:<18} {inference[stage]:15.2f} {grad[stage]:10.2f}")
        for mode, us in (("inference_mode", inference), ("grad mode", grad)):
            over = us["front end"] - us["launch"]
            times = f", {us['front end'] / us['launch']:.2f}x the launch" if ON_GPU else ""
            print(f"  front end over the bare launch, {mode}: {over:.2f} us{times}")
        with torch.inference_mode():
            launches, counted = count_per_call(calls["front end"])
        made = ", ".join(f"{k} {v}" for k, v in sorted(counted.items())) or "none"
        print(f"  one front-end call: {launches} launch(es); aten allocations and copies: {made}")
        if args.profile:
            profiler = cProfile.Profile()
            with torch.inference_mode():
                profiler.runcall(lambda: [calls["front end"]() for _ in range(args.calls)])
            pstats.Stats(profiler).sort_stats("tottime").print_stats(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
