"""Triton kernel of the decoding step: one launch per step, a program per block of channels."""

import triton
import triton.language as tl

from .._triton import LOG2E, softplus


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
    B and C are (batch, groups, dstate) (groups stride 0 when shared by all channels)."""
    pid_b = tl.program_id(1).to(tl.int64)
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = d < dim
    n = tl.arange(0, BLOCK_N)
    mask_dn = mask_d[:, None] & (n < dstate)[None, :]
    x = tl.load(x_ptr + pid_b * s_xb + d * s_xd, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * s_tb + d * s_td, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + d * s_bias, mask=mask_d, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    A = tl.load(A_ptr + d[:, None] * s_Ad + n[None, :] * s_An, mask=mask_dn, other=0.0)
    group = (d // dpg)[:, None]
    Bv = tl.load(B_ptr + pid_b * s_Bb + group * s_Bg + n[None, :] * s_Bn, mask=mask_dn, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + pid_b * s_Cb + group * s_Cg + n[None, :] * s_Cn, mask=mask_dn, other=0.0).to(tl.float32)
    state_ptrs = state_ptr + pid_b * s_sb + d[:, None] * s_sd + n[None, :] * s_sn
    h = tl.exp2(dt[:, None] * A * LOG2E) * tl.load(state_ptrs, mask=mask_dn, other=0.0) + (dt * x)[:, None] * Bv
    tl.store(state_ptrs, h, mask=mask_dn)
    y = tl.sum(h * Cv, axis=1)
    if HAS_D:
        y += tl.load(D_ptr + d * s_D, mask=mask_d, other=0.0).to(tl.float32) * x
    if HAS_Z:
        zv = tl.load(z_ptr + pid_b * s_zb + d * s_zd, mask=mask_d, other=0.0).to(tl.float32)
        y = y * zv * tl.sigmoid(zv)
    tl.store(out_ptr + pid_b * s_ob + d, y.to(out_ptr.dtype.element_ty), mask=mask_d)
