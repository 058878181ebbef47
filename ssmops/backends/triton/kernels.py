"""Triton kernels of the selective scan, forward and backward.

Layout of the work: one program per (block of BLOCK_D channels, batch row). It keeps the
state tile `h` of shape (BLOCK_D, BLOCK_N) in registers for the whole sequence and
walks time in blocks of BLOCK_T steps (BLOCK_T divides the 2048-step chunk). Inside a
time block the recurrence `h_t = decay_t * h_{t-1} + drive_t` is a first-order linear
recurrence, so it is computed as an inclusive `tl.associative_scan` along time of the
affine maps `(decay_t, drive_t)` (combine: `(a1, b1), (a2, b2) -> (a1 a2, a2 b1 + b2)`),
then applied to the carried state: `h_t = a_cum_t * h_{start} + b_cum_t`. Every load
and store is a (channels, time) tile, contiguous along time, so global memory is read
and written once, coalesced; all arithmetic is float32 whatever the input dtype.

Forward: per block, y_t = <h_t, C_t> + D u_t, gated by silu(z); at the end of every
2048-step chunk the program writes mamba_ssm's `x` entries (cumulative decay since
t=0, then the state) into `scan_intermediates`, and the final state into `last_state`.

Backward: chunks are walked last to first. For a chunk, the program first replays the
forward from the chunk-start state (the previous chunk's saved state, or
initial_state) and parks each time block's start state in a small per-program scratch
buffer (`CHUNK_LEN / BLOCK_T` tiles of (BLOCK_D, BLOCK_N)); then it walks the blocks
in reverse, recomputes the block's states from its parked start, and runs the adjoint
recurrence `g_t = C_t dy_t + decay_{t+1} g_{t+1}` as a reverse `tl.associative_scan`
(decay_{t+1} is recomputed from delta loaded one step ahead, which is cheaper than
shifting a register tile). `g_t * decay_t * h_{t-1}` is formed as `g_t * (h_t - drive_t)`,
so no shifted state is needed either. The gradient that leaves a block through h_{t0-1}
(`carry`) enters the previous block at its last step. Reductions over time (dA, dD,
d delta_bias, constant dB/dC) accumulate per program in registers and are written as
float32 per-(batch, channel) partials that the caller sums with torch. Variable dB/dC are
first summed over the program's channels (all in one B/C group: the caller picks BLOCK_D
dividing the group size); then, by default, added atomically into a float32 buffer shaped
like B/C (what mamba_ssm does too, with one atomic per channel rather than per block of
channels), or, under `torch.use_deterministic_algorithms(True)`, written per (batch,
channel block, state, time) and summed by the caller in a fixed order: the backward is
then deterministic, at the cost of a buffer of `dim / BLOCK_D` times B's size.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a JIT function reads only constexpr globals


@triton.jit
def _affine_combine(a1, b1, a2, b2):
    # composition of h -> a1 h + b1 followed by h -> a2 h + b2
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _softplus(x):
    # torch.nn.functional.softplus with its default threshold of 20
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)


@triton.jit
def _load_dt(delta_row, bias, t, mask, s_dt, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """(dt_raw, dt) as float32 (BLOCK_D, BLOCK_T); dt is 0 where masked, so decay = 1, drive = 0."""
    dt_raw = tl.load(delta_row[:, None] + t[None, :] * s_dt, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt_raw = dt_raw + bias[:, None]
    dt = dt_raw
    if SOFTPLUS:
        dt = _softplus(dt_raw)
    dt = tl.where(mask, dt, 0.0)
    return dt_raw, dt


@triton.jit
def _load_bc_const(ptr, d, n, mask_dn, s_d, s_n):
    """Constant B or C (dim, dstate) -> float32 (BLOCK_D, BLOCK_N, 1)."""
    return tl.load(ptr + d[:, None] * s_d + n[None, :] * s_n, mask=mask_dn, other=0.0).to(tl.float32)[:, :, None]


@triton.jit
def _load_bc_var(base, n, t, mask_n, mask_t, s_n, s_t):
    """Variable B or C of one (batch, group) -> float32 (1, BLOCK_N, BLOCK_T)."""
    ptrs = base + n[:, None] * s_n + t[None, :] * s_t
    return tl.load(ptrs, mask=mask_n[:, None] & mask_t[None, :], other=0.0).to(tl.float32)[None, :, :]


@triton.jit
def _last_along_time(x, tt, BLOCK_T: tl.constexpr):
    """x[:, :, BLOCK_T - 1] of a (BLOCK_D, BLOCK_N, BLOCK_T) tile."""
    return tl.sum(tl.where((tt == BLOCK_T - 1)[None, None, :], x, 0.0), axis=2)


@triton.jit
def _first_along_time(x, tt):
    return tl.sum(tl.where((tt == 0)[None, None, :], x, 0.0), axis=2)


@triton.jit
def _add_or_store(ptrs, value, mask, ATOMIC: tl.constexpr):
    if ATOMIC:
        tl.atomic_add(ptrs, value, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def _program_channels(pid_d, dim, dstate, A_ptr, bias_ptr, D_ptr, s_Ad, s_An,
                      HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's channels and states with their masks, and its rows of A, delta_bias and D
    (zeros where absent)."""
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = d < dim
    n = tl.arange(0, BLOCK_N)
    mask_n = n < dstate
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + d[:, None] * s_Ad + n[None, :] * s_An, mask=mask_dn, other=0.0)
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=mask_d, other=0.0)
    Dv = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0)
    return d, d.to(tl.int64), mask_d, n, mask_n, mask_dn, A, bias, Dv


@triton.jit
def selective_scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr,
    out_ptr, out_z_ptr, x_ptr, last_ptr,
    dim, seqlen, dstate, n_chunks, dpg_B, dpg_C,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt,
    s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Bt, s_Cb, s_Cg, s_Cn, s_Ct,
    s_ib, s_id, s_in,
    s_ob, s_od, s_xb, s_xd, s_lb, s_ld,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    SOFTPLUS: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
):
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    d, d64, mask_d, n, mask_n, mask_dn, A, bias, Dv = _program_channels(
        pid_d, dim, dstate, A_ptr, bias_ptr, D_ptr, s_Ad, s_An, HAS_BIAS, HAS_D, BLOCK_D, BLOCK_N
    )
    A2 = A * LOG2E  # decay = exp2(dt * A * log2(e))
    tt = tl.arange(0, BLOCK_T)
    if HAS_INIT:
        h = tl.load(init_ptr + pid_b * s_ib + d64[:, None] * s_id + n[None, :] * s_in, mask=mask_dn, other=0.0)
    else:
        h = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)

    u_row = u_ptr + pid_b * s_ub + d64 * s_ud
    delta_row = delta_ptr + pid_b * s_db + d64 * s_dd
    z_row = z_ptr + pid_b * s_zb + d64 * s_zd
    out_row = out_ptr + pid_b * s_ob + d64 * s_od
    out_z_row = out_z_ptr + pid_b * s_ob + d64 * s_od
    if B_VAR:
        B_base = B_ptr + pid_b * s_Bb + ((pid_d * BLOCK_D) // dpg_B) * s_Bg
    else:
        B_const = _load_bc_const(B_ptr, d, n, mask_dn, s_Bg, s_Bn)
    if C_VAR:
        C_base = C_ptr + pid_b * s_Cb + ((pid_d * BLOCK_D) // dpg_C) * s_Cg
    else:
        C_const = _load_bc_const(C_ptr, d, n, mask_dn, s_Cg, s_Cn)

    dt_total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for c in range(0, n_chunks):
        c_end = tl.minimum(seqlen, (c + 1) * CHUNK)
        for t0 in range(c * CHUNK, c_end, BLOCK_T):
            t = t0 + tt
            mask_t = t < c_end
            mask = mask_d[:, None] & mask_t[None, :]
            u = tl.load(u_row[:, None] + t[None, :] * s_ut, mask=mask, other=0.0).to(tl.float32)
            _, dt = _load_dt(delta_row, bias, t, mask, s_dt, HAS_BIAS, SOFTPLUS)
            decay = tl.exp2(dt[:, None, :] * A2[:, :, None])
            if B_VAR:
                Bt = _load_bc_var(B_base, n, t, mask_n, mask_t, s_Bn, s_Bt)
            else:
                Bt = B_const
            drive = (dt * u)[:, None, :] * Bt
            a_cum, b_cum = tl.associative_scan((decay, drive), 2, _affine_combine)
            hs = a_cum * h[:, :, None] + b_cum
            if C_VAR:
                Ct = _load_bc_var(C_base, n, t, mask_n, mask_t, s_Cn, s_Ct)
            else:
                Ct = C_const
            y = tl.sum(hs * Ct, axis=1)
            if HAS_D:
                y += Dv[:, None] * u
            tl.store(out_row[:, None] + t[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
            if HAS_Z:
                zv = tl.load(z_row[:, None] + t[None, :] * s_zt, mask=mask, other=0.0).to(tl.float32)
                y_z = y * zv * tl.sigmoid(zv)
                tl.store(out_z_row[:, None] + t[None, :], y_z.to(out_z_ptr.dtype.element_ty), mask=mask)
            h = _last_along_time(hs, tt, BLOCK_T)
            dt_total += tl.sum(dt, axis=1)
        # mamba_ssm's x: cumulative decay since t=0 (even entries), state (odd) at chunk end
        x_ptrs = x_ptr + pid_b * s_xb + d64[:, None] * s_xd + c * 2 * dstate + 2 * n[None, :]
        tl.store(x_ptrs, tl.exp2(dt_total[:, None] * A2), mask=mask_dn)
        tl.store(x_ptrs + 1, h, mask=mask_dn)
    tl.store(last_ptr + pid_b * s_lb + d64[:, None] * s_ld + n[None, :], h, mask=mask_dn)


@triton.jit
def selective_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr, dout_ptr, x_ptr,
    dlast_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr, dinit_ptr, scratch_ptr,
    dim, seqlen, dstate, n_chunks, dpg_B, dpg_C,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt, s_gb, s_gd, s_gt,
    s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Bt, s_Cb, s_Cg, s_Cn, s_Ct,
    s_ib, s_id, s_in, s_xb, s_xd, s_lb, s_ld, s_ln,
    s_ob, s_od,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_DLAST: tl.constexpr, SOFTPLUS: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr,
    BC_ATOMIC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
):
    """Outputs: du, ddelta, dz like u (contiguous, strides s_ob, s_od, 1); dinit, and the float32
    partials dA (batch, dim, dstate), dD and dbias (batch, dim), constant dB/dC (batch, dim,
    dstate); variable dB/dC (batch, groups, dstate, seqlen), zeroed, if BC_ATOMIC, else partials
    (batch, n_channel_blocks, dstate, seqlen); all contiguous."""
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    n_dblocks = tl.num_programs(0)
    d, d64, mask_d, n, mask_n, mask_dn, A, bias, Dv = _program_channels(
        pid_d, dim, dstate, A_ptr, bias_ptr, D_ptr, s_Ad, s_An, HAS_BIAS, HAS_D, BLOCK_D, BLOCK_N
    )
    A2 = A * LOG2E  # decay = exp2(dt * A * log2(e))
    tt = tl.arange(0, BLOCK_T)
    if HAS_DLAST:
        carry = tl.load(dlast_ptr + pid_b * s_lb + d64[:, None] * s_ld + n[None, :] * s_ln, mask=mask_dn, other=0.0)
    else:
        carry = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)

    u_row = u_ptr + pid_b * s_ub + d64 * s_ud
    delta_row = delta_ptr + pid_b * s_db + d64 * s_dd
    z_row = z_ptr + pid_b * s_zb + d64 * s_zd
    dout_row = dout_ptr + pid_b * s_gb + d64 * s_gd
    grad_row = pid_b * s_ob + d64 * s_od  # du, ddelta, dz
    x_row = x_ptr + pid_b * s_xb + d64 * s_xd
    bd_dn = (pid_b * dim + d64)[:, None] * dstate + n[None, :]  # (batch, dim, dstate) partials
    # this program's (dstate, seqlen) rows of variable dB / dC: its B/C group's, or its own
    if BC_ATOMIC:
        dB_rows = dB_ptr + ((pid_b * (dim // dpg_B) + (pid_d * BLOCK_D) // dpg_B) * dstate + n[:, None]) * seqlen
        dC_rows = dC_ptr + ((pid_b * (dim // dpg_C) + (pid_d * BLOCK_D) // dpg_C) * dstate + n[:, None]) * seqlen
    else:
        dB_rows = dB_ptr + ((pid_b * n_dblocks + pid_d) * dstate + n[:, None]) * seqlen
        dC_rows = dC_ptr + ((pid_b * n_dblocks + pid_d) * dstate + n[:, None]) * seqlen
    if B_VAR:
        B_base = B_ptr + pid_b * s_Bb + ((pid_d * BLOCK_D) // dpg_B) * s_Bg
    else:
        B_const = _load_bc_const(B_ptr, d, n, mask_dn, s_Bg, s_Bn)
    if C_VAR:
        C_base = C_ptr + pid_b * s_Cb + ((pid_d * BLOCK_D) // dpg_C) * s_Cg
    else:
        C_const = _load_bc_const(C_ptr, d, n, mask_dn, s_Cg, s_Cn)
    # this program's parking space for the block-start states of one chunk
    scratch = scratch_ptr + (pid_b * n_dblocks + pid_d) * (CHUNK // BLOCK_T) * BLOCK_D * BLOCK_N
    tile = tl.arange(0, BLOCK_D)[:, None] * BLOCK_N + n[None, :]

    dA_acc = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    dB_acc = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    dC_acc = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    dD_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    dbias_acc = tl.zeros([BLOCK_D], dtype=tl.float32)

    for cc in range(0, n_chunks):
        c = n_chunks - 1 - cc
        c_start = c * CHUNK
        c_end = tl.minimum(seqlen, c_start + CHUNK)
        n_blocks = tl.cdiv(c_end - c_start, BLOCK_T)
        # chunk-start state: the previous chunk's saved state, or initial_state for chunk 0
        chunk = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.int32) + c
        h = tl.load(x_row[:, None] + (c - 1) * 2 * dstate + 2 * n[None, :] + 1, mask=mask_dn & (chunk > 0), other=0.0)
        if HAS_INIT:
            h += tl.load(init_ptr + pid_b * s_ib + d64[:, None] * s_id + n[None, :] * s_in,
                         mask=mask_dn & (chunk == 0), other=0.0)
        # replay the chunk forward, parking each block's start state
        for k in range(0, n_blocks):
            tl.store(scratch + k * BLOCK_D * BLOCK_N + tile, h)
            t = c_start + k * BLOCK_T + tt
            mask_t = t < c_end
            mask = mask_d[:, None] & mask_t[None, :]
            u = tl.load(u_row[:, None] + t[None, :] * s_ut, mask=mask, other=0.0).to(tl.float32)
            _, dt = _load_dt(delta_row, bias, t, mask, s_dt, HAS_BIAS, SOFTPLUS)
            decay = tl.exp2(dt[:, None, :] * A2[:, :, None])
            if B_VAR:
                Bt = _load_bc_var(B_base, n, t, mask_n, mask_t, s_Bn, s_Bt)
            else:
                Bt = B_const
            a_cum, b_cum = tl.associative_scan((decay, (dt * u)[:, None, :] * Bt), 2, _affine_combine)
            h = _last_along_time(a_cum * h[:, :, None] + b_cum, tt, BLOCK_T)
        tl.debug_barrier()  # the parked states are read back by other threads of this program
        # walk the chunk's blocks in reverse
        for kk in range(0, n_blocks):
            k = n_blocks - 1 - kk
            h0 = tl.load(scratch + k * BLOCK_D * BLOCK_N + tile)
            t = c_start + k * BLOCK_T + tt
            mask_t = t < c_end
            mask = mask_d[:, None] & mask_t[None, :]
            u = tl.load(u_row[:, None] + t[None, :] * s_ut, mask=mask, other=0.0).to(tl.float32)
            dt_raw, dt = _load_dt(delta_row, bias, t, mask, s_dt, HAS_BIAS, SOFTPLUS)
            decay = tl.exp2(dt[:, None, :] * A2[:, :, None])
            if B_VAR:
                Bt = _load_bc_var(B_base, n, t, mask_n, mask_t, s_Bn, s_Bt)
            else:
                Bt = B_const
            dtu = dt * u
            drive = dtu[:, None, :] * Bt
            a_cum, b_cum = tl.associative_scan((decay, drive), 2, _affine_combine)
            hs = a_cum * h0[:, :, None] + b_cum
            if C_VAR:
                Ct = _load_bc_var(C_base, n, t, mask_n, mask_t, s_Cn, s_Ct)
            else:
                Ct = C_const
            g_out = tl.load(dout_row[:, None] + t[None, :] * s_gt, mask=mask, other=0.0).to(tl.float32)
            if HAS_Z:
                zv = tl.load(z_row[:, None] + t[None, :] * s_zt, mask=mask, other=0.0).to(tl.float32)
                sig = tl.sigmoid(zv)
                y = tl.sum(hs * Ct, axis=1)
                if HAS_D:
                    y += Dv[:, None] * u
                dz = g_out * y * sig * (1.0 + zv * (1.0 - sig))
                tl.store(dz_ptr + grad_row[:, None] + t[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
                dy = g_out * zv * sig
            else:
                dy = g_out
            # g_t = C_t dy_t + decay_{t+1} g_{t+1}; the gradient from later blocks enters at the last step
            # (padding steps past the chunk have decay 1 and no C dy, so it reaches the last real step)
            mask_next = mask_d[:, None] & (t + 1 < c_end)[None, :]
            _, dt_next = _load_dt(delta_row, bias, t + 1, mask_next, s_dt, HAS_BIAS, SOFTPLUS)
            decay_next = tl.exp2(dt_next[:, None, :] * A2[:, :, None])
            rhs = Ct * dy[:, None, :] + tl.where((tt == BLOCK_T - 1)[None, None, :], carry[:, :, None], 0.0)
            _, g = tl.associative_scan((decay_next, rhs), 2, _affine_combine, reverse=True)
            carry = _first_along_time(decay * g, tt)
            q = g * (hs - drive)  # g_t * decay_t * h_{t-1}: the gradient through the decay
            dA_acc += tl.sum(q * dt[:, None, :], axis=2)
            d_dtu = tl.sum(g * Bt, axis=1)  # gradient of dt_t * u_t through the drive
            ddt = tl.sum(q * A[:, :, None], axis=1) + d_dtu * u
            du = d_dtu * dt
            if HAS_D:
                du += Dv[:, None] * dy
                dD_acc += tl.sum(dy * u, axis=1)
            if SOFTPLUS:
                ddt = ddt * tl.sigmoid(dt_raw)
            ddt = tl.where(mask, ddt, 0.0)
            dbias_acc += tl.sum(ddt, axis=1)
            tl.store(du_ptr + grad_row[:, None] + t[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)
            tl.store(ddelta_ptr + grad_row[:, None] + t[None, :], ddt.to(ddelta_ptr.dtype.element_ty), mask=mask)
            mask_nt = mask_n[:, None] & mask_t[None, :]
            if B_VAR:
                _add_or_store(dB_rows + t[None, :], tl.sum(g * dtu[:, None, :], axis=0), mask_nt, BC_ATOMIC)
            else:
                dB_acc += tl.sum(g * dtu[:, None, :], axis=2)
            if C_VAR:
                _add_or_store(dC_rows + t[None, :], tl.sum(hs * dy[:, None, :], axis=0), mask_nt, BC_ATOMIC)
            else:
                dC_acc += tl.sum(hs * dy[:, None, :], axis=2)
        tl.debug_barrier()  # the next chunk reuses the scratch tiles

    tl.store(dA_ptr + bd_dn, dA_acc, mask=mask_dn)
    if not B_VAR:
        tl.store(dB_ptr + bd_dn, dB_acc, mask=mask_dn)
    if not C_VAR:
        tl.store(dC_ptr + bd_dn, dC_acc, mask=mask_dn)
    if HAS_D:
        tl.store(dD_ptr + pid_b * dim + d64, dD_acc, mask=mask_d)
    if HAS_BIAS:
        tl.store(dbias_ptr + pid_b * dim + d64, dbias_acc, mask=mask_d)
    if HAS_INIT:
        tl.store(dinit_ptr + bd_dn, carry, mask=mask_dn)
