"""Triton kernels of the selective scan, forward and backward.

Both give a program BLOCK_D channels of one batch row, a thread one channel, and walk the sequence a
tile of BLOCK_T steps at a time, each thread keeping its channel's states h[n] (STATES of them: larger
dstates are taken a tile of states at a time, a pass over the sequence each, the sums over the states
of the earlier state tiles parked in float32 buffers) and A[n] in registers. A tile is at most one
16-byte vector load per row, so Triton's layout keeps its steps inside the thread: the recurrence
`h = exp2(dt_t A log2(e)) h + dt_t u_t B_t` runs a step at a time over the states at once, plain
arithmetic in registers with no lane shuffles, and sums over the states (`y_t = sum_n h[n] C_t[n]`)
are sums inside the thread. A variable B/C is read once per step for the whole block where the block
lies in one group (its (dstate,) row is the same for every channel), from a float32, time-major copy
the launcher makes, so that a thread loads a step's states in vectors and widens nothing. All
arithmetic is float32 whatever the input dtype.

Forward: at the end of each 2048-step chunk, the state and the cumulative decay since t = 0 go to
mamba_ssm's `x` (`scan_intermediates`): `x[c][2n + 1]` and `x[c][2n]`; the last chunk's state is
`last_state`.

Backward: the adjoint `g_t = dL/dh_t = C_t dy_t + decay_{t+1} g_{t+1}` runs from the last step to the
first, and each step needs the state before it, h_{t-1}, which a thread can only compute forwards. So
the walk is checkpointed: a first walk forwards over the whole sequence parks the state at the start of
every segment of SEGMENT read tiles (BLOCK_T steps, 8-byte rows) in a float32 scratch (batch, segments,
STATES, dim); then, a read tile at a time from the last, a thread reloads its segment's checkpoint,
walks forwards to the tile (SEGMENT - 1 tiles at most), reads the tile's inputs, and takes its register
tiles of SUB_T steps last first: each is reached from the read tile's start by walking the ones before
it, recomputed keeping each step's state and decay in registers, and the adjoint runs back over it. Per
step, with q = g_t h_{t-1} decay_t (in autograd's order, so that non-finite values come out where the
reference's do): dA += q dt, ddt += sum_n q A, d(dt u) += sum_n g B, dB_t = g dt u, dC_t = h_t dy; the
gradient leaving step t is decay_t g_t, and after step 0 it is d initial_state. Sums over time per
channel (dA, dD, d delta_bias, a constant dB/dC) stay in registers and go out once, per (batch,
channel), for torch to sum over the batch. A variable dB/dC is summed over the channels of its group: a
step's (channels, states) contributions are summed over REDUCE consecutive channels inside the program
(up to a warp's 32 by a halving exchange of lane shuffles that leaves each state's sum in one channel, so
that a warp's sums leave in one store), then added atomically into a float32, time-major (batch, groups,
seqlen, dstate) buffer, as mamba_ssm does, or stored in a row of their own (a warp's or the program's
channels of a group), which torch sums over the group's rows in a fixed order (always under
`torch.use_deterministic_algorithms(True)`).
"""

import triton
import triton.language as tl

from .._triton import LN2, LOG2E, sigmoid, softplus


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
def _channel_inputs(u_ptr, delta_ptr, z_ptr, bias_ptr, D_ptr, B_ptr, C_ptr, pid_b, dd, d_first, mask_d, dim,
                    s_ub, s_ud, s_db, s_dd, s_zb, s_zd, dpg_B, dpg_C, s_Bb, s_Bg, s_Cb, s_Cg,
                    HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, B_VAR: tl.constexpr, B_SHARED: tl.constexpr,
                    C_VAR: tl.constexpr, C_SHARED: tl.constexpr, BLOCK_D: tl.constexpr):
    """What both passes read first for the block's channels dd: delta's bias and D (0 where absent), and where
    u's, delta's, z's, B's and C's rows start. A channel past dim reads the last one's group (B/C's loads have
    no masks, and its group could be past the buffer's end); what it computes is never stored, and its
    gradients are 0 (into dB/dC, as zeros). Input addresses only: an output's index computed in a helper that
    takes the inputs makes torch's analysis find every input written (docs/design.md)."""
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + dd, mask=mask_d, other=0.0)
    Dv = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + dd, mask=mask_d, other=0.0)
    d_real = tl.minimum(dd, dim - 1)
    return (bias, Dv, u_ptr + pid_b * s_ub + dd * s_ud, delta_ptr + pid_b * s_db + dd * s_dd,
            z_ptr + pid_b * s_zb + dd * s_zd,
            _bc_rows(B_ptr, pid_b, d_real, d_first, dpg_B, s_Bb, s_Bg, B_VAR, B_SHARED),
            _bc_rows(C_ptr, pid_b, d_real, d_first, dpg_C, s_Cb, s_Cg, C_VAR, C_SHARED))


@triton.jit
def _state_tile_inputs(A_ptr, init_ptr, B_rows, C_rows, pid_b, dd, n, mask_dn, s_Ad, s_An, s_ib, s_id, s_in, s_Bn,
                       s_Cn, HAS_INIT: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr,
                       BLOCK_D: tl.constexpr, STATES: tl.constexpr):
    """What a walk over a tile of states n starts from, a thread its channel's: A * log2(e) (decay =
    exp2(dt * A * log2(e))), the initial states (0 without), and a constant B and C (loaded once for the whole
    walk; a variable one is read at each step, and these are then placeholders)."""
    A2 = tl.load(A_ptr + dd[:, None] * s_Ad + n[None, :] * s_An, mask=mask_dn, other=0.0) * LOG2E
    h = tl.zeros([BLOCK_D, STATES], dtype=tl.float32)
    if HAS_INIT:
        h = tl.load(init_ptr + pid_b * s_ib + dd[:, None] * s_id + n[None, :] * s_in, mask=mask_dn, other=0.0)
    B_const = h
    if not B_VAR:
        B_const = tl.load(B_rows[:, None] + n[None, :] * s_Bn, mask=mask_dn, other=0.0)
    C_const = h
    if not C_VAR:
        C_const = tl.load(C_rows[:, None] + n[None, :] * s_Cn, mask=mask_dn, other=0.0)
    return A2, h, B_const, C_const


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
def _bc_ahead(rows, n, t, s_n, s_t, VAR: tl.constexpr, SHARED: tl.constexpr, ON: tl.constexpr,
              BLOCK_D: tl.constexpr, STATES: tl.constexpr):
    """A variable B's or C's row at step t, loaded ahead of its step (ON), or zeros of its shape."""
    if VAR and ON:
        value = _bc_step(rows, n, t, s_n, s_t, SHARED)
    elif SHARED:
        value = tl.zeros([1, STATES], dtype=tl.float32)
    else:
        value = tl.zeros([BLOCK_D, STATES], dtype=tl.float32)
    return value


@triton.jit
def _bc_next(ahead_1, ahead_2, const, rows, n, t, s_n, s_t, VAR: tl.constexpr, SHARED: tl.constexpr,
             PREFETCH: tl.constexpr):
    """B's or C's row at step t, and the rows loaded ahead after it: a variable one is loaded PREFETCH (0-2)
    steps before its step, so that its load's latency (an L2 hit: every program of a batch row reads the
    same rows) passes while the steps between are computed rather than at every step (the forward of a thread
    per channel ran at 8% of an H200's copy rate with the loads at their steps, its loop's loads 2-130
    instructions before their use)."""
    value = const
    if VAR:
        if PREFETCH == 0:
            value = _bc_step(rows, n, t, s_n, s_t, SHARED)
        elif PREFETCH == 1:
            value = ahead_1
            ahead_1 = _bc_step(rows, n, t + 1, s_n, s_t, SHARED)
        else:
            value = ahead_1
            ahead_1 = ahead_2
            ahead_2 = _bc_step(rows, n, t + 2, s_n, s_t, SHARED)
    return value, ahead_1, ahead_2


@triton.jit
def selective_scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr,
    out_ptr, out_z_ptr, x_ptr, last_ptr, y_ptr, seg_h_ptr, seg_dt_ptr,
    dim, seqlen, dstate, n_chunks, dpg_B, dpg_C, seg_len, n_segments,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt,
    s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Bt, s_Cb, s_Cg, s_Cn, s_Ct,
    s_ib, s_id, s_in,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    SOFTPLUS: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr, B_SHARED: tl.constexpr,
    C_SHARED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, STATES: tl.constexpr,
    STATE_TILES: tl.constexpr, PADDED_STATES: tl.constexpr, CHUNK: tl.constexpr, SEGMENT_PASS: tl.constexpr,
    PREFETCH: tl.constexpr, STAGES: tl.constexpr,
):
    """A program takes BLOCK_D channels of one batch row, a thread one channel (see the module's
    docstring). B and C are float32, a variable one laid out (batch, [groups,] seqlen, dstate), padded with
    PREFETCH steps more than whole tiles (the loads ahead past the last step).
    Outputs, 1-D and contiguous: out and out_z (batch, dim, seqlen); x (batch, dim, n_chunks, dstate,
    2); last (batch, dim, dstate); y (batch, dim, seqlen) float32, the partial sums over the states
    of the earlier state tiles (only when STATE_TILES > 1).

    SEGMENT_PASS 0: the program walks the whole sequence. Else the sequence is cut into segments of seg_len
    steps (a multiple of BLOCK_T dividing CHUNK), a program each (program_id(2)), so that more warps share
    the latency of the walk: pass 1 walks its segment from zero states and stores only where they end and
    the segment's sum of dt (seg_h (batch, dim, n_segments, dstate) and seg_dt (batch, dim, n_segments),
    float32; launched without z); pass 2 starts its segment from the states the earlier segments carry to it
    (the initial states decayed by their dt sums, plus their own), and writes what pass 0 writes for its steps."""
    pid_b = tl.program_id(1).to(tl.int64)
    d_first = tl.program_id(0).to(tl.int64) * BLOCK_D
    pid_s = tl.program_id(2)
    t_begin = pid_s * seg_len
    t_end = tl.minimum(seqlen, t_begin + seg_len)
    if SEGMENT_PASS == 0:
        c_first = 0
        c_last = n_chunks
    else:
        c_first = t_begin // CHUNK
        c_last = c_first + 1
    dd = d_first + tl.arange(0, BLOCK_D)
    mask_d = dd < dim
    tt = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, STATES)
    bias, Dv, u_rows, delta_rows, z_rows, B_rows, C_rows = _channel_inputs(
        u_ptr, delta_ptr, z_ptr, bias_ptr, D_ptr, B_ptr, C_ptr, pid_b, dd, d_first, mask_d, dim,
        s_ub, s_ud, s_db, s_dd, s_zb, s_zd, dpg_B, dpg_C, s_Bb, s_Bg, s_Cb, s_Cg,
        HAS_BIAS, HAS_D, B_VAR, B_SHARED, C_VAR, C_SHARED, BLOCK_D)
    row = pid_b * dim + dd  # of the (batch, dim, ...) outputs

    for s in range(0, STATE_TILES):
        n = s * STATES + cols
        mask_dn = mask_d[:, None] & (n < dstate)[None, :]
        # (n and its mask are computed here: an output's index must not come from a helper that takes the inputs)
        A2, h, B_const, C_const = _state_tile_inputs(A_ptr, init_ptr, B_rows, C_rows, pid_b, dd, n, mask_dn, s_Ad,
                                                     s_An, s_ib, s_id, s_in, s_Bn, s_Cn, HAS_INIT, B_VAR, C_VAR,
                                                     BLOCK_D, STATES)
        dt_total = tl.zeros([BLOCK_D], dtype=tl.float32)
        if SEGMENT_PASS == 1:
            h = tl.zeros([BLOCK_D, STATES], dtype=tl.float32)
        if SEGMENT_PASS == 2:  # the states at the segment's start, and the dt summed since t = 0
            # (each earlier segment's end loaded while the one before it is added: one latency, not one a segment)
            seg_rows = row * n_segments
            dt_next = tl.load(seg_dt_ptr + seg_rows, mask=mask_d & (dd * 0 < pid_s), other=0.0)
            h_next = tl.load(seg_h_ptr + seg_rows[:, None] * dstate + n[None, :],
                             mask=mask_dn & (dd * 0 < pid_s)[:, None], other=0.0)
            for j in range(0, pid_s):
                dt_seg, h_seg = dt_next, h_next
                more = (dd * 0 + j + 1) < pid_s
                dt_next = tl.load(seg_dt_ptr + seg_rows + j + 1, mask=mask_d & more, other=0.0)
                h_next = tl.load(seg_h_ptr + (seg_rows[:, None] + j + 1) * dstate + n[None, :],
                                 mask=mask_dn & more[:, None], other=0.0)
                h = tl.exp2(dt_seg[:, None] * A2) * h + h_seg
                dt_total += dt_seg
            if PADDED_STATES:
                h = tl.where(mask_dn, h, 0.0)
        last_tile = s == STATE_TILES - 1
        # u, delta and z of a tile are loaded while the tile before it is computed (bytes in flight)
        mask = mask_d[:, None] & ((t_begin + tt) < seqlen)[None, :]
        u_next = _row_tile(u_rows, t_begin + tt, mask, s_ut)
        delta_next = _row_tile(delta_rows, t_begin + tt, mask, s_dt)
        z_next = u_next
        if HAS_Z:
            z_next = _row_tile(z_rows, t_begin + tt, mask & last_tile, s_zt)
        for c in range(c_first, c_last):
            c_begin = tl.maximum(c * CHUNK, t_begin)
            # and a variable B's and C's rows PREFETCH steps before theirs (pass 1 reads no C), loaded again at
            # each chunk's start: rows carried across both loops reach the steps in another layout than the one
            # every thread reads, through shared memory with a barrier at every step (sm_90, Triton 3.6)
            B_1 = _bc_ahead(B_rows, n, c_begin, s_Bn, s_Bt, B_VAR, B_SHARED, PREFETCH > 0, BLOCK_D, STATES)
            B_2 = _bc_ahead(B_rows, n, c_begin + 1, s_Bn, s_Bt, B_VAR, B_SHARED, PREFETCH > 1, BLOCK_D, STATES)
            C_1 = _bc_ahead(C_rows, n, c_begin, s_Cn, s_Ct, C_VAR, C_SHARED, PREFETCH > 0 and SEGMENT_PASS != 1,
                            BLOCK_D, STATES)
            C_2 = _bc_ahead(C_rows, n, c_begin + 1, s_Cn, s_Ct, C_VAR, C_SHARED,
                            PREFETCH > 1 and SEGMENT_PASS != 1, BLOCK_D, STATES)
            for t0 in tl.range(c_begin, tl.minimum(t_end, (c + 1) * CHUNK), BLOCK_T, num_stages=STAGES):
                t = t0 + tt
                mask = mask_d[:, None] & (t < seqlen)[None, :]
                u = u_next.to(tl.float32)
                dt, dtu = _drive(u_next, delta_next, bias, mask, HAS_BIAS, SOFTPLUS)
                gate = z_next.to(tl.float32)
                if HAS_Z:
                    gate = gate * sigmoid(gate)
                t_next = t + BLOCK_T
                mask_next = mask_d[:, None] & (t_next < seqlen)[None, :]
                u_next = _row_tile(u_rows, t_next, mask_next, s_ut)
                delta_next = _row_tile(delta_rows, t_next, mask_next, s_dt)
                if HAS_Z:
                    z_next = _row_tile(z_rows, t_next, mask_next & last_tile, s_zt)
                dt_total += tl.sum(dt, axis=1)
                y_at = row[:, None] * seqlen + t[None, :]
                y = tl.zeros([BLOCK_D, BLOCK_T], dtype=tl.float32)
                if STATE_TILES > 1 and SEGMENT_PASS != 1:
                    y = tl.load(y_ptr + y_at, mask=mask & (s > 0), other=0.0)
                # the recurrence, a step at a time, over the tile's states at once (past seqlen decay is 1 and
                # drive 0, and B, C are 0: the last state is the sequence's)
                for k in tl.static_range(BLOCK_T):
                    B_t, B_1, B_2 = _bc_next(B_1, B_2, B_const, B_rows, n, t0 + k, s_Bn, s_Bt, B_VAR, B_SHARED,
                                             PREFETCH)
                    h = _step(h, A2, _column(dt, tt, k), _column(dtu, tt, k), B_t, mask_dn, PADDED_STATES)
                    if SEGMENT_PASS != 1:
                        C_t, C_1, C_2 = _bc_next(C_1, C_2, C_const, C_rows, n, t0 + k, s_Cn, s_Ct, C_VAR,
                                                 C_SHARED, PREFETCH)
                        y = _with_column(y, tt, k, _column(y, tt, k) + tl.sum(h * C_t, axis=1))
                if SEGMENT_PASS != 1:
                    if STATE_TILES > 1:
                        tl.store(y_ptr + y_at, y, mask=mask & (s < STATE_TILES - 1))
                    y += Dv[:, None] * u
                    tl.store(out_ptr + y_at, y.to(out_ptr.dtype.element_ty), mask=mask & last_tile)
                    if HAS_Z:
                        tl.store(out_z_ptr + y_at, (y * gate).to(out_z_ptr.dtype.element_ty), mask=mask & last_tile)
            if SEGMENT_PASS != 1:  # mamba_ssm's x: per state, the decay since t = 0 and the chunk's last state
                x_at = (row[:, None] * n_chunks + c) * 2 * dstate + 2 * n[None, :]
                # (the chunk ends in this program's steps; a mask of tensors, as the interpreter takes)
                chunk_ends = mask_dn & ((n * 0 + tl.minimum(seqlen, (c + 1) * CHUNK)) <= t_end)[None, :]
                tl.store(x_ptr + x_at, tl.exp2(dt_total[:, None] * A2), mask=chunk_ends)
                tl.store(x_ptr + x_at + 1, h, mask=chunk_ends)
        if SEGMENT_PASS == 1:
            tl.store(seg_h_ptr + (row[:, None] * n_segments + pid_s) * dstate + n[None, :], h, mask=mask_dn)
            tl.store(seg_dt_ptr + row * n_segments + pid_s, dt_total, mask=mask_d)
        else:
            last_segment = ((n * 0 + t_end) == seqlen)[None, :]
            tl.store(last_ptr + row[:, None] * dstate + n[None, :], h, mask=mask_dn & last_segment)


@triton.jit
def _row_tile(rows, t, mask, s_t):
    """A (BLOCK_D, BLOCK_T) tile of a (batch, dim, seqlen) input in its own dtype, 0 where masked."""
    return tl.load(rows[:, None] + t[None, :] * s_t, mask=mask, other=0.0)


@triton.jit
def _load_tile(rows, t, mask, s_t):
    """_row_tile as float32."""
    return _row_tile(rows, t, mask, s_t).to(tl.float32)


@triton.jit
def _drive(u, delta, bias, mask, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """A tile's (dt, dt * u), float32 (BLOCK_D, BLOCK_T), from its u and delta as loaded; dt is 0 where masked
    (decay 1, no drive: a padding step passes the state, and the adjoint, through unchanged)."""
    _, dt = _dt(delta, bias[:, None], mask, HAS_BIAS, SOFTPLUS)
    return dt, dt * u.to(tl.float32)


@triton.jit
def _advance(h, A2, dt, dtu, B_rows, B_const, n, t0, mask_dn, s_Bn, s_Bt, B_VAR: tl.constexpr,
             B_SHARED: tl.constexpr, FIRST: tl.constexpr, STEPS: tl.constexpr, PADDED_STATES: tl.constexpr):
    """The states after the tile's steps FIRST ... FIRST + STEPS - 1 (columns of dt and dtu; the tile starts
    at step t0), from the states h before them, keeping nothing else."""
    tt = tl.arange(0, dt.shape[1])
    for k in tl.static_range(FIRST, FIRST + STEPS):
        B_t = B_const
        if B_VAR:
            B_t = _bc_step(B_rows, n, t0 + k, s_Bn, s_Bt, B_SHARED)
        h = _step(h, A2, _column(dt, tt, k), _column(dtu, tt, k), B_t, mask_dn, PADDED_STATES)
    return h


@triton.jit
def _step(h, A2, dt, dtu, B_t, mask_dn, PADDED_STATES: tl.constexpr):
    """The states after a step from the states h before it: dt and dtu (BLOCK_D,), B_t the step's B."""
    h = tl.exp2(dt[:, None] * A2) * h + dtu[:, None] * B_t
    if PADDED_STATES:  # a padding state stays 0 (an infinite dt or u would make it NaN)
        h = tl.where(mask_dn, h, 0.0)
    return h


@triton.jit
def _store_states(ptrs, h, stride, mask_d, STATES: tl.constexpr):
    """Stores the (BLOCK_D, STATES) states h a state at a time, state n at ptrs + n * stride: a column is a
    register of each thread and a row of consecutive channels in memory, so the stores stay coalesced and
    the tile needs no change of layout (a (channels, states) tile stored at once would be laid out for
    vector stores along the states, through shared memory)."""
    cols = tl.arange(0, STATES)
    for n in tl.static_range(STATES):
        tl.store(ptrs + n * stride, _column(h, cols, n), mask=mask_d)


@triton.jit
def _load_states(ptrs, stride, mask_d, BLOCK_D: tl.constexpr, STATES: tl.constexpr):
    """The states _store_states stored, as a (BLOCK_D, STATES) tile."""
    cols = tl.arange(0, STATES)
    h = tl.zeros([BLOCK_D, STATES], dtype=tl.float32)
    for n in tl.static_range(STATES):
        h = _with_column(h, cols, n, tl.load(ptrs + n * stride, mask=mask_d, other=0.0))
    return h


@triton.jit
def _bc_grad_rows(dd, d_first, dim, dpg, REDUCE: tl.constexpr, ATOMIC: tl.constexpr, SHARED: tl.constexpr):
    """The row of a variable dB's or dC's buffer that the sum holding each channel dd goes to (_add_bc_grad): its
    group's (ATOMIC), or its own, one for every REDUCE channels (each written once, by this program; the buffer
    has rows for the channels past dim, whose values are 0). A channel past dim adds to the last channel's
    group."""
    if ATOMIC and SHARED:  # (the block's one row: a uniform address, which no thread keeps a register for)
        rows = dd * 0 + d_first // dpg
    elif ATOMIC:
        rows = tl.minimum(dd, dim - 1) // dpg
    else:
        rows = dd // REDUCE
    return rows


@triton.jit
def _halve(x, BLOCK_D: tl.constexpr, BIT: tl.constexpr, WIDTH: tl.constexpr):
    """A step of _group_sums: x (BLOCK_D, WIDTH) -> (BLOCK_D, WIDTH // 2), channel c keeping the half of its
    columns that its bit BIT selects, plus channel c ^ BIT's same half (a select each for the half kept and the
    half given, the halves themselves a choice of registers)."""
    low, high = tl.split(tl.permute(tl.reshape(x, (BLOCK_D, 2, WIDTH // 2)), (0, 2, 1)))
    upper = (tl.arange(0, BLOCK_D) // BIT % 2 == 1)[:, None]
    given = tl.reshape(tl.where(upper, low, high), (BLOCK_D // (2 * BIT), 2, BIT, WIDTH // 2))
    return tl.where(upper, high, low) + tl.reshape(tl.flip(given, 1), (BLOCK_D, WIDTH // 2))


@triton.jit
def _group_sums(value, REDUCE: tl.constexpr, BLOCK_D: tl.constexpr, STATES: tl.constexpr):
    """The sums of a (BLOCK_D, STATES) tile over each group of REDUCE consecutive channels (a power of two),
    spread over the group: (BLOCK_D, WIDTH), WIDTH = max(STATES // REDUCE, 1), channel c holding the sums of
    the WIDTH states from (c % REDUCE) // max(REDUCE // STATES, 1) * WIDTH (and the channels between two
    holders the same sums). A halving exchange (a reduce-scatter): at each channel bit, the highest first, a
    channel keeps the half of its states the bit selects and adds its partner's (c ^ bit) values of that
    half, a lane shuffle each (the flip along the bit); past the states' bits every channel has one sum, and
    the bits left sum it whole. Within a warp that is STATES / 2 + STATES / 4 + ... + log2 of the rest
    shuffles, where a sum left in every channel takes STATES log2(REDUCE) (16 and 80 at 32 channels and 16
    states), and a group's sums leave in one store of consecutive addresses rather than STATES."""
    x = value
    for level in tl.static_range(5):  # (a warp's channel bits at most)
        if (REDUCE // (2 << level) > 0) & (STATES // (1 << level) > 1):
            x = _halve(x, BLOCK_D, REDUCE // (2 << level), STATES // (1 << level))
    share: tl.constexpr = REDUCE // STATES
    if share > 1:  # fewer states than channels: each channel has one sum, over `share` consecutive channels still
        sums = tl.sum(tl.reshape(x, (BLOCK_D // share, share, 1)), axis=1)
        x = tl.reshape(tl.broadcast_to(sums[:, None, :], (BLOCK_D // share, share, 1)), (BLOCK_D, 1))
    return x


@triton.jit
def _add_bc_grad(rows_ptr, value, rows, t, n_first, seqlen_padded, states_padded, REDUCE: tl.constexpr,
                 BLOCK_D: tl.constexpr, STATES: tl.constexpr, ATOMIC: tl.constexpr):
    """Step t's (BLOCK_D, STATES) gradient of a variable B or C (states n_first ...) into its time-major
    (rows, seqlen_padded, states_padded) buffer: summed over REDUCE consecutive channels (of one group) first,
    then added atomically (ATOMIC) or stored at the rows of _bc_grad_rows. Up to a warp's 32 channels the sums
    are spread over the group (_group_sums) and each channel holding a sum stores it; over more, every channel
    holds every sum and the group's first channel stores them. A column at a time, from the registers that
    hold it (as _store_states). No masks but that: the buffer has the padding steps and states, whose values
    are 0 (or discarded: the caller slices them off)."""
    ptrs = rows_ptr + (rows * seqlen_padded + t) * states_padded + n_first
    channel = tl.arange(0, BLOCK_D) % REDUCE
    if REDUCE > 32:  # each channel holds its sum (lane shuffles within a warp leave it in every lane), so that
        # the stores keep the channels' layout: a (BLOCK_D // REDUCE,) sum is moved to the layout of its row index
        # through shared memory, with a barrier, at every store
        sums = tl.sum(tl.reshape(value, (BLOCK_D // REDUCE, REDUCE, STATES)), axis=1)
        part = tl.reshape(tl.broadcast_to(sums[:, None, :], (BLOCK_D // REDUCE, REDUCE, STATES)), (BLOCK_D, STATES))
        holds = channel == 0
    else:
        part = _group_sums(value, REDUCE, BLOCK_D, STATES)
        share: tl.constexpr = REDUCE * part.shape[1] // STATES  # channels holding the same sums
        ptrs += channel // share * part.shape[1]
        holds = channel % share == 0
    cols = tl.arange(0, part.shape[1])
    for n in tl.static_range(part.shape[1]):
        if ATOMIC:
            tl.atomic_add(ptrs + n, _column(part, cols, n), mask=holds, sem="relaxed")
        else:
            tl.store(ptrs + n, _column(part, cols, n), mask=holds)


@triton.jit
def selective_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, init_ptr, dout_ptr, dlast_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr, dinit_ptr, ckpt_ptr, part_ptr,
    dim, seqlen, dstate, dpg_B, dpg_C, rows_B, rows_C, n_segments,
    s_ub, s_ud, s_ut, s_db, s_dd, s_dt, s_zb, s_zd, s_zt, s_gb, s_gd, s_gt,
    s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Bt, s_Cb, s_Cg, s_Cn, s_Ct,
    s_ib, s_id, s_in, s_lb, s_ld, s_ln,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_DLAST: tl.constexpr, SOFTPLUS: tl.constexpr, B_VAR: tl.constexpr, C_VAR: tl.constexpr,
    B_SHARED: tl.constexpr, C_SHARED: tl.constexpr, BC_ATOMIC: tl.constexpr, REDUCE_B: tl.constexpr,
    REDUCE_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, STATES: tl.constexpr,
    STATE_TILES: tl.constexpr, PADDED_STATES: tl.constexpr, SEGMENT: tl.constexpr, SUB_T: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """A program takes BLOCK_D channels of one batch row, a thread one channel (see the module's
    docstring); B and C as the forward reads them (padded with PREFETCH steps more than whole tiles: its first
    walk's loads ahead). Outputs, 1-D and contiguous: du, ddelta, dz (batch,
    dim, seqlen); float32: dA (batch, dim, dstate), dD and dbias (batch, dim), a constant dB/dC (batch,
    dim, dstate), a variable one (batch, rows, seqlen, dstate) padded to whole tiles of steps and states
    (rows_B: its groups if BC_ATOMIC, else the programs' channels / REDUCE_B), dinit (batch, dim, dstate).
    Scratch: ckpt (batch, n_segments, STATES, dim); part (3, batch, dim, seqlen), the sums over the earlier
    state tiles (only when STATE_TILES > 1)."""
    pid_b = tl.program_id(1).to(tl.int64)
    d_first = tl.program_id(0).to(tl.int64) * BLOCK_D
    dd = d_first + tl.arange(0, BLOCK_D)
    mask_d = dd < dim
    tt = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, STATES)
    bias, Dv, u_rows, delta_rows, z_rows, B_rows, C_rows = _channel_inputs(
        u_ptr, delta_ptr, z_ptr, bias_ptr, D_ptr, B_ptr, C_ptr, pid_b, dd, d_first, mask_d, dim,
        s_ub, s_ud, s_db, s_dd, s_zb, s_zd, dpg_B, dpg_C, s_Bb, s_Bg, s_Cb, s_Cg,
        HAS_BIAS, HAS_D, B_VAR, B_SHARED, C_VAR, C_SHARED, BLOCK_D)
    dout_rows = dout_ptr + pid_b * s_gb + dd * s_gd
    seqlen_padded = (seqlen + BLOCK_T - 1) // BLOCK_T * BLOCK_T
    dB_rows = dB_ptr + pid_b * rows_B * seqlen_padded * (STATES * STATE_TILES)
    dC_rows = dC_ptr + pid_b * rows_C * seqlen_padded * (STATES * STATE_TILES)
    dB_row = _bc_grad_rows(dd, d_first, dim, dpg_B, REDUCE_B, BC_ATOMIC, B_SHARED)
    dC_row = _bc_grad_rows(dd, d_first, dim, dpg_C, REDUCE_C, BC_ATOMIC, C_SHARED)
    row = pid_b * dim + dd  # of the (batch, dim, ...) outputs
    ckpt_rows = ckpt_ptr + pid_b * n_segments * STATES * dim + dd  # state n of segment j at (j STATES + n) dim
    segment_len = SEGMENT * BLOCK_T
    n_tiles = (seqlen + BLOCK_T - 1) // BLOCK_T
    elements = tl.num_programs(1) * dim * seqlen  # of a (batch, dim, seqlen) part of `part`
    dD_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    dbias_acc = tl.zeros([BLOCK_D], dtype=tl.float32)

    for s in range(0, STATE_TILES):
        n = s * STATES + cols
        mask_dn = mask_d[:, None] & (n < dstate)[None, :]
        # (n and its mask are computed here: an output's index must not come from a helper that takes the inputs)
        A2, h, B_const, C_const = _state_tile_inputs(A_ptr, init_ptr, B_rows, C_rows, pid_b, dd, n, mask_dn, s_Ad,
                                                     s_An, s_ib, s_id, s_in, s_Bn, s_Cn, HAS_INIT, B_VAR, C_VAR,
                                                     BLOCK_D, STATES)
        last_tile = s == STATE_TILES - 1

        # forwards: the state at the start of every segment. A tile's u and delta are loaded while the tile before
        # it is computed, and so before the checkpoint between them is stored (the compiler keeps a load after a
        # store, which waits for the walk); a variable B's rows PREFETCH steps ahead. One loop over the tiles:
        # rows carried across two loops reach the steps in another layout than the one every thread reads, through
        # shared memory with a barrier at every step (sm_90, Triton 3.6)
        u_next = _row_tile(u_rows, tt, mask_d[:, None] & (tt < seqlen)[None, :], s_ut)
        delta_next = _row_tile(delta_rows, tt, mask_d[:, None] & (tt < seqlen)[None, :], s_dt)
        B_1 = _bc_ahead(B_rows, n, 0, s_Bn, s_Bt, B_VAR, B_SHARED, PREFETCH > 0, BLOCK_D, STATES)
        B_2 = _bc_ahead(B_rows, n, 1, s_Bn, s_Bt, B_VAR, B_SHARED, PREFETCH > 1, BLOCK_D, STATES)
        for t0 in range(0, seqlen, BLOCK_T):
            if SEGMENT == 1:  # (a checkpoint every tile)
                _store_states(ckpt_rows + (t0 // BLOCK_T) * STATES * dim, h, dim, mask_d, STATES)
            elif t0 % segment_len == 0:
                _store_states(ckpt_rows + (t0 // segment_len) * STATES * dim, h, dim, mask_d, STATES)
            t = t0 + tt
            dt, dtu = _drive(u_next, delta_next, bias, mask_d[:, None] & (t < seqlen)[None, :], HAS_BIAS, SOFTPLUS)
            mask_next = mask_d[:, None] & (t + BLOCK_T < seqlen)[None, :]
            u_next = _row_tile(u_rows, t + BLOCK_T, mask_next, s_ut)
            delta_next = _row_tile(delta_rows, t + BLOCK_T, mask_next, s_dt)
            for k in tl.static_range(BLOCK_T):
                B_t, B_1, B_2 = _bc_next(B_1, B_2, B_const, B_rows, n, t0 + k, s_Bn, s_Bt, B_VAR, B_SHARED, PREFETCH)
                h = _step(h, A2, _column(dt, tt, k), _column(dtu, tt, k), B_t, mask_dn, PADDED_STATES)

        # backwards, a tile at a time: the adjoint g enters from the last state's gradient
        carry = tl.zeros([BLOCK_D, STATES], dtype=tl.float32)
        if HAS_DLAST:
            carry = tl.load(dlast_ptr + pid_b * s_lb + dd[:, None] * s_ld + n[None, :] * s_ln, mask=mask_dn,
                            other=0.0)
        dA_acc = tl.zeros([BLOCK_D, STATES], dtype=tl.float32)
        dB_acc = dA_acc  # (a constant B's or C's gradient, summed over time)
        dC_acc = dA_acc
        for back in range(0, n_tiles):
            t0 = (n_tiles - 1 - back) * BLOCK_T
            j = t0 // segment_len
            h_start = _load_states(ckpt_rows + j * STATES * dim, dim, mask_d, BLOCK_D, STATES)
            for t1 in range(j * segment_len, t0, BLOCK_T):
                t = t1 + tt
                walk_mask = mask_d[:, None] & (t < seqlen)[None, :]
                dt, dtu = _drive(_row_tile(u_rows, t, walk_mask, s_ut), _row_tile(delta_rows, t, walk_mask, s_dt),
                                 bias, walk_mask, HAS_BIAS, SOFTPLUS)
                h_start = _advance(h_start, A2, dt, dtu, B_rows, B_const, n, t1, mask_dn, s_Bn, s_Bt, B_VAR,
                                   B_SHARED, 0, BLOCK_T, PADDED_STATES)
            t = t0 + tt
            mask = mask_d[:, None] & (t < seqlen)[None, :]
            u = _load_tile(u_rows, t, mask, s_ut)
            dt_raw, dt = _dt(_load_tile(delta_rows, t, mask, s_dt), bias[:, None], mask, HAS_BIAS, SOFTPLUS)
            dtu = dt * u
            ddt_per_dt = dt_raw  # (d softplus / d delta, when softplus)
            if SOFTPLUS:
                ddt_per_dt = sigmoid(dt_raw)
            dy = _load_tile(dout_rows, t, mask, s_gt)  # the gradient of y, the output before the silu(z) gate
            dz_per_y = dy  # (dz = dz_per_y * (y + D u), kept rather than dout and z read again)
            if HAS_Z:
                zv = _load_tile(z_rows, t, mask, s_zt)
                sig = sigmoid(zv)
                dz_per_y = dy * sig * (1.0 + zv * (1.0 - sig))
                dy = dy * zv * sig
            y = tl.zeros([BLOCK_D, BLOCK_T], dtype=tl.float32)
            d_dtu = tl.zeros([BLOCK_D, BLOCK_T], dtype=tl.float32)  # gradient of dt u through the drives
            d_dt_decay = tl.zeros([BLOCK_D, BLOCK_T], dtype=tl.float32)  # of dt through the decays, / ln 2
            # the tile's register tiles of SUB_T steps, last first, each reached from the tile's start state
            for sub in tl.static_range(BLOCK_T // SUB_T - 1, -1, -1):
                h_sub = _advance(h_start, A2, dt, dtu, B_rows, B_const, n, t0, mask_dn, s_Bn, s_Bt, B_VAR,
                                 B_SHARED, 0, sub * SUB_T, PADDED_STATES)
                # its steps again, their states (but the last, which no step needs as its previous one) and
                # decays kept, a register each; dC_t = h_t dy_t, which needs no adjoint, on the way
                states = ()
                decays = ()
                h = h_sub
                for k in tl.static_range(sub * SUB_T, (sub + 1) * SUB_T):
                    B_t = B_const
                    if B_VAR:
                        B_t = _bc_step(B_rows, n, t0 + k, s_Bn, s_Bt, B_SHARED)
                    C_t = C_const
                    if C_VAR:
                        C_t = _bc_step(C_rows, n, t0 + k, s_Cn, s_Ct, C_SHARED)
                    decay = tl.exp2(_column(dt, tt, k)[:, None] * A2)
                    h = decay * h + _column(dtu, tt, k)[:, None] * B_t
                    if PADDED_STATES:
                        h = tl.where(mask_dn, h, 0.0)
                    if k < (sub + 1) * SUB_T - 1:
                        states = states + (h,)
                    decays = decays + (decay,)
                    if HAS_Z:
                        y = _with_column(y, tt, k, tl.sum(h * C_t, axis=1))
                    dy_step = _column(dy, tt, k)[:, None]
                    if C_VAR:
                        _add_bc_grad(dC_rows, h * dy_step, dC_row, t0 + k, s * STATES, seqlen_padded,
                                     STATES * STATE_TILES, REDUCE_C, BLOCK_D, STATES, BC_ATOMIC)
                    else:
                        dC_acc += h * dy_step
                # the adjoint back over them
                for r in tl.static_range((sub + 1) * SUB_T - 1, sub * SUB_T - 1, -1):
                    B_t = B_const
                    if B_VAR:
                        B_t = _bc_step(B_rows, n, t0 + r, s_Bn, s_Bt, B_SHARED)
                    C_t = C_const
                    if C_VAR:
                        C_t = _bc_step(C_rows, n, t0 + r, s_Cn, s_Ct, C_SHARED)
                    dy_step = _column(dy, tt, r)[:, None]
                    dtu_step = _column(dtu, tt, r)[:, None]
                    g = carry + C_t * dy_step
                    if PADDED_STATES:
                        g = tl.where(mask_dn, g, 0.0)
                    if r == sub * SUB_T:
                        h_prev = h_sub
                    else:
                        h_prev = states[r - sub * SUB_T - 1]
                    q = (g * h_prev) * decays[r - sub * SUB_T]
                    dA_acc += q * _column(dt, tt, r)[:, None]
                    d_dt_decay = _with_column(d_dt_decay, tt, r, tl.sum(q * A2, axis=1))
                    d_dtu = _with_column(d_dtu, tt, r, tl.sum(g * B_t, axis=1))
                    if B_VAR:
                        _add_bc_grad(dB_rows, g * dtu_step, dB_row, t0 + r, s * STATES, seqlen_padded,
                                     STATES * STATE_TILES, REDUCE_B, BLOCK_D, STATES, BC_ATOMIC)
                    else:
                        dB_acc += g * dtu_step
                    carry = decays[r - sub * SUB_T] * g
            if STATE_TILES > 1:  # the sums over the states of the earlier state tiles
                at = row[:, None] * seqlen + t[None, :]
                y += tl.load(part_ptr + at, mask=mask & (s > 0), other=0.0)
                d_dtu += tl.load(part_ptr + elements + at, mask=mask & (s > 0), other=0.0)
                d_dt_decay += tl.load(part_ptr + 2 * elements + at, mask=mask & (s > 0), other=0.0)
                tl.store(part_ptr + at, y, mask=mask & (s < STATE_TILES - 1))
                tl.store(part_ptr + elements + at, d_dtu, mask=mask & (s < STATE_TILES - 1))
                tl.store(part_ptr + 2 * elements + at, d_dt_decay, mask=mask & (s < STATE_TILES - 1))
            # the outputs
            at = row[:, None] * seqlen + t[None, :]
            if HAS_Z:
                dz = dz_per_y * (y + Dv[:, None] * u)
                tl.store(dz_ptr + at, dz.to(dz_ptr.dtype.element_ty), mask=mask & last_tile)
            du = d_dtu * dt
            if HAS_D:
                du += Dv[:, None] * dy
                dD_acc += tl.where(last_tile, tl.sum(dy * u, axis=1), 0.0)
            ddt = d_dt_decay * LN2 + d_dtu * u
            if SOFTPLUS:
                ddt = ddt * ddt_per_dt
            ddt = tl.where(mask, ddt, 0.0)
            dbias_acc += tl.where(last_tile, tl.sum(ddt, axis=1), 0.0)
            tl.store(du_ptr + at, du.to(du_ptr.dtype.element_ty), mask=mask & last_tile)
            tl.store(ddelta_ptr + at, ddt.to(ddelta_ptr.dtype.element_ty), mask=mask & last_tile)
        at = row[:, None] * dstate + n[None, :]
        tl.store(dA_ptr + at, dA_acc, mask=mask_dn)
        if not B_VAR:
            tl.store(dB_ptr + at, dB_acc, mask=mask_dn)
        if not C_VAR:
            tl.store(dC_ptr + at, dC_acc, mask=mask_dn)
        if HAS_INIT:
            tl.store(dinit_ptr + at, carry, mask=mask_dn)
    if HAS_D:
        tl.store(dD_ptr + row, dD_acc, mask=mask_d)
    if HAS_BIAS:
        tl.store(dbias_ptr + row, dbias_acc, mask=mask_d)
