"""The causal conv's Triton backend: the launchers, and the `ssmops::causal_conv1d_{fwd,bwd,update}_triton`
operators (`triton_op`s, so compiled graphs and AOTInductor packages launch the kernels themselves). Serves
CUDA/ROCm/XPU tensors, and CPU tensors under `TRITON_INTERPRET=1`."""

from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op

from .. import _triton
from .._checks import check_cache_indices
from .checks import check_conv_grad_inputs, check_conv_inputs, check_update_inputs
from .schema import is_channel_last
from .triton_kernels import (
    causal_conv1d_dpre_kernel, causal_conv1d_dstream_kernel, causal_conv1d_fwd_kernel, causal_conv1d_update_kernel,
)


def _dense_when_traced(x: Tensor) -> Tensor:
    """x (batch, dim, seqlen) as a traced launch must read it: dense in its own layout (a tracer's strides
    are numbers in the launch, and Inductor keeps a layout's order but not a view's exact strides; see
    _triton.contiguous_when_traced). A dense channel-last x stays as it is: no transposing copy."""
    if not is_fake(x) or x.is_contiguous() or x.transpose(1, 2).is_contiguous():
        return x
    if is_channel_last(x):
        return x.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)
    return x.clone(memory_format=torch.contiguous_format)


def _output_like(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(the 1-D buffer a kernel writes, its (batch, dim, seqlen) view in x's layout: schema.empty_like_x)."""
    batch, dim, seqlen = x.shape
    buffer = _triton.output((batch, dim, seqlen), dtype, x.device)
    if is_channel_last(x):
        return buffer, buffer.view(batch, seqlen, dim).transpose(1, 2)
    return buffer, buffer.view(batch, dim, seqlen)


def _tiles(dim: int, seqlen: int) -> dict:
    # (64 x 64 tiles spilled a few registers in the forward with seq_idx and initial states, sm_90)
    return dict(BLOCK_D=_triton.pow2_tile(dim, 16, 64), BLOCK_T=_triton.pow2_tile(seqlen, 16, 32), num_warps=4)


def _strides(t: Optional[Tensor], rank: int) -> tuple:
    return tuple(t.stride()) if t is not None else (0,) * rank


def _common_args(x, weight, bias, initial_states, seq_idx) -> tuple:
    return (*x.stride(), *weight.stride(), bias.stride(0) if bias is not None else 0, *_strides(initial_states, 3),
            *_strides(seq_idx, 2))


def _flags(bias, seq_idx, initial_states, silu, width) -> dict:
    return dict(HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, HAS_INIT=initial_states is not None,
                SILU=bool(silu), WIDTH=width)


def causal_conv1d_fwd(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor], initial_states: Optional[Tensor],
    silu: bool,
) -> tuple[Tensor, Tensor]:
    batch, dim, seqlen, width = check_conv_inputs(x, weight, bias, seq_idx, initial_states)
    out_buffer, out = _output_like(x, x.dtype)  # (the layout follows x as the caller gave it)
    x = _dense_when_traced(x)
    weight, bias, seq_idx, initial_states = _triton.contiguous_when_traced(weight, bias, seq_idx, initial_states)
    final = _triton.output((batch, dim, width - 1), x.dtype, x.device)
    tiles = _tiles(dim, seqlen)
    grid = (_triton.cdiv(dim, tiles["BLOCK_D"]), _triton.cdiv(seqlen, tiles["BLOCK_T"]), batch)
    _triton.launch(causal_conv1d_fwd_kernel, grid, (
        x, weight, bias if bias is not None else weight, initial_states if initial_states is not None else x,
        seq_idx if seq_idx is not None else weight, out_buffer, final, dim, seqlen,
        *_common_args(x, weight, bias, initial_states, seq_idx), *out.stride(),
    ), dict(**_flags(bias, seq_idx, initial_states, silu, width), BLOCK_H=_triton.pow2_tile(width - 1, 1, 1 << 30),
            **tiles))
    return out, final.view(batch, dim, width - 1)


def causal_conv1d_bwd(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor], initial_states: Optional[Tensor],
    dout: Tensor, dfinal_states: Optional[Tensor], silu: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dims = check_conv_inputs(x, weight, bias, seq_idx, initial_states)
    check_conv_grad_inputs(dims, x, dout, dfinal_states)
    batch, dim, seqlen, width = dims
    dx_buffer, dx = _output_like(x, x.dtype)
    x, dout = _dense_when_traced(x), _dense_when_traced(dout)
    weight, bias, seq_idx, initial_states, dfinal_states = _triton.contiguous_when_traced(
        weight, bias, seq_idx, initial_states, dfinal_states)
    tiles = _tiles(dim, seqlen)
    time_blocks = _triton.cdiv(seqlen, tiles["BLOCK_T"])
    f32 = dict(dtype=torch.float32, device=x.device)
    dpre, dpre_view = _output_like(x, torch.float32)  # in x's layout: both passes read it along dim when x is
    dw_part = _triton.output((batch * time_blocks, dim, width), **f32)
    db_part = _triton.output((batch * time_blocks, dim), **f32) if bias is not None else dw_part
    flags = _flags(bias, seq_idx, initial_states, silu, width)
    _triton.launch(causal_conv1d_dpre_kernel, (_triton.cdiv(dim, tiles["BLOCK_D"]), time_blocks, batch), (
        x, weight, bias if bias is not None else weight, initial_states if initial_states is not None else x,
        seq_idx if seq_idx is not None else weight, dout, dpre, dw_part, db_part, dim, seqlen,
        *_common_args(x, weight, bias, initial_states, seq_idx), *dout.stride(), *dpre_view.stride(),
    ), dict(**flags, **tiles))
    dinit = _triton.output((batch, dim, width - 1), x.dtype, x.device) if initial_states is not None else None
    stream_blocks = _triton.cdiv(seqlen + width - 1, tiles["BLOCK_T"])
    _triton.launch(causal_conv1d_dstream_kernel, (_triton.cdiv(dim, tiles["BLOCK_D"]), stream_blocks, batch), (
        weight, seq_idx if seq_idx is not None else weight, dpre,
        dfinal_states if dfinal_states is not None else dpre, dx_buffer, dinit if dinit is not None else dx_buffer,
        dim, seqlen, *weight.stride(), *_strides(seq_idx, 2), *dpre_view.stride(), *_strides(dfinal_states, 3),
        *dx.stride(),
    ), dict(HAS_SEQ=seq_idx is not None, HAS_INIT=dinit is not None, HAS_DFINAL=dfinal_states is not None,
            WIDTH=width, **tiles))
    dweight = dw_part.view(batch * time_blocks, dim, width).sum(0).to(weight.dtype)
    dbias = db_part.view(batch * time_blocks, dim).sum(0).to(bias.dtype) if bias is not None else x.new_empty(0)
    return dx, dweight, dbias, dinit.view(batch, dim, width - 1) if dinit is not None else x.new_empty(0)


def causal_conv1d_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], cache_seqlens: Optional[Tensor],
    conv_state_indices: Optional[Tensor], silu: bool,
) -> Tensor:
    plan = _triton.cached_plan(_update_launch, (x, conv_state, weight, bias, cache_seqlens, conv_state_indices),
                               silu)
    if type(conv_state_indices) is Tensor:  # (it reads the indices: not while tracing)
        check_cache_indices("conv_state_indices", conv_state_indices, conv_state.shape[0], "conv_state")
    out = _triton.output(plan.out_shape, x.dtype, x.device)  # 1-D while a kernel writes it
    _triton.launch(causal_conv1d_update_kernel, plan.grid, (
        x, conv_state, weight, bias if bias is not None else weight,
        cache_seqlens if cache_seqlens is not None else weight,
        conv_state_indices if conv_state_indices is not None else weight, out, *plan.numbers), plan.meta)
    return out.view(plan.out_shape)


def _update_launch(x, conv_state, weight, bias, cache_seqlens, conv_state_indices, silu) -> _triton.LaunchPlan:
    """The decoding step's launch, worked out once per signature of its arguments (a step per layer per token:
    `_triton.cached_plan`)."""
    batch, dim, seqlen, width, state_len, cache_size = check_update_inputs(
        x, conv_state, weight, bias, cache_seqlens, conv_state_indices)
    block_d = _triton.pow2_tile(dim, 16, 128)
    numbers = (dim, seqlen, state_len, cache_size, *x.stride(), *conv_state.stride(), *weight.stride(),
               bias.stride(0) if bias is not None else 0)
    meta = dict(CIRCULAR=cache_seqlens is not None, HAS_INDEX=conv_state_indices is not None,
                HAS_BIAS=bias is not None, SILU=bool(silu), WIDTH=width, BLOCK_D=block_d,
                BLOCK_L=_triton.pow2_tile(state_len, 1, _triton.NO_CAP), num_warps=4)
    return _triton.LaunchPlan((_triton.cdiv(dim, block_d), batch), numbers, meta, (batch, dim, seqlen))


@triton_op("ssmops::causal_conv1d_fwd_triton", mutates_args=())
def causal_conv1d_fwd_triton(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor], initial_states: Optional[Tensor],
    silu: bool,
) -> tuple[Tensor, Tensor]:
    """`ssmops::causal_conv1d_fwd` on the Triton kernels; same schema and conventions."""
    return causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, silu)


@triton_op("ssmops::causal_conv1d_bwd_triton", mutates_args=())
def causal_conv1d_bwd_triton(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor], initial_states: Optional[Tensor],
    dout: Tensor, dfinal_states: Optional[Tensor], silu: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`ssmops::causal_conv1d_bwd` on the Triton kernels; same schema and conventions."""
    return causal_conv1d_bwd(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu)


@triton_op("ssmops::causal_conv1d_update_triton", mutates_args={"conv_state"})
def causal_conv1d_update_triton(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], cache_seqlens: Optional[Tensor],
    conv_state_indices: Optional[Tensor], silu: bool,
) -> Tensor:
    """`ssmops::causal_conv1d_update` on the Triton kernel; same schema and conventions."""
    return causal_conv1d_update(x, conv_state, weight, bias, cache_seqlens, conv_state_indices, silu)


KERNELS = {"causal_conv1d_fwd": causal_conv1d_fwd, "causal_conv1d_bwd": causal_conv1d_bwd,
           "causal_conv1d_update": causal_conv1d_update}
TRITON_OPS = {"causal_conv1d_fwd": causal_conv1d_fwd_triton, "causal_conv1d_bwd": causal_conv1d_bwd_triton,
              "causal_conv1d_update": causal_conv1d_update_triton}
