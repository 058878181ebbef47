"""Triton kernels of the causal depthwise conv: a program per (block of channels, block of time, batch row);
every tensor is read and written through its strides, so channel-last and channel-first tensors take the
same kernels. Stream entry j (initial states, then x) is input time j - (WIDTH - 1)."""

import triton
import triton.language as tl

from .._triton import sigmoid


@triton.jit
def _tap(x_ptr, init_ptr, b, d, tau, mask_d, seqlen, s_xb, s_xd, s_xt, s_ib, s_id, s_it,
         HAS_INIT: tl.constexpr, WIDTH: tl.constexpr):
    """The stream's values at input times tau (BLOCK_T,) for channels d (BLOCK_D,): x, or before time 0
    the initial states (zeros without them); float32 (BLOCK_D, BLOCK_T)."""
    in_x = (tau >= 0) & (tau < seqlen)
    v = tl.load(x_ptr + b * s_xb + d[:, None] * s_xd + tau[None, :] * s_xt, mask=mask_d[:, None] & in_x[None, :],
                other=0.0).to(tl.float32)
    if HAS_INIT:
        in_init = (tau < 0) & (tau >= 1 - WIDTH)
        v += tl.load(init_ptr + b * s_ib + d[:, None] * s_id + (tau + WIDTH - 1)[None, :] * s_it,
                     mask=mask_d[:, None] & in_init[None, :], other=0.0).to(tl.float32)
    return v


@triton.jit
def _seq(seq_ptr, b, tau, seqlen, s_sb, s_st):
    """The sequence of input time tau (the initial states belong to token 0's)."""
    return tl.load(seq_ptr + b * s_sb + tl.minimum(tl.maximum(tau, 0), seqlen - 1) * s_st)


@triton.jit
def _tap_of(x_ptr, init_ptr, seq_ptr, b, d, tau, own, mask_d, seqlen, s_xb, s_xd, s_xt, s_ib, s_id, s_it,
            s_sb, s_st, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, WIDTH: tl.constexpr):
    """_tap, zero where input time tau is not in sequence `own` (BLOCK_T,)."""
    v = _tap(x_ptr, init_ptr, b, d, tau, mask_d, seqlen, s_xb, s_xd, s_xt, s_ib, s_id, s_it, HAS_INIT, WIDTH)
    if HAS_SEQ:
        v = tl.where((_seq(seq_ptr, b, tau, seqlen, s_sb, s_st) == own)[None, :], v, 0.0)
    return v


@triton.jit
def _pre_activation(x_ptr, w_ptr, bias_ptr, init_ptr, seq_ptr, b, d, t, mask_d, seqlen,
                    s_xb, s_xd, s_xt, s_wd, s_wk, s_bias, s_ib, s_id, s_it, s_sb, s_st,
                    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr, WIDTH: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """bias + sum_k weight[:, k] * stream[t + k] (only within t's sequence): float32 (BLOCK_D, BLOCK_T)."""
    acc = tl.zeros((BLOCK_D, BLOCK_T), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d * s_bias, mask=mask_d, other=0.0).to(tl.float32)[:, None]
    own = 0
    if HAS_SEQ:
        own = _seq(seq_ptr, b, t, seqlen, s_sb, s_st)
    for k in tl.static_range(WIDTH):
        tau = t + k - (WIDTH - 1)
        v = _tap_of(x_ptr, init_ptr, seq_ptr, b, d, tau, own, mask_d, seqlen, s_xb, s_xd, s_xt, s_ib, s_id, s_it,
                    s_sb, s_st, HAS_INIT, HAS_SEQ, WIDTH)
        w = tl.load(w_ptr + d * s_wd + k * s_wk, mask=mask_d, other=0.0).to(tl.float32)
        acc += w[:, None] * v
    return acc


@triton.jit
def causal_conv1d_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, seq_ptr, out_ptr, final_ptr,
    dim, seqlen,
    s_xb, s_xd, s_xt, s_wd, s_wk, s_bias, s_ib, s_id, s_it, s_sb, s_st, s_ob, s_od, s_ot,
    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out for a (BLOCK_D, BLOCK_T) tile; the programs of time block 0 also write the final states
    (batch, dim, WIDTH - 1), contiguous: the stream's last WIDTH - 1 entries within the last token's sequence."""
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(2).to(tl.int64)
    mask_d = d < dim
    acc = _pre_activation(x_ptr, w_ptr, bias_ptr, init_ptr, seq_ptr, b, d, t, mask_d, seqlen,
                          s_xb, s_xd, s_xt, s_wd, s_wk, s_bias, s_ib, s_id, s_it, s_sb, s_st,
                          HAS_BIAS, HAS_SEQ, HAS_INIT, WIDTH, BLOCK_D, BLOCK_T)
    if SILU:
        acc = acc * sigmoid(acc)
    tl.store(out_ptr + b * s_ob + d[:, None] * s_od + t[None, :] * s_ot, acc.to(out_ptr.dtype.element_ty),
             mask=mask_d[:, None] & (t < seqlen)[None, :])
    if WIDTH > 1:
        if tl.program_id(1) == 0:
            j = tl.arange(0, BLOCK_H)
            tau = seqlen - (WIDTH - 1) + j
            last = 0
            if HAS_SEQ:
                last = _seq(seq_ptr, b, seqlen - 1 + j * 0, seqlen, s_sb, s_st)
            v = _tap_of(x_ptr, init_ptr, seq_ptr, b, d, tau, last, mask_d, seqlen, s_xb, s_xd, s_xt, s_ib, s_id,
                        s_it, s_sb, s_st, HAS_INIT, HAS_SEQ, WIDTH)
            tl.store(final_ptr + (b * dim + d[:, None]) * (WIDTH - 1) + j[None, :],
                     v.to(final_ptr.dtype.element_ty), mask=mask_d[:, None] & (j < WIDTH - 1)[None, :])


@triton.jit
def causal_conv1d_dpre_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, seq_ptr, dout_ptr, dpre_ptr, dw_ptr, db_ptr,
    dim, seqlen,
    s_xb, s_xd, s_xt, s_wd, s_wk, s_bias, s_ib, s_id, s_it, s_sb, s_st, s_gb, s_gd, s_gt, s_pb, s_pd, s_pt,
    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The backward's first pass over a (BLOCK_D, BLOCK_T) tile: dpre = dout * silu'(pre), float32
    (batch, dim, seqlen) in x's layout (strides s_p*), and this tile's sums of dweight (dim, WIDTH) and dbias
    (dim,) into row (batch row, time block) of their partial sums (summed by the launcher, in a fixed order)."""
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(2).to(tl.int64)
    mask_d = d < dim
    mask = mask_d[:, None] & (t < seqlen)[None, :]
    g = tl.load(dout_ptr + b * s_gb + d[:, None] * s_gd + t[None, :] * s_gt, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre_activation(x_ptr, w_ptr, bias_ptr, init_ptr, seq_ptr, b, d, t, mask_d, seqlen,
                              s_xb, s_xd, s_xt, s_wd, s_wk, s_bias, s_ib, s_id, s_it, s_sb, s_st,
                              HAS_BIAS, HAS_SEQ, HAS_INIT, WIDTH, BLOCK_D, BLOCK_T)
        sig = sigmoid(pre)
        g = g * sig * (1.0 + pre * (1.0 - sig))
    tl.store(dpre_ptr + b * s_pb + d[:, None] * s_pd + t[None, :] * s_pt, g, mask=mask)
    part = (b * tl.num_programs(1) + tl.program_id(1)) * dim + d  # this tile's partial row
    if HAS_BIAS:
        tl.store(db_ptr + part, tl.sum(g, axis=1), mask=mask_d)
    own = 0
    if HAS_SEQ:
        own = _seq(seq_ptr, b, t, seqlen, s_sb, s_st)
    for k in tl.static_range(WIDTH):
        tau = t + k - (WIDTH - 1)
        v = _tap_of(x_ptr, init_ptr, seq_ptr, b, d, tau, own, mask_d, seqlen, s_xb, s_xd, s_xt, s_ib, s_id, s_it,
                    s_sb, s_st, HAS_INIT, HAS_SEQ, WIDTH)
        tl.store(dw_ptr + part * WIDTH + k, tl.sum(g * v, axis=1), mask=mask_d)


@triton.jit
def causal_conv1d_dstream_kernel(
    w_ptr, seq_ptr, dpre_ptr, dfinal_ptr, dx_ptr, dinit_ptr,
    dim, seqlen,
    s_wd, s_wk, s_sb, s_st, s_pb, s_pd, s_pt, s_fb, s_fd, s_fj, s_dxb, s_dxd, s_dxt,
    HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The backward's second pass: the gradient of stream entries j (a tile of them) from the outputs that
    read them, t = j - k, and from the final states; dx for j >= WIDTH - 1 (in dx's strides), d initial
    states (batch, dim, WIDTH - 1) contiguous below."""
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(2).to(tl.int64)
    mask_d = d < dim
    tau = j - (WIDTH - 1)  # the input time of entry j
    if HAS_SEQ:
        mine = _seq(seq_ptr, b, tau, seqlen, s_sb, s_st)
    acc = tl.zeros((BLOCK_D, BLOCK_T), dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        t = j - k  # the output reading entry j through tap k
        ok = (t >= 0) & (t < seqlen)
        if HAS_SEQ:
            ok = ok & (_seq(seq_ptr, b, t, seqlen, s_sb, s_st) == mine)
        g = tl.load(dpre_ptr + b * s_pb + d[:, None] * s_pd + t[None, :] * s_pt,
                    mask=mask_d[:, None] & ok[None, :], other=0.0)
        w = tl.load(w_ptr + d * s_wd + k * s_wk, mask=mask_d, other=0.0).to(tl.float32)
        acc += w[:, None] * g
    if HAS_DFINAL:  # entries seqlen .. seqlen + WIDTH - 2 are the final states
        f = j - seqlen
        ok = (f >= 0) & (f < WIDTH - 1)
        if HAS_SEQ:
            ok = ok & (mine == _seq(seq_ptr, b, seqlen - 1 + f * 0, seqlen, s_sb, s_st))
        acc += tl.load(dfinal_ptr + b * s_fb + d[:, None] * s_fd + f[None, :] * s_fj,
                       mask=mask_d[:, None] & ok[None, :], other=0.0).to(tl.float32)
    tl.store(dx_ptr + b * s_dxb + d[:, None] * s_dxd + tau[None, :] * s_dxt, acc.to(dx_ptr.dtype.element_ty),
             mask=mask_d[:, None] & ((tau >= 0) & (tau < seqlen))[None, :])
    if HAS_INIT:
        tl.store(dinit_ptr + (b * dim + d[:, None]) * (WIDTH - 1) + j[None, :], acc.to(dinit_ptr.dtype.element_ty),
                 mask=mask_d[:, None] & (j < WIDTH - 1)[None, :])


@triton.jit
def causal_conv1d_update_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, start_ptr, index_ptr, out_ptr,
    dim, seqlen, state_len, cache_size,
    s_xb, s_xd, s_xt, s_cb, s_cd, s_cl, s_wd, s_wk, s_bias,
    CIRCULAR: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """The decoding step for a block of channels of one batch row: each token's output from the
    WIDTH - 1 entries before it (from the state as it was, or from x), then the state's update in place;
    out (batch, dim, seqlen) contiguous. Stream position p is slot p % state_len of a circular state
    (token 0 at cache_seqlens[b]), slot p - seqlen of a shifted one (token 0 at state_len)."""
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    b = tl.program_id(1).to(tl.int64)
    mask_d = d < dim
    row = b
    if HAS_INDEX:  # the batch row's cache entry; a negative index is padding: nothing written, out = 0 (so is one
        # past the cache, which the launcher's check lets through only while a CUDA graph is captured)
        row = tl.load(index_ptr + b).to(tl.int64)
        mask_state = mask_d & (d * 0 + row >= 0) & (d * 0 + row < cache_size)
        row = tl.maximum(row, 0)
    else:
        mask_state = mask_d
    start = state_len
    if CIRCULAR:
        start = tl.load(start_ptr + b).to(tl.int64)
    state = state_ptr + row * s_cb + d * s_cd
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d * s_bias, mask=mask_d, other=0.0).to(tl.float32)
    # the update's values, read before anything is written (a load the compiler keeps after a store, which it
    # cannot tell apart from the state, is issued after the arithmetic the store waits for)
    slots = tl.arange(0, BLOCK_L)
    mask = mask_state[:, None] & (slots < state_len)[None, :]
    if CIRCULAR:  # token t into slot (start + t) % state_len, the last state_len tokens
        token = (slots[None, :] - start % state_len + state_len) % state_len  # each slot's offset after start ...
        token = token + (seqlen - 1 - token) // state_len * state_len  # ... moved to the last token landing there
        mask = mask & (token < seqlen) & (token >= 0)
        v = tl.load(x_ptr + b * s_xb + d[:, None] * s_xd + token * s_xt, mask=mask, other=0.0)
    else:  # shifted left by seqlen, the tokens appended
        src = slots[None, :] + seqlen  # position in cat(state, x)
        from_state = tl.load(state[:, None] + src * s_cl, mask=mask & (src < state_len), other=0.0)
        from_x = tl.load(x_ptr + b * s_xb + d[:, None] * s_xd + (src - state_len) * s_xt,
                         mask=mask & (src >= state_len), other=0.0)
        v = tl.where(src < state_len, from_state.to(tl.float32), from_x.to(tl.float32))
    for t in range(seqlen):
        acc = bias
        for k in tl.static_range(WIDTH):
            tau = t + k - (WIDTH - 1)
            if tau >= 0:
                v_k = tl.load(x_ptr + b * s_xb + d * s_xd + tau * s_xt, mask=mask_d, other=0.0).to(tl.float32)
            else:
                slot = start + tau
                if CIRCULAR:
                    slot = ((slot % state_len) + state_len) % state_len
                v_k = tl.load(state + slot * s_cl, mask=mask_state, other=0.0).to(tl.float32)
            acc += tl.load(w_ptr + d * s_wd + k * s_wk, mask=mask_d, other=0.0).to(tl.float32) * v_k
        if SILU:
            acc = acc * sigmoid(acc)
        acc = tl.where(mask_state, acc, 0.0)
        tl.store(out_ptr + (b * dim + d) * seqlen + t, acc.to(out_ptr.dtype.element_ty), mask=mask_d)
    # every read above precedes the state's update (other threads of the program may read the slots this
    # thread writes)
    tl.debug_barrier()
    tl.store(state[:, None] + slots[None, :] * s_cl, v.to(state_ptr.dtype.element_ty), mask=mask)
