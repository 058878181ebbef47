"""What the decoding steps' Python front ends cost on top of the operators they end in, at batch 1.

    python benchmarks/frontend.py [--threads 1] [--calls 500] [--repeats 40] [--quick]

Decoding calls `selective_state_update` once per layer per token, so at batch 1 and a small
shape its Python (argument checks, views, backend selection) can cost as much as the step itself.
Each row times a public front end and a direct call of the operator it ends in, with the same
values prepared once in the operator's form; the difference is the front end's overhead (goal:
<= 10 us). The block rows time a `Mamba` / `Mamba2` block's `step` (d_model 64)
against a replay of every operator call the step dispatches (recorded once; so the replay's time
is the operators' and the Python calls into them, and the difference is the block's glue).
Native `cpu` backend, under `torch.inference_mode()` as `ssmops.models.generation` decodes.
Front end and operator take turns, `--calls` calls a turn, `--repeats` turns each: the table gives
the fastest turn's per-call time of each (the machine is shared; the fastest is the least
disturbed) and the median turn's overhead.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _common import seconds

import ssmops  # noqa: E402  (_common puts the repository first on the path)
from ssmops.modules.mamba import Mamba  # noqa: E402
from ssmops.modules.mamba2 import Mamba2  # noqa: E402

DIM, NHEADS, HEADDIM, DSTATE, NGROUPS, CACHE = 128, 8, 16, 16, 1, 4


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen)


def mamba1_rows(gen) -> dict:
    """Mamba-1's layout (batch, dim, dstate): the float32 state, and a bfloat16 cache of CACHE rows."""
    x, dt, z = (_randn(1, DIM, gen=gen) for _ in range(3))
    A, B, C = -torch.rand(DIM, DSTATE, generator=gen), _randn(1, DSTATE, gen=gen), _randn(1, DSTATE, gen=gen)
    D, bias = _randn(DIM, gen=gen), _randn(DIM, gen=gen)
    state = _randn(1, DIM, DSTATE, gen=gen)
    cache = _randn(CACHE, DIM, DSTATE, gen=gen).bfloat16()
    index = torch.tensor([2], dtype=torch.int32)
    op, multihead = torch.ops.ssmops.selective_state_update.default, torch.ops.ssmops.multihead_state_update.default
    return {
        "Mamba-1 layout": (lambda: ssmops.selective_state_update(state, x, dt, A, B, C, D, z, bias, True),
                           lambda: op(state, x, dt, A, B, C, D, z, bias, True)),
        "Mamba-1, bf16 cache + indices": (
            lambda: ssmops.selective_state_update(cache, x, dt, A, B, C, D, z, bias, True, index),
            lambda: multihead(cache, x, dt, A, B, C, D, z, bias, index, True)),  # (channels as heads of 1)
    }


def mamba2_rows(gen) -> dict:
    """Mamba-2's layout (batch, nheads, headdim, dstate): dt, A, D and dt_bias tied over headdim as
    stride-0 views (as mamba_ssm's Mamba2.step passes them; the operator is called with their per-head
    forms), the same per (head, channel), and the tied ones with a cache and state_batch_indices."""
    heads = (NHEADS, HEADDIM)
    x, z = _randn(1, *heads, gen=gen), _randn(1, *heads, gen=gen)
    B, C = _randn(1, NGROUPS, DSTATE, gen=gen), _randn(1, NGROUPS, DSTATE, gen=gen)
    dt_h, A_h, D_h, bias_h = _randn(1, NHEADS, gen=gen), -torch.rand(NHEADS, generator=gen), \
        _randn(NHEADS, gen=gen), _randn(NHEADS, gen=gen)
    tied = (dt_h[..., None].expand(1, *heads), A_h[:, None, None].expand(*heads, DSTATE),
            D_h[:, None].expand(heads), bias_h[:, None].expand(heads))
    per_channel = tuple(t.contiguous() for t in tied)
    state = _randn(1, *heads, DSTATE, gen=gen)
    cache = _randn(CACHE, *heads, DSTATE, gen=gen)
    index = torch.tensor([2], dtype=torch.int32)
    op = torch.ops.ssmops.multihead_state_update.default

    def row(state, forms, op_forms, index=None):
        dt, A, D, bias = forms
        dt_o, A_o, D_o, bias_o = op_forms
        return (lambda: ssmops.selective_state_update(state, x, dt, A, B, C, D, z, bias, True, index),
                lambda: op(state, x, dt_o, A_o, B, C, D_o, z, bias_o, index, True))

    return {
        "Mamba-2, tied (Mamba2.step)": row(state, tied, (dt_h, A_h, D_h, bias_h)),
        "Mamba-2, per channel": row(state, per_channel, per_channel),
        "Mamba-2, tied, cache + indices": row(cache, tied, (dt_h, A_h, D_h, bias_h), index),
    }


class _Recorder(TorchDispatchMode):
    """Records every operator call (with its arguments) that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def block_row(block, gen) -> tuple:
    """(block.step on one token, a replay of the operator calls that step dispatches)."""
    block.eval()
    hidden = _randn(1, 1, block.d_model, gen=gen)
    conv_state, ssm_state = block.allocate_inference_cache(1, 1)
    with _Recorder() as recorder:
        block.step(hidden, conv_state, ssm_state)
    calls = recorder.calls

    def replay():
        for func, args, kwargs in calls:
            func(*args, **kwargs)

    return lambda: block.step(hidden, conv_state, ssm_state), replay


def time_pair(front, op, calls: int, repeats: int) -> tuple[float, float, float]:
    """(fastest per-call seconds of the front end, of the operator, median turn's difference)."""

    def turn(fn):
        return seconds(lambda: [fn() for _ in range(calls)]) / calls

    front(), op()  # warm-up
    fronts, ops = [], []
    for _ in range(repeats):
        fronts.append(turn(front))
        ops.append(turn(op))
    return min(fronts), min(ops), statistics.median(f - o for f, o in zip(fronts, ops))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=500, help="calls in a timed turn")
    parser.add_argument("--repeats", type=int, default=40, help="turns of the front end and the operator each")
    parser.add_argument("--quick", action="store_true", help="few calls and turns (a smoke test)")
    args = parser.parse_args()
    calls, repeats = (20, 2) if args.quick else (args.calls, args.repeats)
    torch.set_num_threads(args.threads)
    if ssmops.available_backends()["cpu"] != "available":
        raise SystemExit(f"needs the native cpu backend: {ssmops.available_backends()['cpu']}")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch 1, native cpu backend, inference mode; "
          f"dim {DIM} / nheads {NHEADS} x headdim {HEADDIM}, dstate {DSTATE}")
    print(f"\n  {'front end':34s} {'front end us':>12s} {'operator us':>12s} {'overhead us':>12s} "
          f"{'(median turn)':>13s}")
    with torch.inference_mode():
        rows = {**mamba1_rows(gen), **mamba2_rows(gen),
                "Mamba.step (d_model 64)": block_row(Mamba(64, d_state=DSTATE), gen),
                "Mamba2.step (d_model 64)": block_row(Mamba2(64, d_state=DSTATE, headdim=HEADDIM), gen)}
        for name, (front, op) in rows.items():
            front_s, op_s, median_overhead = time_pair(front, op, calls, repeats)
            print(f"  {name:34s} {front_s * 1e6:12.1f} {op_s * 1e6:12.1f} {(front_s - op_s) * 1e6:12.1f} "
                  f"{median_overhead * 1e6:13.1f}", flush=True)


if __name__ == "__main__":
    main()
