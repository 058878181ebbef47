"""Tensor parallelism for the Mamba-2 block on DTensor: its heads split over a 1-D device mesh, as
mamba_ssm's `Mamba2(process_group=...)` splits them, built on torch.distributed.tensor.parallel."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _rank_major_rows(segments: list[int], world: int) -> Tensor:
    """Row order that puts rank r's share of every segment together, rank after rank: in_proj's
    [z, x, B, C, dt] becomes [z_0, x_0, B_0, C_0, dt_0, z_1, ...], so that a contiguous Shard(0)
    hands each rank its heads' rows of every segment."""
    starts = torch.tensor([0, *segments]).cumsum(0)[:-1].tolist()
    return torch.cat([torch.arange(start + r * size // world, start + (r + 1) * size // world)
                      for r in range(world) for start, size in zip(starts, segments)])


def parallelize_mamba2(block: nn.Module, mesh) -> nn.Module:
    """Splits a `Mamba2` block's heads over the 1-D DeviceMesh `mesh`, in place, and returns it:
    in_proj column-wise (its rows reordered rank-major, see _rank_major_rows), out_proj row-wise
    (one all-reduce of the output per forward), the conv's channels, A_log, D, dt_bias and the gated
    norm's weight by heads, each a DTensor sharded on dimension 0. Every rank then runs the conv,
    the scan and the norm on its nheads / world heads, for training and prefill (not decoding);
    with a `context_parallel_group` too, on its shard of the sequence (a 2-D mesh: cp x tp).

    Load a single-process checkpoint before parallelizing: in_proj's and conv1d's logical layout
    afterwards is rank-major. Needs nheads and ngroups divisible by the mesh's size, and no MLP
    channels beside the SSM (d_ssm == d_inner)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = mesh.size()
    if block.nheads % world or block.ngroups % world:
        raise ValueError(f"tensor parallelism over {world} ranks needs nheads ({block.nheads}) and ngroups "
                         f"({block.ngroups}) divisible by {world}")
    if block.d_ssm != block.d_inner:
        raise ValueError(f"tensor parallelism needs d_ssm == d_inner (no MLP channels), got d_ssm {block.d_ssm}, "
                         f"d_inner {block.d_inner}")
    bc = block.ngroups * block.d_state
    with torch.no_grad():
        rows = _rank_major_rows([block.d_ssm, block.d_ssm, bc, bc, block.nheads], world)
        _reorder(block.in_proj, rows)
        _reorder(block.conv1d, _rank_major_rows([block.d_ssm, bc, bc], world))
    parallelize_module(block, mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    owners = [block.conv1d, block, block, block] + ([block.norm] if block.rmsnorm else [])
    for owner, name in zip(owners, ["weight", "A_log", "D", "dt_bias", "weight"]):
        param = getattr(owner, name)
        setattr(owner, name, nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]),
                                          requires_grad=param.requires_grad))
    if block.conv1d.bias is not None:
        block.conv1d.bias = nn.Parameter(distribute_tensor(block.conv1d.bias.data, mesh, [Shard(0)]))
    # the forward's sizes are this rank's
    block.nheads, block.ngroups = block.nheads // world, block.ngroups // world
    block.d_ssm, block.d_inner, block.conv_dim = block.d_ssm // world, block.d_inner // world, block.conv_dim // world
    block.tensor_parallel_mesh = mesh
    return block


def _reorder(layer: nn.Module, rows: Tensor) -> None:
    layer.weight.copy_(layer.weight[rows])
    if layer.bias is not None:
        layer.bias.copy_(layer.bias[rows])


def local(t: Tensor | None) -> Tensor | None:
    """This rank's shard of a DTensor parameter (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t
