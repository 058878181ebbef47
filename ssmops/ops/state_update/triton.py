"""The decoding step's Triton backend: the launchers and the `ssmops::selective_state_update_triton`
and `ssmops::multihead_state_update_triton` operators (`triton_op`s, so compiled decode graphs and
AOTInductor packages launch the kernels themselves). Serves CUDA/ROCm/XPU tensors, and CPU tensors
under `TRITON_INTERPRET=1`.

A step runs once per layer per token, and at batch 1 its kernel takes a few microseconds, so the
launchers keep their Python short: the checks, tile sizes, grid and stride arguments of a launch are
worked out once per signature of the arguments (`_triton.cached_plan`) and reused by every later call.
"""

from typing import Optional

from torch import Tensor
from torch.library import triton_op

from .. import _triton
from .._checks import check_cache_indices
from .checks import check_multihead_inputs, check_state_update_inputs
from .schema import as_multihead
from .triton_kernels import multihead_state_update_kernel, selective_state_update_kernel


# Mamba-1's step: the (channels, states) elements of a program's tile and its warps. Module constants that
# `benchmarks/gpu.py --sweep` retunes on a GPU (at batch 1 the grid is dim / (tile / dstate) programs: 80 for
# dim 5120 and dstate 16, under an H100's 132 SMs; at batch 64 the state's traffic is the whole cost).
MAMBA1_STEP_TILE = 1024
MAMBA1_STEP_WARPS = 4


def _mamba1_launch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus) -> _triton.LaunchPlan:
    batch, dim, dstate, groups = check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    block_n = _triton.pow2_tile(dstate, 2, _triton.NO_CAP)
    block_d = _triton.pow2_tile(dim, 1, max(MAMBA1_STEP_TILE // block_n, 1))  # a (block_d, block_n) tile

    def bc_strides(M: Tensor) -> tuple:  # (batch, group, state); (batch, dstate) is one shared group
        return (M.stride(0), 0, M.stride(1)) if M.dim() == 2 else tuple(M.stride())

    numbers = (
        dim, dstate, dim // groups,
        *state.stride(), *x.stride(), *dt.stride(), *(z.stride() if z is not None else (0, 0)), *A.stride(),
        *bc_strides(B), *bc_strides(C), D.stride(0) if D is not None else 0,
        dt_bias.stride(0) if dt_bias is not None else 0, dim,
    )
    meta = dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
                BLOCK_D=block_d, BLOCK_N=block_n, num_warps=MAMBA1_STEP_WARPS)
    return _triton.LaunchPlan((_triton.cdiv(dim, block_d), batch), numbers, meta, (batch, dim))


def selective_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool,
) -> Tensor:
    plan = _triton.cached_plan(_mamba1_launch, (state, x, dt, A, B, C, D, z, dt_bias), dt_softplus)
    out = _triton.output(plan.out_shape, x.dtype, x.device)  # 1-D while a kernel writes it (_triton.output)
    _triton.launch(selective_state_update_kernel, plan.grid, (
        state, x, dt, A, B, C, D if D is not None else A, z if z is not None else x,
        dt_bias if dt_bias is not None else A, out, *plan.numbers), plan.meta)
    return out.view(plan.out_shape)


def _multihead_launch(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus) -> _triton.LaunchPlan:
    batch, nheads, headdim, dstate, ngroups, cache_size = check_multihead_inputs(
        state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    if x.dim() == 2:  # Mamba-1's layout: a channel a head of headdim 1, read through views of the same memory
        heads = as_multihead(state, x, dt, A, B, C, D, z, dt_bias)
        return _multihead_launch(*heads, state_batch_indices, dt_softplus)._replace(out_shape=(batch, nheads))
    block_n = _triton.pow2_tile(dstate, 2, _triton.NO_CAP)
    block_p = _triton.pow2_tile(headdim, 1, max(2048 // block_n, 1))  # a (block_p, block_n) tile of 2048

    def per_head(t: Optional[Tensor], rank: int) -> tuple:
        """(head, channel) strides of D or dt_bias; a per-head one's channel stride is 0."""
        if t is None:
            return 0, 0
        return tuple(t.stride()) if t.dim() == rank else (t.stride(0), 0)

    # a per-head dt, A or dt_bias, or one expanded over headdim with stride 0: one decay per head
    dt_strides = tuple(dt.stride()) if dt.dim() == 3 else (*dt.stride(), 0)
    A_strides = tuple(A.stride()) if A.dim() == 3 else (A.stride(0), 0, 0)
    bias_strides = per_head(dt_bias, 2)
    numbers = (
        headdim, dstate, nheads // ngroups, cache_size,
        *state.stride(), *x.stride(), *dt_strides, *A_strides, *B.stride(), *C.stride(), *per_head(D, 2),
        *(z.stride() if z is not None else (0, 0, 0)), *bias_strides,
    )
    meta = dict(DT_CHANNEL=dt_strides[2] != 0 or bias_strides[1] != 0, A_ELEMENT=A_strides[1:] != (0, 0),
                HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None,
                HAS_INDEX=state_batch_indices is not None, SOFTPLUS=bool(dt_softplus), BLOCK_P=block_p,
                BLOCK_N=block_n, num_warps=4)
    return _triton.LaunchPlan((_triton.cdiv(headdim, block_p), nheads, batch), numbers, meta, (batch, nheads, headdim))


def multihead_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], state_batch_indices: Optional[Tensor], dt_softplus: bool,
) -> Tensor:
    plan = _triton.cached_plan(_multihead_launch, (state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices),
                               dt_softplus)
    if type(state_batch_indices) is Tensor:  # (it reads the indices: not while tracing)
        check_cache_indices("state_batch_indices", state_batch_indices, state.shape[0], "state")
    out = _triton.output(plan.out_shape, x.dtype, x.device)  # 1-D while a kernel writes it
    # (Mamba-1's layout passes its tensors as they are: the views the plan was worked out on share their memory)
    _triton.launch(multihead_state_update_kernel, plan.grid, (
        state, x, dt, A, B, C, D if D is not None else A, z if z is not None else x,
        dt_bias if dt_bias is not None else A,
        state_batch_indices if state_batch_indices is not None else A, out, *plan.numbers), plan.meta)
    return out.view(plan.out_shape)


@triton_op("ssmops::selective_state_update_triton", mutates_args={"state"})
def selective_state_update_triton(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool,
) -> Tensor:
    """`ssmops::selective_state_update` on the Triton kernel; same schema and conventions."""
    return selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


@triton_op("ssmops::multihead_state_update_triton", mutates_args={"state"})
def multihead_state_update_triton(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], state_batch_indices: Optional[Tensor], dt_softplus: bool,
) -> Tensor:
    """`ssmops::multihead_state_update` on the Triton kernel; same schema and conventions."""
    return multihead_state_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus)


KERNELS = {"selective_state_update": selective_state_update, "multihead_state_update": multihead_state_update}
TRITON_OPS = {"selective_state_update": selective_state_update_triton,
              "multihead_state_update": multihead_state_update_triton}
