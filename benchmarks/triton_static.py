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

Then the SSD scan's kernels (Mamba-2) at mamba2-2.7b's layer (batch 8, the given seqlen, nheads 80,
headdim 64, ngroups 1, dstate 128, chunk 256, the given dtype) and the multi-head decoding step: per
launch, registers, spills, warps, and of its tensor-core loop (the shortest loop holding an MMA) the
instructions per trip, the MMAs and lane shuffles among them, and the issue bound programs * trips *
instructions * warps / (SMs * 4 * clock). Against it, the forward's FLOPs (benchmarks/ssd.py's count) at
the dense bf16 rate (`--peak-tflops`).
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
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 tensor-core rate")
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
    ssd_rows(args, aot, dtype)
    return 0


def _ssd_trips(name: str, meta: dict, shape: dict) -> float:
    """Mean trips of a kernel's tensor-core loop per program: over the chunks' blocks for the state
    passes (walking every chunk), over the blocks up to (or from) the program's own in the chunk kernels."""
    blocks = -(-shape["chunk"] // meta["BLOCK_T"])
    nchunks = -(-shape["seqlen"] // shape["chunk"])
    if name in ("ssd_states_fwd_kernel", "ssd_state_grads_kernel"):
        return nchunks * blocks
    return (blocks + 1) / 2


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
    issue_rate = args.sms * 4 * args.clock_ghz * 1e9  # warp instructions per second
    print(f"\n{ssd_shape(args)}; sm_90; forward {flops(shape) / 1e12:.2f} TFLOP: "
          f"{flops(shape) / (args.peak_tflops * 1e12) * 1e3:.2f} ms at {args.peak_tflops:.0f} TFLOP/s")
    print(f"{'kernel':<31} {'regs':>4} {'spill':>5} {'warps':>5} {'programs':>8} {'trips':>5} {'instr':>5} "
          f"{'mma':>4} {'shfl':>4} {'ms issue':>8}")
    for (kernel, kernel_args, meta), programs in zip(launches + step, grids):
        compiled = aot.compile_launch(kernel, kernel_args, meta, "sm90")
        usage = aot.resource_usage(compiled)
        loop = aot.innermost_loop(compiled, containing=("HMMA", "HGMMA"))
        name = kernel.__name__ + (" (dz)" if kernel.__name__ == "ssd_chunk_scan_kernel" and meta["DZ"] else "")
        name += f" ({meta['MODE']})" if "MODE" in meta else ""
        if loop is None:  # no tensor-core loop (the ddt pass, the decoding step): its size only
            print(f"{name:<31} {usage['regs']:>4} {usage['spills']:>5} {meta['num_warps']:>5} {programs:>8}")
            continue
        trips = _ssd_trips(kernel.__name__, meta, shape)
        instructions = sum(loop.values())
        t_issue = programs * trips * instructions * meta["num_warps"] / issue_rate
        mma = loop.get("HMMA", 0) + loop.get("HGMMA", 0)
        print(f"{name:<31} {usage['regs']:>4} {usage['spills']:>5} {meta['num_warps']:>5} {programs:>8} {trips:>5.1f} "
              f"{instructions:>5} {mma:>4} {loop.get('SHFL', 0):>4} {t_issue * 1e3:>8.2f}")


def _ssd_grids(shape: dict) -> list:
    """Programs of each launch at the full shape (the recorded launches are of a shorter input)."""
    from ssmops.ops.ssd import triton as ssd_triton

    b, L, h, p, n, Q = (shape[k] for k in ("batch", "seqlen", "nheads", "headdim", "dstate", "chunk"))
    nchunks = -(-L // Q)
    cfg = ssd_triton._config(Q, p, n)
    tiles = ssd_triton._state_tiles(p, n)
    state_programs = b * h * -(-p // tiles["BLOCK_P"]) * -(-n // tiles["BLOCK_N"])
    scan = nchunks * -(-Q // cfg["BLOCK_T"]) * b * h * -(-p // cfg["BLOCK_P"])
    bwd = nchunks * -(-Q // min(cfg["BLOCK_T"], ssd_triton.BWD_BLOCK_T)) * b * h
    return [state_programs, scan, scan, state_programs, bwd, bwd, bwd, nchunks * b * h, b * h]


if __name__ == "__main__":
    sys.exit(main())
