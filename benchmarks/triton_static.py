"""A speed estimate of the Triton kernels read off their compiled code: no GPU needed.

    python benchmarks/triton_static.py                 # batch 8, dim 4096, seqlen 4096, dstate 16, bf16

Compiles the forward and backward launches for sm_90 (ssmops/ops/triton_aot.py) and
counts the instructions of each kernel's innermost loop, which handles one state over a
chunk, per (step, state) element. An H100 SM issues at most 4 warp instructions and 16
ex2 (exp2) results per cycle, so a kernel needs at least

    elements * instructions per element / (SMs * 4 * 32 * clock)

seconds (and likewise for ex2), against the bytes it must move at the copy bandwidth.
Printed: those bounds and the fraction of copy bandwidth they would allow (the goals of
benchmarks/gpu.py are 70% forward, 50% backward). The instruction bound ignores memory
latency, atomics and stalls, so a kernel is at best this fast; benchmarks/gpu.py measures
on a GPU. The defaults describe an H100 SXM as the device tool lends it (132 SMs, about
3.0 TB/s device-to-device copy); the clock is its sustained 1.755 GHz.
"""

from __future__ import annotations

import sys

import torch
from gpu import DTYPES, shape_parser  # (puts the repository on sys.path too)


def parse_args(argv=None):
    p = shape_parser(__doc__)
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--clock-ghz", type=float, default=1.755)
    p.add_argument("--copy-tbps", type=float, default=3.0, help="device-to-device copy, bytes read + written")
    return p.parse_args(argv)


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
        from ssmops.ops import triton_aot as aot
    except ImportError as err:
        print(f"needs triton: {err}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    # the compiled code depends on the sizes only through the tile and their divisibility by 16,
    # so a narrow input stands for the full shape
    launches = aot.record_scan(mamba_args(64, args.seqlen, args.dstate, dtype))
    elements = args.batch * args.dim * args.seqlen * args.dstate
    rows = args.batch * args.dim * args.seqlen
    size = torch.finfo(dtype).bits // 8
    moved = {"forward": rows * size * 5, "backward": rows * size * 7}  # u delta z | out out_z; + dout | du ddelta dz
    issue_rate = args.sms * 4 * 32 * args.clock_ghz * 1e9  # lane instructions per second
    ex2_rate = args.sms * 16 * args.clock_ghz * 1e9
    copy_rate = args.copy_tbps * 1e12

    print(f"shape: batch {args.batch}, dim {args.dim}, seqlen {args.seqlen}, dstate {args.dstate}, {args.dtype}, "
          f"variable B/C, D, z, delta_bias; sm_90, {args.sms} SMs at {args.clock_ghz} GHz, copy {args.copy_tbps} TB/s")
    print(f"{'pass':<9} {'regs':>4} {'spill':>5} {'warps':>5} {'steps/thr':>9} {'instr/elt':>9} {'shfl/elt':>8} "
          f"{'ex2/elt':>7} {'ms issue':>8} {'ms ex2':>7} {'ms copy':>7} {'of copy':>7}")
    for name, (kernel, kernel_args, meta) in zip(("forward", "backward"), launches):
        compiled = aot.compile_launch(kernel, kernel_args, meta, "sm90")
        usage = aot.resource_usage(compiled)
        loop = aot.innermost_loop(compiled)
        steps = meta["BLOCK_T"] // (32 * meta["num_warps"])  # consecutive steps a thread holds
        per_element = {op: count / steps for op, count in loop.items()}
        instructions = sum(per_element.values())
        t_issue = elements * instructions / issue_rate
        t_ex2 = elements * per_element.get("MUFU", 0.0) / ex2_rate
        t_copy = moved[name] / copy_rate
        print(f"{name:<9} {usage['regs']:>4} {usage['spills']:>5} {meta['num_warps']:>5} {steps:>9} "
              f"{instructions:>9.1f} {per_element.get('SHFL', 0.0):>8.2f} {per_element.get('MUFU', 0.0):>7.2f} "
              f"{t_issue * 1e3:>8.2f} {t_ex2 * 1e3:>7.2f} {t_copy * 1e3:>7.2f} {t_copy / max(t_issue, t_ex2):>7.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
