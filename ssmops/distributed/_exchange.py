"""The collectives of context parallelism: a shape check across the group, the passing of scan
states between shards (forward and its reverse), and the conv's halo. Each moves a few small
tensors whose size does not depend on the sequence length.

Every collective here is called by every rank of the group in the same order, in the forward
and in the backward: the autograd functions return a tensor that the caller always uses, so
each rank's backward reaches them (a gathered tensor that rank 0 left unused would leave the
other ranks waiting in the backward's collective).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

_DESCRIPTION_LENGTH = 64  # ints per rank in the shape check: one fixed size, so it never mismatches
_ABSENT = -1
_SEQUENCE_DIM = -2  # stands for the sharded dimension in a described shape


def as_process_group(group: ProcessGroup | DeviceMesh | None) -> ProcessGroup | None:
    """The process group of a 1-D DeviceMesh (a process group, or None for the default one, as is)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a context-parallel group must be a 1-D DeviceMesh (e.g. mesh['cp']), got "
                             f"{group.ndim} dimensions {group.mesh_dim_names}")
        return group.get_group()
    return group


def group_rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialized "
                           "(torch.distributed.init_process_group), got an uninitialized default group")
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_stacked(t: Tensor, group: ProcessGroup | None) -> Tensor:
    """(world, *t.shape): every rank's t, in group-rank order. Not differentiable."""
    real = torch.view_as_real(t) if t.is_complex() else t  # gloo gathers real tensors only
    parts = [torch.empty_like(real) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, real.contiguous(), group=group)
    stacked = torch.stack(parts)
    return torch.view_as_complex(stacked) if t.is_complex() else stacked


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.complex128,
           torch.int32, torch.int64]


def check_group_arguments(
    group: ProcessGroup | None,
    seqlen: int,
    tensors: dict[str, tuple[Tensor | None, int | None]],
    validate: Callable[[], None],
    min_seqlen: int = 1,
    min_seqlen_reason: str = "",
) -> None:
    """Runs `validate` (this rank's argument checks), then one small all-gather, after which every
    rank raises when any rank's arguments were refused (that rank its own error, the others a
    ValueError naming it), when a shard is shorter than `min_seqlen`, or when the ranks disagree on
    a shape or dtype of `tensors` (name: (tensor or None, its sharded dimension, None if it is
    replicated): only the sharded dimension may differ). So a bad group fails at once on every rank
    instead of hanging in a later collective."""
    try:
        validate()
        refused = None
    except (TypeError, ValueError) as error:
        refused = error
    description = [int(refused is not None), seqlen]
    for t, sequence_dim in tensors.values():
        if t is None:
            description.append(_ABSENT)
            continue
        dims = list(t.shape)
        if sequence_dim is not None:
            dims[sequence_dim] = _SEQUENCE_DIM
        code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
        description += [len(dims), code, *dims]
    if len(description) > _DESCRIPTION_LENGTH:
        raise ValueError(f"too many dimensions to check across the group ({len(description)} > {_DESCRIPTION_LENGTH})")
    description += [0] * (_DESCRIPTION_LENGTH - len(description))
    device = next(t.device for t, _ in tensors.values() if t is not None)
    gathered = all_gather_stacked(torch.tensor(description, dtype=torch.int64, device=device), group).tolist()
    if refused is not None:
        raise refused
    failed = [r for r, d in enumerate(gathered) if d[0]]
    if failed:
        raise ValueError(f"rank {failed[0]} of the context-parallel group refused its arguments (its error "
                         "is raised there); every rank stops")
    lengths = [d[1] for d in gathered]
    short = [(r, n) for r, n in enumerate(lengths) if n < min_seqlen]
    if short:
        rank, n = short[0]
        raise ValueError(f"context-parallel shards must have seqlen >= {min_seqlen}{min_seqlen_reason}; "
                         f"rank {rank} of the group has seqlen {n} (all ranks: {lengths})")
    for rank, other in enumerate(gathered):
        if other[2:] != gathered[0][2:]:
            raise ValueError("the ranks of the context-parallel group disagree on shapes or dtypes (seqlen may "
                             f"differ, nothing else): rank 0 has {_read_description(gathered[0], tensors)}, rank "
                             f"{rank} has {_read_description(other, tensors)}")


def _read_description(description: list[int], tensors: dict[str, object]) -> str:
    """A description's tensors, as `name (2, seqlen, 4) float32`, for an error message."""
    words, i = [], 2
    for name in tensors:
        if description[i] == _ABSENT:
            words.append(f"{name} None")
            i += 1
            continue
        ndim, code = description[i], description[i + 1]
        dims = ["seqlen" if d == _SEQUENCE_DIM else str(d) for d in description[i + 2:i + 2 + ndim]]
        dtype = str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "another dtype"
        words.append(f"{name} ({', '.join(dims)}) {dtype}")
        i += 2 + ndim
    return ", ".join(words)


class _PassStates(torch.autograd.Function):
    """Each rank's initial state from every rank's (decay, final state).

    With a_r the decay of rank r's shard (broadcast over the state), F_r its final state from a
    zero state (rank 0's from its initial state) and c_r in {0, 1} per batch row (0 where rank
    r's shard starts a new sequence), h_0 = 0 and h_r = c_r * (a_{r-1} * h_{r-1} + F_{r-1}).
    The backward is the reverse recurrence of the adjoints, lambda_r = g_r + c_{r+1} *
    conj(a_r) * lambda_{r+1} (g_r: the gradient that reached rank r's h_r): one all-gather of
    g, as the forward's of (a, F).
    """

    @staticmethod
    def forward(ctx, decay: Tensor, final: Tensor, continues: Tensor, group: ProcessGroup | None) -> Tensor:
        rank, _ = group_rank_and_size(group)
        flat = torch.cat([decay.reshape(-1), final.reshape(-1)])
        gathered = all_gather_stacked(flat, group)
        decays = gathered[:, :decay.numel()].reshape(-1, *decay.shape)
        finals = gathered[:, decay.numel():].reshape(-1, *final.shape)
        state = torch.zeros_like(final)
        for r in range(rank):
            state = _expand(continues[r + 1], state) * (decays[r] * state + finals[r])
        ctx.save_for_backward(decays, continues, state)
        ctx.group, ctx.decay_shape = group, decay.shape
        return state

    @staticmethod
    def backward(ctx, grad_state: Tensor):
        decays, continues, state = ctx.saved_tensors
        rank, world = group_rank_and_size(ctx.group)
        grads = all_gather_stacked(grad_state, ctx.group)
        # the adjoint of rank + 1's initial state (from every later rank), back to front
        later = torch.zeros_like(grad_state)
        for r in range(world - 1, rank, -1):
            later = grads[r] + (_expand(continues[r + 1], later) * decays[r].conj() * later if r + 1 < world else 0)
        reaching = _expand(continues[rank + 1], later) * later if rank + 1 < world else later  # d/d(a h + F)
        return (reaching * state.conj()).sum_to_size(ctx.decay_shape), reaching, None, None


def _expand(mask: Tensor, like: Tensor) -> Tensor:
    """A per-batch-row (batch,) mask shaped to multiply a (batch, ...) state."""
    return mask.reshape(mask.shape + (1,) * (like.dim() - 1)).to(like.dtype)


def pass_states(decay: Tensor, final_from_zero: Tensor, initial: Tensor | None, continues: Tensor | None,
                group: ProcessGroup | None) -> Tensor:
    """This rank's initial state (see _PassStates). decay broadcasts over final_from_zero's shape;
    `initial` is the whole sequence's initial state (read on rank 0 only; None: zero);
    `continues` (world, batch) is 1 where rank r's first token continues rank r - 1's last
    sequence (None: always)."""
    rank, world = group_rank_and_size(group)
    if continues is None:
        continues = torch.ones(world, final_from_zero.shape[0], device=final_from_zero.device)
    initial = initial.to(final_from_zero.dtype) if rank == 0 and initial is not None else None
    # rank 0 sends its true final state, so that the others' recurrence starts from zero
    final = final_from_zero if initial is None else decay * initial + final_from_zero
    state = _PassStates.apply(decay, final, continues, group)  # zero on rank 0, used so its backward runs
    return state if initial is None else state + initial


class _PreviousTail(torch.autograd.Function):
    """The previous rank's `tail` (zeros on rank 0); the backward hands each rank the gradient
    that the next rank computed for its tail."""

    @staticmethod
    def forward(ctx, tail: Tensor, group: ProcessGroup | None) -> Tensor:
        rank, _ = group_rank_and_size(group)
        ctx.group = group
        gathered = all_gather_stacked(tail, group)
        return gathered[rank - 1] if rank > 0 else torch.zeros_like(tail)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank, world = group_rank_and_size(ctx.group)
        gathered = all_gather_stacked(grad, ctx.group)
        return (gathered[rank + 1] if rank + 1 < world else torch.zeros_like(grad)), None


def previous_tail(tail: Tensor, group: ProcessGroup | None) -> Tensor:
    return _PreviousTail.apply(tail, group)
