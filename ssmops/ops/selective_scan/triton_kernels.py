"""Triton kernels of the selective scan, forward and backward.

Forward: a program takes BLOCK_D channels of one batch row (a thread one channel) and walks the
sequence a tile of BLOCK_T steps at a time, each thread keeping its channel's states h[n] (STATES of
them: larger dstates are taken a tile of states at a time, the partial sums of y over the earlier
state tiles parked in a float32 buffer) and A[n] in registers. A tile is at most one 16-byte vector
load per row, so Triton's layout keeps its steps inside the thread: the recurrence
`h = exp2(dt_t A log2(e)) h + dt_t u_t B_t` runs a step at a time over the states at once, plain
arithmetic in registers with no lane shuffles, and `y_t = sum_n h[n] C_t[n]` is a sum inside the thread.
A variable B/C is read once per step for the whole block where the block lies in one group (its
(dstate,) row is the same for every channel), from a float32, time-major copy the launcher makes, so
that a thread loads a step's states in vectors and widens nothing. All arithmetic is float32 whatever
the input dtype. At the end of each 2048-step chunk, the state and the cumulative decay since t = 0
go to mamba_ssm's `x` (`scan_intermediates`): `x[c][2n + 1]` and `x[c][2n]`; the last chunk's state
is `last_state`.

The backward's layout is mamba_ssm's CUDA kernels': a program owns one channel of one batch row and
walks the sequence one 2048-step chunk at a time; a chunk is one tile of `BLOCK_T` time steps spread
over the program's threads, each thread holding a few consecutive steps. The states are taken one
at a time (`for n in range(dstate)`): for state n the recurrence `h_t = decay_t * h_{t-1} + drive_t`
over the chunk is a first-order linear recurrence, so it is an inclusive `tl.associative_scan`
along time of the affine maps `(decay_t, drive_t)` (combine: `(a1, b1), (a2, b2) -> (a1 a2, a2 b1 +
b2)`), with the chunk-start state entering through the first step's drive (`_states`). With time
inside the threads the scan is mostly sequential arithmetic in registers (few lane shuffles). u,
delta, z and dout are read once per chunk, coalesced; B and C once per state.

Backward: chunks are walked last to first, and each starts from its saved start state (the
previous chunk's `x`, or initial_state), so nothing is replayed. Per state, the forward scan
is recomputed, then the adjoint recurrence `g_t = C_t dy_t + decay_{t+1} g_{t+1}` is a
reverse `tl.associative_scan` (decay_{t+1} is gathered from decay one step on); `g_t *
decay_t * h_{t-1}` takes h_{t-1} gathered from the states one step back (not `h_t -
drive_t`, which cancels to noise where the decay is tiny). The gradient that leaves a chunk
through its start state, `decay_{t0} g_{t0}`, is parked per state in `carry` (batch, dim, 2,
dstate: a chunk reads one half and writes the other, so no thread overwrites a value another
has yet to read) and enters the previous chunk at its last step; after chunk 0 it is d
initial_state. Reductions over time (dA, dD, d delta_bias, constant dB/dC) are per-program
float32 partials that the caller sums with torch. Variable dB/dC vary with time and are
summed over the channels of a B/C group: by default a program adds its channel's
contribution atomically into a float32 buffer shaped like B/C (as mamba_ssm does); under
`torch.use_deterministic_algorithms(True)` a program instead walks `CHANNELS` channels of
one group in turn, adds their contributions in order into its own (dstate, seqlen) rows of a
partial buffer, and the caller sums the rows in a fixed order.
"""

import triton
import triton.language as tl

from .._triton import LOG2E, softplus



@triton.jit
def _affine_combine(a1, b1, a2, b2):
    # composition of h -> a1 h + b1 followed by h -> a2 h + b2
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _states(decay, drive, h0, tt):
    """h_t = decay_t h_{t-1} + drive_t over the tile from h_{-1} = h0: the scan of the affine
    maps, with h0 entering through the first step's drive (as the recurrence has it, so that an
    infinite decay meets h0 = 0 only where the recurrence itself multiplies them)."""
    _, h = tl.associative_scan((decay, tl.where(tt == 0, decay * h0 + drive, drive)), 0, _affine_combine)
    return h


@triton.jit
def _load_dt(delta_row, bias, t, mask, s_dt, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """(dt_raw, dt) as float32 (BLOCK_T,); dt is 0 where masked, so decay = 1 and drive = 0 there."""
    return _dt(tl.load(delta_row + t * s_dt, mask=mask, other=0.0), bias, mask, HAS_BIAS, SOFTPLUS)


@triton.jit
def _dt(delta, bias, mask, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """(dt_raw, dt) as float32 from loaded delta; dt is 0 where masked."""
    dt_raw = delta.to(tl.float32)
    if HAS_BIAS:
        dt_raw = dt_raw + bias
    dt = dt_raw
    if SOFTPLUS:
        dt = softplus(dt_raw)
    dt = tl.where(mask, dt, 0.0)
    return dt_raw, dt


@triton.jit
def _load_bc(base, n, t, mask, s_n, s_t, VAR: tl.constexpr):
    """State n of B or C: a float32 (BLOCK_T,) row if it varies with time, else a scalar."""
    if VAR:
        value = tl.load(base + n * s_n + t * s_t, mask=mask, other=0.0)
    else:
        value = tl.load(base + n * s_n)
    return value.to(tl.float32)


@triton.jit
def _bc_base(ptr, pid_b, d64, dpg, s_b, s_g, VAR: tl.constexpr):
    """Where B or C starts for this (batch, channel): its group's (dstate, seqlen) block if
    it varies with time, else the channel's (dstate,) row."""
    if VAR:
        return ptr + pid_b * s_b + (d64 // dpg) * s_g
    return ptr + d64 * s_g


@triton.jit
def _store_at(ptr, x, tt, position):
    """*ptr = x[position] of a (BLOCK_T,) tile: stored by the thread that holds it (no reduction)."""
    tl.store(ptr + tt * 0, x, mask=tt == position)


@triton.jit
def _start_state(x_prev, init_row, c, n, s_in, HAS_INIT: tl.constexpr):
    """State n at the start of chunk c: the previous chunk's saved state, or initial_state."""
    h = tl.load(x_prev + 2 * n + 1, mask=c > 0, other=0.0)
    if HAS_INIT:
        h += tl.load(init_row + n * s_in, mask=c == 0, other=0.0)
    return h


@triton.jit
def _channel(pid_b, d64, u_ptr, delta_ptr, z_ptr, A_ptr, init_ptr, B_ptr, C_ptr, bias_ptr, D_ptr,
             dpg_B, dpg_C, s_ub, s_ud, s_db, s_dd, s_zb, s_zd, s_Ad, s_ib, s_id,
             s_Bb, s_Bg, s_Cb, s_Cg,
             HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr):
    """Where a (batch, channel)'s rows of u, delta, z, A and initial_state start, and of B and C; and
    its delta_bias and D (0 when absent). Only inputs: torch's analysis of which arguments a kernel
    writes follows a stored-to address back through the whole call that made it, so a pointer that
    is written through (x, scan_intermediates) is never returned from here."""
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d64)
    Dv = 0.0
    if HAS_D:
        Dv = tl.load(D_ptr + d64)
    return (u_ptr + pid_b * s_ub + d64 * s_ud, delta_ptr + pid_b * s_db + d64 * s_dd,
            z_ptr + pid_b * s_zb + d64 * s_zd, A_ptr + d64 * s_Ad, init_ptr + pid_b * s_ib + d64 * s_id,
            _bc_base(B_ptr, pid_b, d64, dpg_B, s_Bb, s_Bg, B_VAR),
            _bc_base(C_ptr, pid_b, d64, dpg_C, s_Cb, s_Cg, C_VAR), bias, Dv)


@triton.jit
def _column(x, cols, j: tl.constexpr):
    """x[:, j] of a tile whose columns each thread holds in full: with j a constant the select is a
    choice of register (-0.0, the sum's identity, adds nothing), so it costs no instruction."""
    return tl.sum(tl.where(cols[None, :] == j, x, -0.0), axis=1)


@triton.jit
def _with_column(x, cols, j: tl.constexpr, value):
    """x with its column j replaced by value (a register choice, like _column)."""
    return tl.where(cols[None, :] == j, value[:, None], x)


@triton.jit
def _bc_rows(ptr, pid_b, dd, d_first, dpg, s_b, s_g, VAR: tl.constexpr, SHARED: tl.constexpr):
    """Where B or C starts for the block's channels: if it varies with time and the block lies in one
    group (SHARED), that group's (seqlen, dstate) rows, one address for all; if it varies, each
    channel's group's rows; else each channel's (dstate,) row."""
    if VAR:
        if SHARED:
            rows = ptr + pid_b * s_b + (d_first // dpg) * s_g
        else:
            rows = ptr + pid_b * s_b + (dd // dpg) * s_g
    else:
        rows = ptr + dd * s_g
    return rows


@triton.jit
def _bc_step(rows, n, t, s_n, s_t, SHARED: tl.constexpr):
    """A variable B or C at step t for the tile's states n, float32, from the launcher's copy padded
    with zeros past seqlen and dstate (no masks): (1, STATES) if the block shares it (a thread loads
    each step once for all its channels), else (BLOCK_D, STATES)."""
    if SHARED:
        value = tl.load(rows + t * s_t + n * s_n)[None, :]
    else:
        value = tl.load(rows[:, None] + t * s_t + n[None, :] * s_n)
    return value


@triton.jit
def selective_scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr,
    out_ptr, out_z_ptr, x_ptr, last_ptr, y_ptr,
    dim, seqlen, dstate, n_chunks, dpg_B, dpg_C,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt,
    s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Bt, s_Cb, s_Cg, s_Cn, s_Ct,
    s_ib, s_id, s_in,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    SOFTPLUS: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr, B_SHARED: tl.constexpr,
    C_SHARED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, STATES: tl.constexpr,
    STATE_TILES: tl.constexpr, PADDED_STATES: tl.constexpr, CHUNK: tl.constexpr,
):
    """A program takes BLOCK_D channels of one batch row, a thread one channel (see the module's
    docstring). B and C are float32, a variable one laid out (batch, [groups,] seqlen, dstate).
    Outputs, 1-D and contiguous: out and out_z (batch, dim, seqlen); x (batch, dim, n_chunks, dstate,
    2); last (batch, dim, dstate); y (batch, dim, seqlen) float32, the partial sums over the states
    of the earlier state tiles (only when STATE_TILES > 1)."""
    pid_b = tl.program_id(1).to(tl.int64)
    d_first = tl.program_id(0).to(tl.int64) * BLOCK_D
    dd = d_first + tl.arange(0, BLOCK_D)
    mask_d = dd < dim
    tt = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, STATES)
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + dd, mask=mask_d, other=0.0)
    Dv = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + dd, mask=mask_d, other=0.0)
    u_rows = u_ptr + pid_b * s_ub + dd * s_ud
    delta_rows = delta_ptr + pid_b * s_db + dd * s_dd
    z_rows = z_ptr + pid_b * s_zb + dd * s_zd
    # (a channel past dim reads the last one's group: B/C's loads have no masks, and its group could be past
    # the buffer's end; what it computes is never stored)
    d_real = tl.minimum(dd, dim - 1)
    B_rows = _bc_rows(B_ptr, pid_b, d_real, d_first, dpg_B, s_Bb, s_Bg, B_VAR, B_SHARED)
    C_rows = _bc_rows(C_ptr, pid_b, d_real, d_first, dpg_C, s_Cb, s_Cg, C_VAR, C_SHARED)
    row = pid_b * dim + dd  # of the (batch, dim, ...) outputs

    for s in range(0, STATE_TILES):
        n = s * STATES + cols
        mask_dn = mask_d[:, None] & (n < dstate)[None, :]
        # a thread keeps its channel's states of the tile, and A * log2(e) (decay = exp2(dt * A * log2(e)))
        A2 = tl.load(A_ptr + dd[:, None] * s_Ad + n[None, :] * s_An, mask=mask_dn, other=0.0) * LOG2E
        h = tl.zeros([BLOCK_D, STATES], dtype=tl.float32)
        if HAS_INIT:
            h = tl.load(init_ptr + pid_b * s_ib + dd[:, None] * s_id + n[None, :] * s_in, mask=mask_dn, other=0.0)
        B_const = h  # (a constant B or C, loaded here for the whole walk; a variable one, at each step)
        if not B_VAR:
            B_const = tl.load(B_rows[:, None] + n[None, :] * s_Bn, mask=mask_dn, other=0.0)
        C_const = h
        if not C_VAR:
            C_const = tl.load(C_rows[:, None] + n[None, :] * s_Cn, mask=mask_dn, other=0.0)
        dt_total = tl.zeros([BLOCK_D], dtype=tl.float32)
        last_tile = s == STATE_TILES - 1
        # u, delta and z of a tile are loaded while the tile before it is computed (bytes in flight)
        mask = mask_d[:, None] & (tt < seqlen)[None, :]
        u_next = tl.load(u_rows[:, None] + tt[None, :] * s_ut, mask=mask, other=0.0)
        delta_next = tl.load(delta_rows[:, None] + tt[None, :] * s_dt, mask=mask, other=0.0)
        z_next = u_next
        if HAS_Z:
            z_next = tl.load(z_rows[:, None] + tt[None, :] * s_zt, mask=mask & last_tile, other=0.0)
        for c in range(0, n_chunks):
            for t0 in range(c * CHUNK, tl.minimum(seqlen, (c + 1) * CHUNK), BLOCK_T):
                t = t0 + tt
                mask = mask_d[:, None] & (t < seqlen)[None, :]
                u = u_next.to(tl.float32)
                _, dt = _dt(delta_next, bias[:, None], mask, HAS_BIAS, SOFTPLUS)
                gate = z_next.to(tl.float32)
                if HAS_Z:
                    gate = gate * tl.sigmoid(gate)
                t_next = t + BLOCK_T
                mask_next = mask_d[:, None] & (t_next < seqlen)[None, :]
                u_next = tl.load(u_rows[:, None] + t_next[None, :] * s_ut, mask=mask_next, other=0.0)
                delta_next = tl.load(delta_rows[:, None] + t_next[None, :] * s_dt, mask=mask_next, other=0.0)
                if HAS_Z:
                    z_next = tl.load(z_rows[:, None] + t_next[None, :] * s_zt, mask=mask_next & last_tile, other=0.0)
                dtu = dt * u
                dt_total += tl.sum(dt, axis=1)
                y_at = row[:, None] * seqlen + t[None, :]
                y = tl.zeros([BLOCK_D, BLOCK_T], dtype=tl.float32)
                if STATE_TILES > 1:
                    y = tl.load(y_ptr + y_at, mask=mask & (s > 0), other=0.0)
                # the recurrence, a step at a time, over the tile's states at once (past seqlen decay is 1
                # and drive 0, and B, C are 0: the last state is the sequence's)
                for k in tl.static_range(BLOCK_T):
                    B_t = B_const
                    if B_VAR:
                        B_t = _bc_step(B_rows, n, t0 + k, s_Bn, s_Bt, B_SHARED)
                    C_t = C_const
                    if C_VAR:
                        C_t = _bc_step(C_rows, n, t0 + k, s_Cn, s_Ct, C_SHARED)
                    h = tl.exp2(_column(dt, tt, k)[:, None] * A2) * h + _column(dtu, tt, k)[:, None] * B_t
                    if PADDED_STATES:  # a padding state stays 0 (an infinite dt or u would make it NaN)
                        h = tl.where(mask_dn, h, 0.0)
                    y = _with_column(y, tt, k, _column(y, tt, k) + tl.sum(h * C_t, axis=1))
                if STATE_TILES > 1:
                    tl.store(y_ptr + y_at, y, mask=mask & (s < STATE_TILES - 1))
                y += Dv[:, None] * u
                tl.store(out_ptr + y_at, y.to(out_ptr.dtype.element_ty), mask=mask & last_tile)
                if HAS_Z:
                    tl.store(out_z_ptr + y_at, (y * gate).to(out_z_ptr.dtype.element_ty), mask=mask & last_tile)
            # mamba_ssm's x: per state, the decay since t = 0 and the chunk's last state
            x_at = (row[:, None] * n_chunks + c) * 2 * dstate + 2 * n[None, :]
            tl.store(x_ptr + x_at, tl.exp2(dt_total[:, None] * A2), mask=mask_dn)
            tl.store(x_ptr + x_at + 1, h, mask=mask_dn)
        tl.store(last_ptr + row[:, None] * dstate + n[None, :], h, mask=mask_dn)


@triton.jit
def _load_dout(dout_row, z_row, t, mask, s_gt, s_zt, HAS_Z: tl.constexpr):
    """(dout, z, sigmoid(z), dy), float32 (BLOCK_T,); dy is the gradient of y, the output
    before the silu(z) gate (without z: dout, and z, sigmoid(z) are placeholders)."""
    g_out = tl.load(dout_row + t * s_gt, mask=mask, other=0.0).to(tl.float32)
    zv, sig, dy = g_out, g_out, g_out
    if HAS_Z:
        zv = tl.load(z_row + t * s_zt, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(zv)
        dy = g_out * zv * sig
    return g_out, zv, sig, dy


@triton.jit
def _add_or_store(ptrs, value, mask, ATOMIC: tl.constexpr):
    """Atomically adds value, or adds it to what this program stored there (its own rows)."""
    if ATOMIC:
        tl.atomic_add(ptrs, value, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + value, mask=mask)


@triton.jit
def _accumulate(ptr, value):
    """*ptr += value for a scalar of this program's own: the store is made by one thread, from
    its own read, so it needs no atomics (a barrier orders it before the next chunk's read)."""
    tl.store(ptr, tl.load(ptr) + value)


@triton.jit
def selective_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr, dout_ptr, x_ptr,
    dlast_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr, carry_ptr,
    dim, seqlen, dstate, n_chunks, dpg_B, dpg_C,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt, s_gb, s_gd, s_gt,
    s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Bt, s_Cb, s_Cg, s_Cn, s_Ct,
    s_ib, s_id, s_in, s_xb, s_xd, s_lb, s_ld, s_ln,
    s_ob, s_od,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_DLAST: tl.constexpr, SOFTPLUS: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr,
    BC_ATOMIC: tl.constexpr, CHANNELS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """A program takes channels pid_d * CHANNELS ... (CHANNELS = 1 when BC_ATOMIC).
    Outputs: du, ddelta, dz like u (contiguous, strides s_ob, s_od, 1); carry (batch, dim, 2,
    dstate), with d initial_state in half `n_chunks % 2` at the end; float32 partials, zeroed
    by the caller: dA (batch, dim, dstate), dD and dbias (batch, dim), constant dB/dC (batch,
    dim, dstate), variable dB/dC (batch, groups, dstate, seqlen) if BC_ATOMIC, else
    (batch, programs, dstate, seqlen)."""
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    tt = tl.arange(0, BLOCK_T)
    nn = tl.arange(0, BLOCK_N)
    mask_n = nn < dstate
    # this program's (dstate, seqlen) rows of variable dB / dC: its group's, or its own
    d_first = pid_d * CHANNELS
    if BC_ATOMIC:
        dB_rows = dB_ptr + (pid_b * (dim // dpg_B) + d_first // dpg_B) * dstate * seqlen
        dC_rows = dC_ptr + (pid_b * (dim // dpg_C) + d_first // dpg_C) * dstate * seqlen
    else:
        dB_rows = dB_ptr + (pid_b * tl.num_programs(0) + pid_d) * dstate * seqlen
        dC_rows = dC_ptr + (pid_b * tl.num_programs(0) + pid_d) * dstate * seqlen

    for ch in range(0, CHANNELS):
        d64 = (d_first + ch).to(tl.int64)
        if d64 < dim:
            u_row, delta_row, z_row, A_row, init_row, B_base, C_base, bias, Dv = _channel(
                pid_b, d64, u_ptr, delta_ptr, z_ptr, A_ptr, init_ptr, B_ptr, C_ptr, bias_ptr, D_ptr,
                dpg_B, dpg_C, s_ub, s_ud, s_db, s_dd, s_zb, s_zd, s_Ad, s_ib, s_id, s_Bb, s_Bg, s_Cb, s_Cg,
                HAS_BIAS, HAS_D, B_VAR, C_VAR)
            x_row = x_ptr + pid_b * s_xb + d64 * s_xd
            dout_row = dout_ptr + pid_b * s_gb + d64 * s_gd
            grad_row = pid_b * s_ob + d64 * s_od  # du, ddelta, dz
            bd = pid_b * dim + d64  # row of the (batch, dim, ...) partials
            carry_row = carry_ptr + bd * 2 * dstate
            if HAS_DLAST:
                carry0 = tl.load(dlast_ptr + pid_b * s_lb + d64 * s_ld + nn * s_ln, mask=mask_n, other=0.0)
            else:
                carry0 = tl.zeros([BLOCK_N], dtype=tl.float32)
            tl.store(carry_row + nn, carry0, mask=mask_n)
            dD_acc = 0.0
            dbias_acc = 0.0

            for cc in range(0, n_chunks):
                c = n_chunks - 1 - cc
                t = c * CHUNK + tt
                c_end = tl.minimum(seqlen, (c + 1) * CHUNK)
                mask = t < c_end
                # (u, delta, dout and z are read again after the loop over states rather than kept:
                # the registers are the backward's limit)
                u = tl.load(u_row + t * s_ut, mask=mask, other=0.0).to(tl.float32)
                _, dt = _load_dt(delta_row, bias, t, mask, s_dt, HAS_BIAS, SOFTPLUS)
                # decay_{t+1} is decay one element on (a gather, cheaper than a second exp2), and 1
                # from the chunk's last step on: the carry from the next chunk enters at the last
                # step, and padding steps (decay 1, no C dy) pass it down to the last real one
                has_next = t + 1 < c_end
                next_step = tl.minimum(tt + 1, BLOCK_T - 1)
                prev_step = tl.maximum(tt - 1, 0)
                dtu = dt * u
                _, _, _, dy = _load_dout(dout_row, z_row, t, mask, s_gt, s_zt, HAS_Z)
                y = Dv * u
                d_dtu = tl.zeros([BLOCK_T], dtype=tl.float32)  # gradient of dt_t * u_t through the drives
                d_dt_decay = tl.zeros([BLOCK_T], dtype=tl.float32)  # gradient of dt_t through the decays
                x_prev = x_row + (c - 1) * 2 * dstate
                carry_in = carry_row + (cc % 2) * dstate
                carry_out = carry_row + ((cc + 1) % 2) * dstate
                tl.debug_barrier()  # carry was written by other threads
                for n in range(0, dstate):
                    A = tl.load(A_row + n * s_An)
                    h0 = _start_state(x_prev, init_row, c, n, s_in, HAS_INIT)
                    decay = tl.exp2(dt * (A * LOG2E))
                    Bn = _load_bc(B_base, n, t, mask, s_Bn, s_Bt, B_VAR)
                    Cn = _load_bc(C_base, n, t, mask, s_Cn, s_Ct, C_VAR)
                    drive = dtu * Bn
                    hs = _states(decay, drive, h0, tt)
                    y += hs * Cn
                    # g_t = C_t dy_t + decay_{t+1} g_{t+1}: a reverse scan, which the later chunks'
                    # gradient enters at the last step
                    decay_next = tl.where(has_next, tl.gather(decay, next_step, 0), 1.0)
                    rhs = Cn * dy + tl.where(tt == BLOCK_T - 1, tl.load(carry_in + n), 0.0)
                    _, g = tl.associative_scan((decay_next, rhs), 0, _affine_combine, reverse=True)
                    _store_at(carry_out + n, decay * g, tt, 0)
                    # g_t * decay_t * h_{t-1}, the gradient through the decay, with h_{t-1} gathered from
                    # one step back (h_t - drive_t would cancel to noise where decay_t is tiny), in
                    # autograd's order so that non-finite values come out where the reference's do
                    h_prev = tl.where(tt == 0, h0, tl.gather(hs, prev_step, 0))
                    q = (g * h_prev) * decay
                    _accumulate(dA_ptr + bd * dstate + n, tl.sum(q * dt, axis=0))
                    d_dt_decay += q * A
                    d_dtu += g * Bn
                    if B_VAR:
                        _add_or_store(dB_rows + n * seqlen + t, g * dtu, mask, BC_ATOMIC)
                    else:
                        _accumulate(dB_ptr + bd * dstate + n, tl.sum(g * dtu, axis=0))
                    if C_VAR:
                        _add_or_store(dC_rows + n * seqlen + t, hs * dy, mask, BC_ATOMIC)
                    else:
                        _accumulate(dC_ptr + bd * dstate + n, tl.sum(hs * dy, axis=0))
                u = tl.load(u_row + t * s_ut, mask=mask, other=0.0).to(tl.float32)
                dt_raw, _ = _load_dt(delta_row, bias, t, mask, s_dt, HAS_BIAS, SOFTPLUS)
                if HAS_Z:
                    g_out, zv, sig, _ = _load_dout(dout_row, z_row, t, mask, s_gt, s_zt, HAS_Z)
                    dz = g_out * y * sig * (1.0 + zv * (1.0 - sig))
                    tl.store(dz_ptr + grad_row + t, dz.to(dz_ptr.dtype.element_ty), mask=mask)
                du = d_dtu * dt
                if HAS_D:
                    du += Dv * dy
                    dD_acc += tl.sum(dy * u, axis=0)
                ddt = d_dt_decay + d_dtu * u
                if SOFTPLUS:
                    ddt = ddt * tl.sigmoid(dt_raw)
                ddt = tl.where(mask, ddt, 0.0)
                dbias_acc += tl.sum(ddt, axis=0)
                tl.store(du_ptr + grad_row + t, du.to(du_ptr.dtype.element_ty), mask=mask)
                tl.store(ddelta_ptr + grad_row + t, ddt.to(ddelta_ptr.dtype.element_ty), mask=mask)

            if HAS_D:
                tl.store(dD_ptr + bd, dD_acc)
            if HAS_BIAS:
                tl.store(dbias_ptr + bd, dbias_acc)
