"""Context parallelism: the scans and the causal conv over a sequence split along time across the
ranks of a process group, rank r holding the r-th contiguous shard.

A scan over one shard is affine in the shard's initial state h: final = a * h + F, with a the
shard's decay and F its final state from a zero state. Each rank scans its shard from zero, the
ranks all-gather (a, F) (a few MB, whatever the sequence length) and each rank composes the
previous ranks' maps into its true initial state. The outputs are affine in h too: the SSD scan
adds h's contribution (per head a scalar decay times C_t @ h: one contraction); the selective
scan, whose decay differs per channel and state, scans its shard again from h. Either way the
outputs, final states and gradients are the single-process ones. The conv needs the previous
rank's last width - 1 inputs (the halo).

Arguments replicated on every rank (A, D, dt_bias, the weights) get on each rank the gradient of
that rank's tokens only: sum them over the group (as DDP and FSDP do for parameters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from .. import selective_scan, ssd_combined
from ..causal_conv1d import causal_conv1d_fn, conv_taps
from ..ops.causal_conv1d.checks import check_conv_inputs
from ..ops.selective_scan.checks import check_scan_inputs
from ..ops.ssd.checks import check_sequence_values, check_ssd_inputs
from ..ops.ssd.default import discretize_dt
from ._exchange import (
    all_gather_stacked, as_process_group, check_group_arguments, group_rank_and_size, pass_states, previous_tail,
)


def mamba_chunk_scan_combined(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    *,
    group: ProcessGroup | DeviceMesh | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`ssmops.mamba_chunk_scan_combined` on this rank's shard of the sequence (dimension 1 of x,
    dt, B, C, z and seq_idx; shards may have any lengths >= 1, chunk multiples or not).

    `initial_states` is the whole sequence's (read on the group's rank 0; other ranks may pass
    None). `seq_idx` holds the global sequence ids of the shard's tokens: a sequence may start,
    end or continue across shards. Returns the shard's outputs and, with `return_final_states`,
    the state after the shard's last token (on the last rank: the whole sequence's final state).
    Collective: every rank of `group` (a process group or a 1-D DeviceMesh; None: the default
    group) must call it, in the same order
    as the other context-parallel calls. cu_seqlens / varlen states are not supported here.
    """
    group = as_process_group(group)
    rank, _ = group_rank_and_size(group)

    def validate():
        check_ssd_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, None, chunk_size,
                         ssd_combined._limit_arg(dt_limit))
        check_sequence_values(x.shape[1], seq_idx, None)

    check_group_arguments(group, x.shape[1], {
        "x": (x, 1), "dt": (dt, 1), "A": (A, None), "B": (B, 1), "C": (C, 1), "D": (D, None), "z": (z, 1),
        "dt_bias": (dt_bias, None), "seq_idx": (seq_idx, 1)}, validate)
    local_seq_idx = continues = None
    initial = initial_states if rank == 0 else None
    # (b, l, h): how much of the shard's initial state is left at each token, and after the shard
    reach = torch.exp(A.float() * discretize_dt(dt, dt_bias, dt_softplus, dt_limit).cumsum(1))
    decay = reach[:, -1]
    if seq_idx is not None:
        ends = all_gather_stacked(torch.stack([seq_idx[:, 0], seq_idx[:, -1]], -1).to(torch.int64), group)
        # rank r continues rank r - 1's last sequence where its first id is that sequence's id
        continues = torch.cat([torch.ones_like(ends[:1, :, 0]), ends[1:, :, 0] == ends[:-1, :, 1]]).float()
        decay = decay * (seq_idx[:, :1] == seq_idx[:, -1:])  # a boundary in the shard stops the carried state
        # the operator's initial state reaches the tokens of sequence id 0: make it the shard's first sequence
        local_seq_idx = seq_idx - seq_idx[:, :1]
        reach = reach * (local_seq_idx == 0).unsqueeze(-1)  # the state reaches the first sequence only
        if initial is not None:  # as one process: the initial state reaches a first sequence of id 0 only
            initial = initial * (seq_idx[:, 0] == 0).reshape(-1, 1, 1, 1)
    out_from_zero, final_from_zero = ssd_combined.mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, seq_idx=local_seq_idx, dt_softplus=dt_softplus,
        dt_limit=dt_limit, return_final_states=True)
    state = pass_states(decay[:, :, None, None], final_from_zero, initial, continues, group)
    # the outputs are affine in the initial state too: y_t += reach_t * (state @ C_t), per head; with
    # a scalar decay per head this is one contraction over dstate, not a second scan
    batch, seqlen, ngroups, dstate = C.shape
    grouped = state.unflatten(1, (ngroups, -1))  # (b, g, heads per group, headdim, dstate)
    correction = torch.einsum("btgn,bgkpn->btgkp", C.float(), grouped).flatten(2, 3) * reach.unsqueeze(-1)
    if z is not None:
        correction = correction * F.silu(z.float())
    out = (out_from_zero + correction).to(out_from_zero.dtype)
    if not return_final_states:
        return out
    return out, decay[:, :, None, None] * state + final_from_zero


def selective_scan_fn(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    initial_state: Tensor | None = None,
    *,
    group: ProcessGroup | DeviceMesh | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`ssmops.selective_scan_fn` on this rank's shard of the sequence (the last dimension of u,
    delta, z and of a variable B/C). `initial_state` is the whole sequence's (read on the group's
    rank 0); the last state returned is the state after the shard (on the last rank: the whole
    sequence's). Collective, as `mamba_chunk_scan_combined` here."""
    group = as_process_group(group)
    rank, _ = group_rank_and_size(group)
    check_group_arguments(group, u.shape[-1], {
        "u": (u, -1), "delta": (delta, -1), "A": (A, None), "B": (B, -1 if B.dim() > 2 else None),
        "C": (C, -1 if C.dim() > 2 else None), "D": (D, None), "z": (z, -1), "delta_bias": (delta_bias, None)},
        lambda: check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state))
    dt = delta.float() if delta_bias is None else delta.float() + delta_bias.float()[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    decay = torch.exp(A[None] * dt.sum(-1)[:, :, None])  # (batch, dim, dstate), A's dtype
    _, final_from_zero = selective_scan.selective_scan_fn(
        u, delta, A, B, C, delta_bias=delta_bias, delta_softplus=delta_softplus, return_last_state=True)
    state = pass_states(decay, final_from_zero, initial_state if rank == 0 else None, None, group)
    return selective_scan.selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                            return_last_state, state)


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    seq_idx: Tensor | None = None,
    *,
    group: ProcessGroup | DeviceMesh | None = None,
) -> Tensor:
    """`ssmops.causal_conv1d_fn` on this rank's shard (the last dimension of x, the
    second of seq_idx): the previous rank's last width - 1 inputs (and their sequence ids) are
    prepended, so every shard must be at least width - 1 long. Collective."""
    group = as_process_group(group)
    width = weight.shape[-1]
    halo = width - 1
    check_group_arguments(group, x.shape[-1], {
        "x": (x, -1), "weight": (weight, None), "bias": (bias, None), "seq_idx": (seq_idx, 1)},
        lambda: check_conv_inputs(x, conv_taps(weight), bias, seq_idx, None),
        min_seqlen=max(halo, 1), min_seqlen_reason=f" (the conv's halo, width - 1 = {halo})")
    if halo == 0:
        return causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation=activation)
    rank, _ = group_rank_and_size(group)
    # joined and cut time-major (so are the gradients): the layout the mixers pass (in_proj's output
    # transposed), which the conv reads fastest; the other one made its backward 4x slower
    x = torch.cat([previous_tail(x[..., -halo:], group).transpose(1, 2), x.transpose(1, 2)], 1).transpose(1, 2)
    if seq_idx is not None:
        tails = all_gather_stacked(seq_idx[:, -halo:], group)
        # rank 0's halo is zeros: its ids do not matter
        seq_idx = torch.cat([tails[rank - 1] if rank > 0 else seq_idx[:, :1].expand(-1, halo), seq_idx], -1)
    out = causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation=activation)
    return out.transpose(1, 2)[:, halo:].transpose(1, 2)
