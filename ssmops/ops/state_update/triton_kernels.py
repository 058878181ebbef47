"""Triton kernels of the decoding step: one launch per step, a program per block of channels; Mamba-1's
layout, and Mamba-2's multi-head one."""

import triton
import triton.language as tl

from .._triton import LOG2E, sigmoid, softplus


@triton.jit
def selective_state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr,
    dim, dstate, dpg,
    s_sb, s_sd, s_sn, s_xb, s_xd, s_tb, s_td, s_zb, s_zd, s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn, s_D, s_bias, s_ob,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One decoding step for a block of channels of one batch row: the (BLOCK_D, BLOCK_N) state
    tile is read, advanced by one step and written back; y = <state, C> + D x, gated by silu(z).
    B and C are (batch, groups, dstate) (groups stride 0 when shared by all channels). Every input is
    loaded before the state is stored: the compiler keeps a load after a store it cannot tell apart from it,
    and the store waits for the arithmetic on the earlier loads, so such a load's latency adds to theirs: a
    latency more per step, where the step is latency alone at batch 1."""
    pid_b = tl.program_id(1).to(tl.int64)
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = d < dim
    n = tl.arange(0, BLOCK_N)
    mask_dn = mask_d[:, None] & (n < dstate)[None, :]
    state_ptrs = state_ptr + pid_b * s_sb + d[:, None] * s_sd + n[None, :] * s_sn
    state = tl.load(state_ptrs, mask=mask_dn, other=0.0)
    A = tl.load(A_ptr + d[:, None] * s_Ad + n[None, :] * s_An, mask=mask_dn, other=0.0)
    group = (d // dpg)[:, None]
    Bv = tl.load(B_ptr + pid_b * s_Bb + group * s_Bg + n[None, :] * s_Bn, mask=mask_dn, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + pid_b * s_Cb + group * s_Cg + n[None, :] * s_Cn, mask=mask_dn, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + pid_b * s_xb + d * s_xd, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * s_tb + d * s_td, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + d * s_bias, mask=mask_d, other=0.0).to(tl.float32)
    Dx = tl.zeros_like(x)
    if HAS_D:
        Dx = tl.load(D_ptr + d * s_D, mask=mask_d, other=0.0).to(tl.float32) * x
    zv = x
    if HAS_Z:
        zv = tl.load(z_ptr + pid_b * s_zb + d * s_zd, mask=mask_d, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    h = tl.exp2(dt[:, None] * A * LOG2E) * state + (dt * x)[:, None] * Bv
    tl.store(state_ptrs, h, mask=mask_dn)
    y = tl.sum(h * Cv, axis=1) + Dx
    if HAS_Z:
        y = y * zv * sigmoid(zv)
    tl.store(out_ptr + pid_b * s_ob + d, y.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def multihead_state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, index_ptr, out_ptr,
    headdim, dstate, heads_per_group, cache_size,
    s_sb, s_sh, s_sp, s_sn, s_xb, s_xh, s_xp, s_tb, s_th, s_tp, s_Ah, s_Ap, s_An,
    s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn, s_Dh, s_Dp, s_zb, s_zh, s_zp, s_biash, s_biasp,
    DT_CHANNEL: tl.constexpr, A_ELEMENT: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INDEX: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One decoding step of Mamba-2's layout for a block of channels of one (batch row, head): grid
    (channel blocks, nheads, batch). The (BLOCK_P, BLOCK_N) state tile of the row's cache entry is read,
    advanced and written back in the state's dtype; out (batch, nheads, headdim) is contiguous.

    DT_CHANNEL: dt + dt_bias varies over headdim (either is per channel; a per-head one comes with
    stride 0); A_ELEMENT: A varies over (headdim, dstate) (a per-head one comes with strides 0). With
    neither, dt, softplus and the decay exp(dt A) are one scalar per program: computed once per head,
    not per (channel, state)."""
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    pp = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    mask_p = pp < headdim
    mask = mask_p[:, None] & (nn < dstate)[None, :]
    row = b
    real = mask_p  # (BLOCK_P,): the channels to write
    if HAS_INDEX:  # the batch row's cache entry; a negative index is padding: nothing written, y = 0 (so is one
        # past the cache, which the launcher's check lets through only while a CUDA graph is captured)
        row = tl.load(index_ptr + b).to(tl.int64)
        real = mask_p & (pp * 0 + row >= 0) & (pp * 0 + row < cache_size)
        mask = mask & real[:, None]
        row = tl.maximum(row, 0)
    # every input loaded before the state is stored (selective_state_update_kernel says why)
    state_ptrs = state_ptr + row * s_sb + h * s_sh + pp[:, None] * s_sp + nn[None, :] * s_sn
    state = tl.load(state_ptrs, mask=mask, other=0.0).to(tl.float32)
    g = h // heads_per_group
    Bv = tl.load(B_ptr + b * s_Bb + g * s_Bg + nn * s_Bn, mask=nn < dstate, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b * s_Cb + g * s_Cg + nn * s_Cn, mask=nn < dstate, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * s_xb + h * s_xh + pp * s_xp, mask=mask_p, other=0.0).to(tl.float32)
    Dx = tl.zeros_like(x)
    if HAS_D:
        Dx = tl.load(D_ptr + h * s_Dh + pp * s_Dp, mask=mask_p, other=0.0).to(tl.float32) * x
    zv = x
    if HAS_Z:
        zv = tl.load(z_ptr + b * s_zb + h * s_zh + pp * s_zp, mask=mask_p, other=0.0).to(tl.float32)
    if DT_CHANNEL:
        dt = tl.load(dt_ptr + b * s_tb + h * s_th + pp * s_tp, mask=mask_p, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt += tl.load(bias_ptr + h * s_biash + pp * s_biasp, mask=mask_p, other=0.0).to(tl.float32)
    else:
        dt = tl.load(dt_ptr + b * s_tb + h * s_th).to(tl.float32)
        if HAS_BIAS:
            dt += tl.load(bias_ptr + h * s_biash).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    if A_ELEMENT:
        A = tl.load(A_ptr + h * s_Ah + pp[:, None] * s_Ap + nn[None, :] * s_An, mask=mask, other=0.0)
        if DT_CHANNEL:
            decay = tl.exp2(dt[:, None] * A * LOG2E)
        else:
            decay = tl.exp2(dt * A * LOG2E)
    elif DT_CHANNEL:
        decay = tl.exp2(dt * (tl.load(A_ptr + h * s_Ah) * LOG2E))[:, None]
    else:
        decay = tl.exp2(dt * (tl.load(A_ptr + h * s_Ah) * LOG2E))
    state = decay * state + (dt * x)[:, None] * Bv[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(state * Cv[None, :], axis=1) + Dx
    if HAS_Z:
        y = y * zv * sigmoid(zv)
    y = tl.where(real, y, 0.0)
    tl.store(out_ptr + (b * tl.num_programs(1) + h) * headdim + pp, y.to(out_ptr.dtype.element_ty), mask=mask_p)
