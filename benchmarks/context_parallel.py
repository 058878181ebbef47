"""Context parallelism's traffic: bytes each rank receives per Mamba-2 layer (forward and backward)
for ssmops' state passing (ssmops.distributed) against the all-to-all scheme (Megatron-LM's
default for Mamba: every rank gets the whole sequence for nheads / world heads), at mamba2-2.7b's
layer (d_model 2560: nheads 80, headdim 64, dstate 128, ngroups 1, d_conv 4), batch 1.

    python benchmarks/context_parallel.py [--world 2] [--quick]

Computed: for 8k .. 1M tokens and world sizes 2, 8, 64. State passing, as implemented (each
exchange an all-gather: a rank receives world - 1 copies): two shape checks (64 int64 each), the
conv's halo (d_conv - 1 tokens of x, B, C, bf16) and the state summary (per head a decay and the
headdim x dstate final state, fp32), and in the backward the halo's and the state's gradients.
The last column prices a log-depth exchange (recursive doubling of the affine maps, point-to-point:
ceil(log2 world) summaries and state gradients, one halo each way), which ssmops does not implement
yet: it is what the all-gather's (world - 1) factor costs at large worlds.
All-to-all: the scan's inputs (in_proj's z, xBC, dt: bf16) to head-sharded and its output y back,
and the same in the backward; a rank keeps 1 / world of what it redistributes.

Measured: `--world` gloo processes on this machine run the context-parallel conv + SSD scan at that
layer shape (forward and backward) with two shard lengths, counting the bytes each all-gather
delivers to rank 0; then the all-to-all scheme's exchanges of the same tensors
(`all_to_all_single`). The state passing's bytes must not move with the shard length. (No times
for the exchanges: on one machine's loopback they price memory copies and the ranks' skew.)

Then the wall time per rank of that conv + scan (forward and backward, a smaller layer) at a fixed
total sequence as the world grows, up to this machine's cores, after one process without CP.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssmops import distributed as cp  # noqa: E402
from ssmops import causal_conv1d_fn, mamba_chunk_scan_combined  # noqa: E402

LAYER = dict(nheads=80, headdim=64, dstate=128, ngroups=1, d_conv=4)  # mamba2-2.7b
QUICK_LAYER = dict(nheads=8, headdim=16, dstate=16, ngroups=1, d_conv=4)
SCALING_LAYER = dict(nheads=16, headdim=64, dstate=64, ngroups=1, d_conv=4)  # CPU ranks: a smaller layer
ACTIVATION_BYTES = 2  # bf16 activations (what a GPU run moves); the states are fp32
SHAPE_CHECK_BYTES = 64 * 8  # one shape check: 64 int64 per rank
TOKENS = [8192 * 2**k for k in range(8)]  # 8k .. 1M


def widths(layer: dict) -> dict:
    d_ssm = layer["nheads"] * layer["headdim"]
    conv_dim = d_ssm + 2 * layer["ngroups"] * layer["dstate"]
    return dict(d_ssm=d_ssm, conv_dim=conv_dim, state=layer["nheads"] * layer["headdim"] * layer["dstate"])


def state_passing_bytes(layer: dict, world: int, batch: int = 1, log_depth: bool = False) -> int:
    """Bytes one rank receives per layer, forward + backward, with ssmops.distributed's all-gathers
    (or, `log_depth`, with a recursive-doubling exchange of the summaries and point-to-point halos)."""
    w = widths(layer)
    halo = batch * w["conv_dim"] * (layer["d_conv"] - 1) * ACTIVATION_BYTES
    summary = batch * (layer["nheads"] + w["state"]) * 4
    state_grad = batch * w["state"] * 4
    if log_depth:
        return 2 * halo + math.ceil(math.log2(world)) * (summary + state_grad)
    # each all-gather: the shape checks (conv, scan), halo, summary; backward: halo, state gradient
    return (world - 1) * (2 * SHAPE_CHECK_BYTES + halo + summary + halo + state_grad)


def all_to_all_bytes(layer: dict, world: int, tokens: int, batch: int = 1) -> int:
    """Bytes one rank receives per layer, forward + backward, head-sharding the scan's inputs and
    gathering its output back: z, xBC, dt in and y out, then their gradients."""
    w = widths(layer)
    features = w["d_ssm"] + w["conv_dim"] + layer["nheads"] + w["d_ssm"]  # z, xBC, dt; y
    local = batch * (tokens // world) * features * ACTIVATION_BYTES
    return 2 * local * (world - 1) // world


def print_computed(layer: dict) -> None:
    print("computed, bytes received per rank per layer (forward + backward), mamba2-2.7b's layer, batch 1")
    print(f"{'tokens':>9} {'world':>5} {'state passing':>15} {'all-to-all':>15} {'all-to-all / state passing':>27}"
          f" {'log-depth (not built)':>22} {'all-to-all / it':>16}")
    for world in (2, 8, 64):
        for tokens in TOKENS:
            ours, theirs = state_passing_bytes(layer, world), all_to_all_bytes(layer, world, tokens)
            log_depth = state_passing_bytes(layer, world, log_depth=True)
            print(f"{tokens:>9} {world:>5} {_mib(ours):>15} {_mib(theirs):>15} {theirs / ours:>26.2f}x"
                  f" {_mib(log_depth):>22} {theirs / log_depth:>15.1f}x")


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


class _Counter:
    """Counts the bytes the wrapped all_gather delivers from the other ranks."""

    def __init__(self):
        self.bytes = 0
        self._all_gather = dist.all_gather

    def all_gather(self, parts, tensor, group=None, async_op=False):
        self.bytes += (len(parts) - 1) * tensor.numel() * tensor.element_size()
        return self._all_gather(parts, tensor, group=group, async_op=async_op)


def _context_parallel_layer(layer: dict, seqlen: int, seed: int, conv=cp.causal_conv1d,
                            scan=cp.mamba_chunk_scan_combined) -> None:
    """The conv + SSD scan of a Mamba-2 layer on this rank's shard, forward and backward (with
    `conv` and `scan` of one process: the same on the whole sequence)."""
    g = torch.Generator().manual_seed(seed)
    h, groups, n = layer["nheads"], layer["ngroups"], layer["dstate"]
    w = widths(layer)

    def leaf(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_()

    xBC = conv(leaf(1, seqlen, w["conv_dim"]).transpose(1, 2), leaf(w["conv_dim"], layer["d_conv"], scale=0.3),
                           activation="silu").transpose(1, 2)
    x, B, C = torch.split(xBC, [w["d_ssm"], groups * n, groups * n], dim=-1)
    y = scan(
        x.unflatten(-1, (h, layer["headdim"])), leaf(1, seqlen, h), -torch.rand(h, generator=g) - 0.5,
        B.unflatten(-1, (groups, n)), C.unflatten(-1, (groups, n)), 256, D=leaf(h, dtype=torch.float32),
        dt_bias=leaf(h, scale=0.1, dtype=torch.float32), dt_softplus=True)
    y.float().square().mean().backward()


def _all_to_all_layer(layer: dict, seqlen: int, world: int) -> int:
    """The all-to-all scheme's exchanges on this rank's shard: the scan's inputs to head-sharded and
    y back, then the same for the gradients; the bytes rank 0 receives."""
    w = widths(layer)
    received = 0
    for features in [w["d_ssm"] + w["conv_dim"] + layer["nheads"], w["d_ssm"]] * 2:
        # (world, tokens, features / world): chunk j goes to rank j (the heads it will scan)
        send = torch.zeros(world, seqlen, -(-features // world), dtype=torch.bfloat16)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        received += (world - 1) * recv[0].numel() * recv.element_size()
    return received


def _measure(rank: int, world: int, port: int, layer: dict, seqlens: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        if rank == 0:
            print(f"\nmeasured with gloo, {world} processes on this machine, layer {layer}, batch 1, "
                  "bytes received by rank 0 per layer (forward + backward)")
            print(f"{'shard tokens':>12} {'state passing':>15} {'all-to-all':>15} {'all-to-all / state passing':>27}")
        for seqlen in seqlens:
            counter = _Counter()
            dist.all_gather = counter.all_gather
            try:
                _context_parallel_layer(layer, seqlen, seed=rank)
            finally:
                dist.all_gather = counter._all_gather
            theirs = _all_to_all_layer(layer, seqlen, world)
            if rank == 0:
                print(f"{seqlen:>12} {_mib(counter.bytes):>15} {_mib(theirs):>15} {theirs / counter.bytes:>26.2f}x")
        if rank == 0:
            print(f"computed state passing for world {world}: {_mib(state_passing_bytes(layer, world))}")
    finally:
        dist.destroy_process_group()


def _time_layers(rank: int, world: int, port: int, layer: dict, total: int, repeats: int) -> None:
    """Seconds per forward + backward of the CP layer on each rank's shard of `total` tokens."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        times = []
        for _ in range(repeats + 1):  # the first warms up
            dist.barrier()
            start = time.perf_counter()
            _context_parallel_layer(layer, total // world, seed=rank)
            times.append(time.perf_counter() - start)
        slowest = torch.tensor(statistics.median(times[1:]))
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{world:>6} {total // world:>13} {slowest.item() * 1e3:>14.1f} ms")
    finally:
        dist.destroy_process_group()


def print_scaling(layer: dict, total: int, repeats: int) -> None:
    """Wall time per rank (the slowest rank's median) at a fixed total sequence as the world grows, one
    thread per rank, worlds up to this machine's cores; first one process without CP (no exchange, one
    scan), whose time the world-1 CP row exceeds by the second scan."""
    print(f"\nwall time per rank, forward + backward of the conv + SSD scan, layer {layer}, "
          f"{total} tokens in all, one thread per rank")
    print(f"{'world':>6} {'shard tokens':>13} {'per rank':>17}")
    torch.set_num_threads(1)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        _context_parallel_layer(layer, total, seed=0, conv=causal_conv1d_fn, scan=mamba_chunk_scan_combined)
        times.append(time.perf_counter() - start)
    print(f"{'no CP':>6} {total:>13} {statistics.median(times[1:]) * 1e3:>14.1f} ms")
    world = 1
    while world <= (os.cpu_count() or 1):
        mp.start_processes(_time_layers, args=(world, _free_port(), layer, total, repeats), nprocs=world,
                           join=True, start_method="fork")
        world *= 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo processes for the measured part")
    parser.add_argument("--quick", action="store_true", help="a small layer and short shards (a smoke test)")
    args = parser.parse_args()
    print_computed(LAYER)
    layer, seqlens = (QUICK_LAYER, [64, 256]) if args.quick else (LAYER, [256, 1024])
    mp.start_processes(_measure, args=(args.world, _free_port(), layer, seqlens), nprocs=args.world, join=True,
                       start_method="fork")
    print_scaling(QUICK_LAYER if args.quick else SCALING_LAYER, 512 if args.quick else 8192, 1 if args.quick else 3)


if __name__ == "__main__":
    main()
