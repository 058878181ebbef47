"""Triton kernels of the SSD chunked scan (Mamba-2), forward and backward.

Per (batch, head), with a_t = dt_t * A and, inside a chunk, L_l = a_{t0} + ... + a_l (the log
decay from the chunk start through token l), the chunk's outputs are

    y_l = w_l C_l S^T + sum_{s <= l} (C_l . B_s) exp(L_l - L_s) dt_s x_s + D x_l

with S the (headdim, dstate) state entering the chunk, w_l = exp(L_l) where token l is in the
sequence of the token before the chunk (else 0: seq_idx restarted the state), and the sum over
the tokens s of l's sequence. The terms of other sequences are selected out, never multiplied by 0,
and L sums over a token's own sequence: a NaN or inf in one sequence reaches no other (0 * NaN = NaN,
NaN - NaN = NaN). The state after a token e of the chunk is

    H_e = w_e S + sum_{s <= e, seq_s = seq_e} exp(L_e - L_s) dt_s x_s B_s^T.

Work is cut where the data allows parallelism: every chunk's outputs are independent once the
states entering the chunks are known, and those depend on the chunks before only through a
(headdim, dstate) state. So:

forward
  `ssd_dt_kernel` (also first in the backward): dt after dt_bias, softplus and the clamp, and the sums of a
    over each block of the output kernel's tokens up to each token, which the kernels load for the forward
    sums of a block (L from its start) rather than scan them (sums from a token on are scans: a difference
    of sums would carry an earlier NaN).
  `ssd_chunk_states_kernel`: every chunk's own part of the state after it at once, a (headdim, dstate)
    tile of one chunk of one (batch, head) a program, with tensor-core GEMMs (dt x decayed)^T @ B.
  `ssd_state_passing_kernel`: the sequential part, element-wise: a program owns a tile of one (batch, head)
    and walks the chunks in order, storing the state entering each (chunk_states, float32, and for 16-bit
    GEMM operands a copy in that dtype, which the output kernel reads) where its part was, and carrying it
    on: H_after = exp(sum of a) H_entering + part. The final state is the last one. (As mamba_ssm does; a
    walk of the GEMMs themselves, a (batch, head) a program, left most SMs idle and waited at every chunk.)
  `ssd_cb_kernel`: C @ B^T of each chunk, once per group of heads, into a (chunk, chunk) buffer per
    (batch, chunk, group), its lower block triangle, in the GEMMs' operand dtype (16-bit for 16-bit x, B
    and C, float32 else); the backward's dX pass reads it too.
  `ssd_chunk_scan_kernel`: a program owns a block of BLOCK_T tokens of one chunk and a block of
    channels: y = w (C @ S^T) + ((C @ B^T) * decay mask) @ (dt x), reading C @ B^T's tiles, D and
    the silu(z) gate fused. (Computing C @ B^T here instead, per head and channel block, took
    five of its loop's MMAs in six and 195 registers; reading it, 142.) Where autograd asks, it also
    writes y before the gate, from which the backward takes dz (as mamba_ssm's out_x): recomputing y there
    took as long as the forward's own launch.
  `ssd_varlen_states_kernel`: H_e at each cu_seqlens end e, from its chunk's entering state.

backward (deterministic: every output element is written by one program, partial sums over
runs of a group's heads and over chunks are summed afterwards in a fixed order; no atomics)
  `ssd_state_grads_kernel`: the state gradient walks the chunks last to first, like the
    forward's states: the gradient of the state entering chunk c is w_end dE_c + sum_l w_l
    dy_l^T C_l (+ the varlen states' cotangents), with dE_c that of the state after chunk c.
    With 16-bit GEMM operands it also writes dE_c and the chunk states in that dtype: the dX and
    dB/dC passes, each of whose programs reads a whole (headdim, dstate) state to use it as a 16-bit
    GEMM operand, then read half the bytes.
  `ssd_gate_grad_kernel`: with z, dz and the gradient of y before the gate, dout * silu(z), from the
    forward's y before the gate (recomputed by ssd_chunk_scan_kernel where the forward did not keep it).
  `ssd_bwd_dx_kernel`: a program owns a block of tokens of one chunk of one (batch, head): dx, from
    dE_c and C.B^T's tiles, its loop reading the gradient of y before the gate.
  `ssd_bwd_dcb_kernel`, `ssd_bwd_group_kernel`: dB and dC are sums over a group's heads, and their
    quadratic parts go through one matrix per chunk, the gradient of C_l . B_s. The first sums it over a
    run of the group's heads, a pair of token blocks a program; the second, a token block a program,
    multiplies it by B (dC) or C (dB) once a run and adds each head's state part. mamba_ssm's backward
    takes the same route (its dcb); per head, the two GEMMs with B and C cost a group's size times more
    and the per-head dB and dC rows were the backward's largest traffic.
  `ssd_bwd_ddt_kernel` then takes ddt and the chunk's parts of dA and dt_bias. The gradient of the
    log decays needs no extra GEMM: with dC_l and dB_s a head's gradients, dL_l = C_l . dC_l - B_l . dB_l +
    <dH_e, H_e> at each state output e (the chunk's last token, varlen ends), and dt enters through
    a_t = dt_t A, whose gradient is the reverse cumulative sum of dL over the chunk. The per-head
    C_l . dC_l and B_s . dB_s come from the same terms of dC.B^T times C.B^T, summed by rows and columns.

Everything accumulates in float32; GEMM operands are in the inputs' 16-bit dtype when x, B
and C share one (as mamba_ssm's kernels do), else float32 with IEEE products.
"""

import triton
import triton.language as tl

from .._triton import INTERPRETED, LOG2E, exp, sigmoid, softplus

FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)  # checks.FLOAT32_MAX (a JIT function reads constexpr globals)


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        r = tl.dot(a, b, input_precision="ieee")
    elif INTERPRETED:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _operand(v, like_ptr, DOT_F32: tl.constexpr):
    """A GEMM operand: float32, or the inputs' 16-bit dtype (like_ptr's)."""
    if DOT_F32:
        r = v.to(tl.float32)
    else:
        r = v.to(like_ptr.dtype.element_ty)
    return r


@triton.jit
def _block(t0, j, Q, seqlen, BLOCK_T: tl.constexpr):
    """Tokens of the j-th block of the chunk starting at t0, and which are real."""
    offs = j * BLOCK_T + tl.arange(0, BLOCK_T)
    t = t0 + offs
    return t, (offs < Q) & (t < seqlen)


@triton.jit
def _dt_steps(dt_row, t, valid, s_dtt, bias, lo, hi, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """(raw = dt + dt_bias, after softplus, after the clamp: dt), float32; dt is 0 where not valid."""
    raw = tl.load(dt_row + t * s_dtt, mask=valid, other=0.0).to(tl.float32) + bias
    pre = raw
    if SOFTPLUS:
        pre = softplus(raw)
    dt = pre
    if HAS_LIMIT:  # (a NaN stays NaN, as torch.clamp keeps it)
        dt = tl.where(_unclamped(dt, lo, hi) | (dt != dt), dt, tl.where(dt < lo, lo, hi))
    return raw, pre, tl.where(valid, dt, 0.0)


@triton.jit
def _unclamped(v, lo, hi):
    """Where dt_limit leaves v as it is. A bound of float32's largest magnitude is an infinite one (the
    operators' convention, checks.FLOAT32_MAX): it binds no infinite v."""
    return ((v >= lo) | (lo == -FLOAT32_MAX)) & ((v <= hi) | (hi == FLOAT32_MAX))


@triton.jit
def _dt(dt_row, t, valid, s_dtt, bias, A, lo, hi, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """(dt, a = dt * A) of tokens t, float32, 0 where not valid."""
    dt = _dt_steps(dt_row, t, valid, s_dtt, bias, lo, hi, SOFTPLUS, HAS_LIMIT)[2]
    return dt, dt * A


@triton.jit
def _seq(seq_row, t, valid, s_seqt, HAS_SEQ: tl.constexpr):
    """Sequence ids of tokens t (0 without seq_idx)."""
    if HAS_SEQ:
        ids = tl.load(seq_row + t * s_seqt, mask=valid, other=0)
    else:
        ids = tl.zeros_like(t)
    return ids


@triton.jit
def _seq_at(seq_row, t, s_seqt, HAS_SEQ: tl.constexpr):
    """The sequence id of token t; 0 before the first token (initial_states' sequence)."""
    if HAS_SEQ:
        ids = tl.load(seq_row + t * s_seqt, mask=t >= 0, other=0)
    else:
        ids = 0
    return ids


@triton.jit
def _add_within_sequence(a1, seq1, a2, seq2):
    """associative_scan's combine for sums that restart where the (non-decreasing) sequence id changes."""
    return tl.where(seq1 == seq2, a1 + a2, a2), seq2


@triton.jit
def _log_decays(a, seq, dt_row, t, t0, j, Q, seqlen, HAS_SEQ: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_SUMS: tl.constexpr):
    """L: the sum of a over block j's tokens t up to each one (_block_log_decays), of its own sequence only with seq_idx
    (an earlier sequence's NaN or inf dt must not reach a later one's decays: a difference of sums would not
    take it out, NaN - NaN)."""
    if HAS_SEQ:
        L = tl.associative_scan((a, seq), 0, _add_within_sequence)[0]
    else:
        L = _block_log_decays(dt_row, a, t, t0, j, Q, seqlen, BLOCK_T, BLOCK_SUMS)[0]
    return L


@triton.jit
def _block_last(t0, j, Q, seqlen, BLOCK_T: tl.constexpr):
    """The last real token of the j-th block of the chunk starting at t0."""
    return tl.minimum(t0 + tl.minimum((j + 1) * BLOCK_T, Q), seqlen) - 1


@triton.jit
def _block_log_decays(dt_row, a, t, t0, j, Q, seqlen, BLOCK_T: tl.constexpr, BLOCK_SUMS: tl.constexpr):
    """(L, total) of the j-th block of the chunk starting at t0, its tokens t: the sums of a over the block up to
    each token (past its last real one, the block's sum, as a scan gives) and over the whole block; ssd_dt_kernel's
    (BLOCK_SUMS), or a scan and a sum of a."""
    if BLOCK_SUMS:
        t_last = _block_last(t0, j, Q, seqlen, BLOCK_T)
        L = tl.load(dt_row + seqlen + tl.minimum(t, t_last))
        total = tl.load(dt_row + seqlen + t_last)
    else:
        L = tl.cumsum(a, axis=0)
        total = tl.sum(a, axis=0)
    return L, total


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _tile(row, t, valid, s_t, cols, ncols, s_c):
    """(tokens, cols) float32 tile of a (seqlen, ncols) matrix."""
    return _raw_tile(row, t, valid, s_t, cols, ncols, s_c).to(tl.float32)


@triton.jit
def _raw_tile(row, t, valid, s_t, cols, ncols, s_c):
    """_tile in the matrix's own dtype (half the registers of a 16-bit one held across a loop)."""
    return tl.load(row + t[:, None] * s_t + cols[None, :] * s_c, mask=valid[:, None] & (cols < ncols)[None, :],
                   other=0.0)


@triton.jit
def _decay(L_l, L_s):
    """exp(L_l - L_s), rows l and columns s: the exponents go to base 2 on the vectors, so that an element takes a
    subtraction and one ex2 (`exp` on the difference: a multiply more each)."""
    return tl.exp2((L_l * LOG2E)[:, None] - (L_s * LOG2E)[None, :])


@triton.jit
def _decayed_own(P, L, seq, HAS_SEQ: tl.constexpr, BLOCK_T: tl.constexpr):
    """_decayed for a block's own tokens (rows l, columns s of one block, s <= l): the causal mask by position
    alone. Past seqlen, P (a product with C.B^T's zeros there) and dt are 0, and those tokens come after every
    real one: no validity mask."""
    pos = tl.arange(0, BLOCK_T)
    keep = pos[None, :] <= pos[:, None]
    if HAS_SEQ:
        keep = keep & (seq[:, None] == seq[None, :])
    return tl.where(keep, P * _decay(L, L), 0.0)


@triton.jit
def _decayed(P, L_l, L_s, t_l, t_s, valid_l, valid_s, seq_l, seq_s, STRICT: tl.constexpr):
    """P exp(L_l - L_s) for s <= l (s < l if STRICT) of the same sequence, else 0: (rows l, columns s).
    Selected, not multiplied by a 0/1 mask: past the diagonal the exponent is a positive sum that may
    overflow, and P may hold a later token's NaN (0 * inf = NaN)."""
    if STRICT:
        causal = t_s[None, :] < t_l[:, None]
    else:
        causal = t_s[None, :] <= t_l[:, None]
    keep = causal & valid_l[:, None] & valid_s[None, :] & (seq_l[:, None] == seq_s[None, :])
    return tl.where(keep, P * _decay(L_l, L_s), 0.0)


@triton.jit
def _state_tile(ptr, row, pp, nn, headdim, dstate):
    """The (pp, nn) tile of state `row` of a contiguous (rows, headdim, dstate) float32 buffer."""
    mask = (pp < headdim)[:, None] & (nn < dstate)[None, :]
    return tl.load(ptr + row.to(tl.int64) * headdim * dstate + pp[:, None] * dstate + nn[None, :], mask=mask, other=0.0)


@triton.jit
def _store_state_tile(ptr, row, pp, nn, headdim, dstate, value):
    mask = (pp < headdim)[:, None] & (nn < dstate)[None, :]
    tl.store(ptr + row.to(tl.int64) * headdim * dstate + pp[:, None] * dstate + nn[None, :], value, mask=mask)


@triton.jit
def _a_sum(dt_row, t_first, t_end, seqlen, s_dtt, bias, A, lo, hi, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
           SPAN: tl.constexpr):
    """The sum of a over the tokens t_first .. t_end - 1 (before seqlen; SPAN of them at most), from one load:
    a loop over their blocks waits for each block's load in turn, and inside a kernel's loop it keeps Triton's
    pipeliner off that loop (it pipelines innermost loops only)."""
    t = t_first + tl.arange(0, SPAN)
    return tl.sum(_dt(dt_row, t, (t < t_end) & (t < seqlen), s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)[1], axis=0)


@triton.jit
def _log_decay_through(t0, e, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi,
                       SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, CHUNK_TOKENS: tl.constexpr):
    """L_e: the sum of a over the tokens t0 .. e of the Q from t0."""
    return _a_sum(dt_row, t0, tl.minimum(e + 1, t0 + Q), seqlen, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT,
                  CHUNK_TOKENS)


@triton.jit
def _block_state_part(t0, jb, e, after, seq_e, Q, seqlen, x_row, dt_row, B_row, seq_row, bias, A, lo, hi,
                      pp, nn, headdim, dstate, s_xt, s_xp, s_dtt, s_Bt, s_Bn, s_seqt,
                      SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_SEQ: tl.constexpr, DOT_F32: tl.constexpr,
                      BLOCK_T: tl.constexpr):
    """Block jb of the chunk starting at t0, through token e: its tokens' part of the state after e,
    sum_s exp(L_e - L_s) dt_s X_s B_s^T over the tokens of e's sequence, with `after` the sum of a over the
    blocks after it through e; and its own sum of a."""
    t, valid = _block(t0, jb, Q, seqlen, BLOCK_T)
    valid = valid & (t <= e)
    dt, a = _dt(dt_row, t, valid, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)
    to_e = after + tl.cumsum(a, axis=0, reverse=True) - a
    keep = valid & (_seq(seq_row, t, valid, s_seqt, HAS_SEQ) == seq_e)
    weight = tl.where(keep, dt * exp(to_e), 0.0)
    X = _tile(x_row, t, valid, s_xt, pp, headdim, s_xp) * weight[:, None]
    Bt = _tile(B_row, t, valid, s_Bt, nn, dstate, s_Bn)
    if HAS_SEQ:  # the tokens of other sequences are selected out of both operands: they may hold a NaN or inf
        X = tl.where(keep[:, None], X, 0.0)
        Bt = tl.where(keep[:, None], Bt, 0.0)
    return _dot(tl.trans(_operand(X, x_row, DOT_F32)), _operand(Bt, x_row, DOT_F32), DOT_F32), tl.sum(a, axis=0)


@triton.jit
def _chunk_part(t0, e, seq_e, Q, seqlen, x_row, dt_row, B_row, seq_row, bias, A, lo, hi,
                pp, nn, headdim, dstate, s_xt, s_xp, s_dtt, s_Bt, s_Bn, s_seqt,
                SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_SEQ: tl.constexpr, DOT_F32: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (pp, nn) tile of the chunk's own part of the state after its token e (the tokens t0 .. e of e's
    sequence, from a zero state), and the sum of a over them, `after`: the state entering the chunk reaches e
    as exp(after) times itself. The blocks are walked back from e, so that each exponent L_e - L_s is summed
    over (s, e] directly: as a difference of sums from the chunk start it would carry their rounding, eps |L|."""
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    after = 0.0  # the sum of a over the blocks after this one, through e
    nblocks = tl.cdiv(e - t0 + 1, BLOCK_T)
    for jj in range(0, nblocks):
        part, a_sum = _block_state_part(t0, nblocks - 1 - jj, e, after, seq_e, Q, seqlen, x_row, dt_row, B_row,
                                        seq_row, bias, A, lo, hi, pp, nn, headdim, dstate, s_xt, s_xp, s_dtt, s_Bt,
                                        s_Bn, s_seqt, SOFTPLUS, HAS_LIMIT, HAS_SEQ, DOT_F32, BLOCK_T)
        acc += part
        after += a_sum
    return acc, after


@triton.jit
def _carried(state, after, seq_e, seq_before, HAS_SEQ: tl.constexpr):
    """What a state entering a chunk adds to the state after its token e: itself decayed by `after`, the sum of
    a through e; nothing if e is of another sequence than the token before the chunk (selected: a NaN state
    must not reach another sequence)."""
    kept = exp(after) * state
    if HAS_SEQ:
        kept = tl.where(seq_e == seq_before, kept, 0.0)
    return kept


@triton.jit
def _state_at(state, t0, e, seq_before, Q, seqlen, x_row, dt_row, B_row, seq_row, bias, A, lo, hi,
              pp, nn, headdim, dstate, s_xt, s_xp, s_dtt, s_Bt, s_Bn, s_seqt,
              SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_SEQ: tl.constexpr, DOT_F32: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """H_e, the (pp, nn) tile of the state after token e of the chunk starting at t0 that `state` enters."""
    seq_e = _seq_at(seq_row, e, s_seqt, HAS_SEQ)
    part, after = _chunk_part(t0, e, seq_e, Q, seqlen, x_row, dt_row, B_row, seq_row, bias, A, lo, hi, pp, nn,
                              headdim, dstate, s_xt, s_xp, s_dtt, s_Bt, s_Bn, s_seqt, SOFTPLUS, HAS_LIMIT, HAS_SEQ,
                              DOT_F32, BLOCK_T, BLOCK_P, BLOCK_N)
    return _carried(state, after, seq_e, seq_before, HAS_SEQ) + part


@triton.jit
def _batch_head(pid_bh, nheads):
    """(batch, head) of a program. Index helpers take no pointer: torch's analysis of which arguments a
    kernel writes follows a stored-to address back through the whole call that made it, so an index
    that addresses an output must not come out of a call that also takes the inputs."""
    return (pid_bh // nheads).to(tl.int64), pid_bh % nheads


@triton.jit
def _head(b, h, heads_per_group, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, bias_ptr, seq_ptr,
          s_xb, s_xh, s_dtb, s_dth, s_Bb, s_Bg, s_Cb, s_Cg, s_seqb, HAS_BIAS: tl.constexpr):
    """Where (batch b, head h)'s rows of x, dt, B, C and seq_idx start, its dt_bias and A."""
    g = h // heads_per_group
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h).to(tl.float32)
    return (x_ptr + b * s_xb + h * s_xh, dt_ptr + b * s_dtb + h * s_dth, B_ptr + b * s_Bb + g * s_Bg,
            C_ptr + b * s_Cb + g * s_Cg, seq_ptr + b * s_seqb, bias, tl.load(A_ptr + h))


@triton.jit
def _D_row(D_ptr, h, pp, headdim, s_Dh, HAS_D: tl.constexpr, D_CHANNEL: tl.constexpr, BLOCK_P: tl.constexpr):
    """D of head h for the channels pp, float32 (D per head or per channel; 0 without D)."""
    D_p = tl.zeros([BLOCK_P], dtype=tl.float32)
    if HAS_D:
        if D_CHANNEL:
            D_p = tl.load(D_ptr + h * s_Dh + pp, mask=pp < headdim, other=0.0).to(tl.float32)
        else:
            D_p += tl.load(D_ptr + h).to(tl.float32)
    return D_p


@triton.jit
def ssd_dt_kernel(
    dt_ptr, bias_ptr, A_ptr, out_ptr, seqlen, nheads, Q, blocks_per_chunk, lo, hi, s_dtb, s_dtt, s_dth,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Grid (nchunks * blocks_per_chunk, batch * nheads): a block of BLOCK_T tokens of one chunk. dt after
    dt_bias, softplus and the clamp, float32, and behind it the sums of a = dt A over each block up to each of
    its tokens (the log decays from the block's start), into out (batch, nheads, 2 seqlen) contiguous: the
    other kernels read a block of one head's dt as one contiguous row (in dt itself, its tokens lie nheads
    apart: a 32-byte sector each) and compute no softplus, and the output and dX loops read the sums rather than
    scan every trip (a cumsum over the block takes lane shuffles and barriers)."""
    b, h = _batch_head(tl.program_id(1), nheads)
    t, valid = _block(tl.program_id(0) // blocks_per_chunk * Q, tl.program_id(0) % blocks_per_chunk, Q, seqlen,
                      BLOCK_T)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h).to(tl.float32)
    dt = _dt_steps(dt_ptr + b * s_dtb + h * s_dth, t, valid, s_dtt, bias, lo, hi, SOFTPLUS, HAS_LIMIT)[2]
    row = out_ptr + (b * nheads + h) * 2 * seqlen
    tl.store(row + t, dt, mask=valid)
    tl.store(row + seqlen + t, tl.cumsum(dt * tl.load(A_ptr + h), axis=0), mask=valid)


@triton.jit
def ssd_chunk_states_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, bias_ptr, seq_ptr, parts_ptr, decays_ptr,
    seqlen, nheads, headdim, dstate, Q, nchunks, heads_per_group, lo, hi, tiles,
    s_xb, s_xt, s_xh, s_xp, s_dtb, s_dtt, s_dth, s_Bb, s_Bt, s_Bg, s_Bn, s_seqb, s_seqt,
    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (nchunks * tiles, batch * nheads): a (headdim, dstate) tile of one chunk of one (batch, head). The
    chunk's own part of the state after it (_chunk_part) into parts (batch, nchunks * nheads, headdim, dstate)
    float32, and from each chunk's first tile the sum of a through its end into decays (batch, nchunks,
    nheads) float32: every chunk at once, where the state passing that follows is element-wise."""
    c = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    tiles_n = tl.cdiv(dstate, BLOCK_N)
    pp = (tile // tiles_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    b, h = _batch_head(tl.program_id(1), nheads)
    x_row, dt_row, B_row, _, seq_row, bias, A = _head(
        b, h, heads_per_group, x_ptr, dt_ptr, A_ptr, B_ptr, B_ptr, bias_ptr, seq_ptr,
        s_xb, s_xh, s_dtb, s_dth, s_Bb, s_Bg, s_Bb, s_Bg, s_seqb, HAS_BIAS)
    t0 = c * Q
    e = tl.minimum(t0 + Q, seqlen) - 1
    part, after = _chunk_part(t0, e, _seq_at(seq_row, e, s_seqt, HAS_SEQ), Q, seqlen, x_row, dt_row, B_row,
                              seq_row, bias, A, lo, hi, pp, nn, headdim, dstate, s_xt, s_xp, s_dtt, s_Bt, s_Bn,
                              s_seqt, SOFTPLUS, HAS_LIMIT, HAS_SEQ, DOT_F32, BLOCK_T, BLOCK_P, BLOCK_N)
    row = (b * nchunks + c) * nheads + h
    _store_state_tile(parts_ptr, row, pp, nn, headdim, dstate, part)
    tl.store(decays_ptr + row, after, mask=tile == 0)


@triton.jit
def ssd_state_passing_kernel(
    states_ptr, states16_ptr, decays_ptr, init_ptr, seq_ptr, final_ptr,
    seqlen, nheads, headdim, dstate, Q, nchunks, s_seqb, s_seqt, s_ib, s_ih, s_ip, s_in,
    HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (state tiles, batch * nheads): the chunks' sequential part, element-wise. Walks the chunks in order,
    reading each one's own part (ssd_chunk_states_kernel's, in states) and writing in its place the state
    entering it (chunk_states, float32, and for 16-bit GEMM operands a copy in that dtype, which the output
    kernel reads), then carrying the state on; the last one is final (batch, nheads, headdim, dstate).
    mamba_ssm passes its chunks' states likewise; a walk of GEMMs over the chunks, a (batch, head) a program,
    left most of a GPU's SMs idle and waited for its loads at every chunk."""
    tiles_n = tl.cdiv(dstate, BLOCK_N)
    pp = (tl.program_id(0) // tiles_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    b, h = _batch_head(tl.program_id(1), nheads)
    seq_row = seq_ptr + b * s_seqb
    if HAS_INIT:
        state = tl.load(init_ptr + b * s_ib + h * s_ih + pp[:, None] * s_ip + nn[None, :] * s_in,
                        mask=(pp < headdim)[:, None] & (nn < dstate)[None, :], other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for c in range(0, nchunks):
        row = (b * nchunks + c) * nheads + h
        part = _state_tile(states_ptr, row, pp, nn, headdim, dstate)
        after = tl.load(decays_ptr + row)
        t0 = c * Q
        seq_e = _seq_at(seq_row, tl.minimum(t0 + Q, seqlen) - 1, s_seqt, HAS_SEQ)
        seq_before = _seq_at(seq_row, t0 - 1, s_seqt, HAS_SEQ)
        _store_state_tile(states_ptr, row, pp, nn, headdim, dstate, state)
        if not DOT_F32:
            _store_state_tile(states16_ptr, row, pp, nn, headdim, dstate, state.to(states16_ptr.dtype.element_ty))
        state = _carried(state, after, seq_e, seq_before, HAS_SEQ) + part
    _store_state_tile(final_ptr, b * nheads + h, pp, nn, headdim, dstate, state)


@triton.jit
def ssd_varlen_states_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, bias_ptr, seq_ptr, cu_ptr, states_ptr, varlen_ptr,
    seqlen, nheads, headdim, dstate, Q, nchunks, heads_per_group, lo, hi,
    s_xt, s_xh, s_xp, s_dtt, s_dth, s_Bt, s_Bg, s_Bn, s_seqt,
    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (state tiles, nseq * nheads); batch 1. varlen (nseq, nheads, headdim, dstate) contiguous
    float32: the state after each sequence's last token, cu_seqlens[i + 1] - 1."""
    tiles_n = tl.cdiv(dstate, BLOCK_N)
    pp = (tl.program_id(0) // tiles_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.program_id(1) // nheads
    h = tl.program_id(1) % nheads
    x_row, dt_row, B_row, _, seq_row, bias, A = _head(
        0, h, heads_per_group, x_ptr, dt_ptr, A_ptr, B_ptr, B_ptr, bias_ptr, seq_ptr,
        0, s_xh, 0, s_dth, 0, s_Bg, 0, s_Bg, 0, HAS_BIAS)
    e = tl.load(cu_ptr + i + 1).to(tl.int32) - 1
    c = tl.maximum(e, 0) // Q  # (an empty first sequence ends before token 0: chunk 0's entering state)
    t0 = c * Q
    state = _state_tile(states_ptr, c * nheads + h, pp, nn, headdim, dstate)
    state = _state_at(state, t0, e, _seq_at(seq_row, t0 - 1, s_seqt, HAS_SEQ), Q, seqlen, x_row, dt_row, B_row,
                      seq_row, bias, A, lo, hi, pp, nn, headdim, dstate, s_xt, s_xp, s_dtt, s_Bt, s_Bn, s_seqt,
                      SOFTPLUS, HAS_LIMIT, HAS_SEQ, DOT_F32, BLOCK_T, BLOCK_P, BLOCK_N)
    _store_state_tile(varlen_ptr, i * nheads + h, pp, nn, headdim, dstate, state)


@triton.jit
def ssd_cb_kernel(
    B_ptr, C_ptr, cb_ptr, seqlen, ngroups, Q, nchunks, blocks_per_chunk,
    s_Bb, s_Bt, s_Bg, s_Bn, s_Cb, s_Ct, s_Cg, s_Cn, dstate,
    DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (nchunks * blocks_per_chunk, batch * ngroups). Writes the row block's C_l . B_s for the chunk's
    column blocks up to its own into cb, contiguous (batch, nchunks, ngroups, Qp, Qp) in the GEMMs' operand
    dtype with
    Qp = blocks_per_chunk * BLOCK_T (blocks past the diagonal are left unwritten: never read). Once per
    group, where the output kernel would compute it again for each of the group's heads and channel blocks."""
    c = tl.program_id(0) // blocks_per_chunk
    i = tl.program_id(0) % blocks_per_chunk
    b = (tl.program_id(1) // ngroups).to(tl.int64)
    g = tl.program_id(1) % ngroups
    nn = tl.arange(0, BLOCK_N)
    t0 = c * Q
    t_l, valid_l = _block(t0, i, Q, seqlen, BLOCK_T)
    C_l = _operand(_tile(C_ptr + b * s_Cb + g * s_Cg, t_l, valid_l, s_Ct, nn, dstate, s_Cn), C_ptr, DOT_F32)
    Qp = blocks_per_chunk * BLOCK_T
    rows = i * BLOCK_T + tl.arange(0, BLOCK_T)
    tile = ((b * nchunks + c) * ngroups + g) * Qp * Qp + rows[:, None] * Qp
    for j in range(0, i + 1):
        t_s, valid_s = _block(t0, j, Q, seqlen, BLOCK_T)
        B_s = _operand(_tile(B_ptr + b * s_Bb + g * s_Bg, t_s, valid_s, s_Bt, nn, dstate, s_Bn), C_ptr, DOT_F32)
        cols = j * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(cb_ptr + tile + cols[None, :], _dot(C_l, tl.trans(B_s), DOT_F32).to(cb_ptr.dtype.element_ty))


@triton.jit
def ssd_chunk_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr, states_ptr, cb_ptr, out_ptr, ungated_ptr,
    seqlen, nheads, headdim, dstate, Q, nchunks, heads_per_group, lo, hi, blocks_per_chunk,
    s_xb, s_xt, s_xh, s_xp, s_dtb, s_dtt, s_dth, s_Bb, s_Bt, s_Bg, s_Bn, s_Cb, s_Ct, s_Cg, s_Cn,
    s_zb, s_zt, s_zh, s_zp, s_seqb, s_seqt, s_Dh,
    HAS_D: tl.constexpr, D_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SEQ: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_F32: tl.constexpr,
    KEEP_UNGATED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK_TOKENS: tl.constexpr, BLOCK_SUMS: tl.constexpr,
):
    """Grid (nchunks * blocks_per_chunk, batch * nheads, channel blocks). Writes out, and with HAS_Z and
    KEEP_UNGATED the output before the gate into ungated (both x's layout, contiguous, in out's dtype).
    cb: ssd_cb_kernel's C . B^T. BLOCK_SUMS: dt is ssd_dt_kernel's, with its sums of a over blocks of BLOCK_T."""
    c = tl.program_id(0) // blocks_per_chunk
    i = tl.program_id(0) % blocks_per_chunk
    b, h = _batch_head(tl.program_id(1), nheads)
    x_row, dt_row, B_row, C_row, seq_row, bias, A = _head(
        b, h, heads_per_group, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, bias_ptr, seq_ptr,
        s_xb, s_xh, s_dtb, s_dth, s_Bb, s_Bg, s_Cb, s_Cg, s_seqb, HAS_BIAS)
    pp = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    t0 = c * Q
    # the log decay from the chunk start to this block
    run = _log_decay_from(t0, 0, i, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT, BLOCK_T,
                          CHUNK_TOKENS, BLOCK_SUMS)
    t_l, valid_l = _block(t0, i, Q, seqlen, BLOCK_T)
    dt_l, a_l = _dt(dt_row, t_l, valid_l, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)
    seq_l = _seq(seq_row, t_l, valid_l, s_seqt, HAS_SEQ)
    L_l = _log_decays(a_l, seq_l, dt_row, t_l, t0, i, Q, seqlen, HAS_SEQ, BLOCK_T, BLOCK_SUMS)  # from the block start
    seq_first = _seq_at(seq_row, tl.minimum(t0 + i * BLOCK_T, seqlen - 1), s_seqt, HAS_SEQ)  # the row block's first
    seq_before = _seq_at(seq_row, t0 - 1, s_seqt, HAS_SEQ)
    D_p = _D_row(D_ptr, h, pp, headdim, s_Dh, HAS_D, D_CHANNEL, BLOCK_P)  # (at the end: a latency after the GEMMs)
    y = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
    # the chunk's tokens before this block, through C B^T decayed, walked back from it so that L_l - L_s is
    # summed over the blocks between (see _state_at); then the block's own tokens. dt_s scales the columns of
    # the decayed C B^T, not the rows of x: an earlier block's x tile goes from its load to the GEMM as it is
    # (scaling it took a round trip through registers and shared memory a trip). With seq_idx only the row
    # block's first sequence reaches it from earlier blocks, and the product spreads a NaN or inf to every row
    # (0 * NaN): their tokens of other sequences are selected out of X_s, and once they are summed, the rows of
    # the block's later sequences.
    Qp = blocks_per_chunk * BLOCK_T
    cb_tile = ((b * nchunks + c) * (nheads // heads_per_group) + h // heads_per_group) * Qp * Qp
    cb_rows = cb_ptr + cb_tile + (i * BLOCK_T + tl.arange(0, BLOCK_T))[:, None] * Qp
    between = 0.0  # the sum of a over the blocks between the column block and the row block
    for jj in range(1, i + 1):
        t_s, valid_s = _block(t0, i - jj, Q, seqlen, BLOCK_T)
        dt_s, a_s = _dt(dt_row, t_s, valid_s, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)
        # relative to the row block's start; with seq_idx summed back over (s, row block) directly: from this
        # block's start the sum would carry the a of the tokens before s, those of another sequence too
        if HAS_SEQ:
            L_s = -(between + tl.cumsum(a_s, axis=0, reverse=True) - a_s)
        sums_s, total_s = _block_log_decays(dt_row, a_s, t_s, t0, i - jj, Q, seqlen, BLOCK_T, BLOCK_SUMS)
        between += total_s
        if not HAS_SEQ:
            L_s = sums_s - between
        # (every token of an earlier block is real where a row is, and comes before it: no causal mask; the
        # rows past seqlen are not stored)
        CB = tl.load(cb_rows + ((i - jj) * BLOCK_T + tl.arange(0, BLOCK_T))[None, :]).to(tl.float32)
        M = CB * _decay(L_l, L_s) * dt_s[None, :]
        X_s = _raw_tile(x_row, t_s, valid_s, s_xt, pp, headdim, s_xp)
        if HAS_SEQ:
            seq_s = _seq(seq_row, t_s, valid_s, s_seqt, HAS_SEQ)
            M = tl.where(seq_l[:, None] == seq_s[None, :], M, 0.0)
            X_s = tl.where((seq_s == seq_first)[:, None], X_s, 0.0)
        y += _dot(_operand(M, x_ptr, DOT_F32), _operand(X_s, x_ptr, DOT_F32), DOT_F32)
    # the row block's x and z, for its own tokens' product and the end, and C and the state entering the chunk:
    # loaded after the loop, whose registers they would take, in one latency with the block's own C.B^T tile.
    # (The state's product came first: the loop's first loads waited for it, a latency more a program.)
    x_raw = _raw_tile(x_row, t_l, valid_l, s_xt, pp, headdim, s_xp)
    z_raw = x_raw
    if HAS_Z:
        z_raw = _raw_tile(z_ptr + b * s_zb + h * s_zh, t_l, valid_l, s_zt, pp, headdim, s_zp)
    CB = tl.load(cb_rows + (i * BLOCK_T + tl.arange(0, BLOCK_T))[None, :]).to(tl.float32)  # (written whole)
    C_l = _operand(_tile(C_row, t_l, valid_l, s_Ct, nn, dstate, s_Cn), x_ptr, DOT_F32)
    # the entering state, read by C and decayed to each token of the sequence before the chunk
    state = _state_tile(states_ptr, (b * nchunks + c) * nheads + h, pp, nn, headdim, dstate)
    if HAS_SEQ:  # (selected: a NaN state of the sequence before must not reach another through the product)
        state = tl.where(seq_first == seq_before, state, 0.0)
    # the row block's own tokens. A NaN or inf in its x dt must reach its rows s and after only, but the product
    # meets it with the zeros above the diagonal too (0 * NaN = NaN): there it enters as 0, and reaches its rows
    # below
    x_l = x_raw.to(tl.float32)
    finite = x_l * dt_l[:, None] * 0.0 == 0.0
    M = _decayed_own(CB * dt_l[None, :], L_l, seq_l, HAS_SEQ, BLOCK_T)
    w_l = tl.where(valid_l & (seq_l == seq_before), exp(run + L_l), 0.0)
    y += _dot(C_l, tl.trans(_operand(state, x_ptr, DOT_F32)), DOT_F32) * w_l[:, None]
    if HAS_SEQ:
        y = tl.where((seq_l == seq_first)[:, None], y, 0.0)
    y += _dot(_operand(M, x_ptr, DOT_F32), _operand(tl.where(finite, x_l, 0.0), x_ptr, DOT_F32), DOT_F32)
    if HAS_SEQ:  # the row block's NaN and inf, to the rows whose sequence is the last with one up to them: NaN
        last_bad = tl.associative_scan(tl.where(finite, -1, seq_l[:, None]), 0, _maximum)
        y = tl.where(last_bad == seq_l[:, None], float("nan"), y)
    else:  # the row block's NaN and inf, to its rows from theirs on (one reduction: a scan here was 736 of the
        # program's ~3,200 instructions on sm_90)
        rows = tl.arange(0, BLOCK_T)
        first_bad = tl.min(tl.where(finite, BLOCK_T, rows[:, None]), axis=0)
        y = tl.where(rows[:, None] >= first_bad[None, :], float("nan"), y)
    if HAS_D:
        y += D_p[None, :] * x_l
    mask = valid_l[:, None] & (pp < headdim)[None, :]
    # out and ungated are contiguous like x: (batch, seqlen, nheads, headdim)
    offsets = ((b * seqlen + t_l[:, None]) * nheads + h) * headdim + pp[None, :]
    if HAS_Z:
        if KEEP_UNGATED:
            tl.store(ungated_ptr + offsets, y.to(ungated_ptr.dtype.element_ty), mask=mask)
        zv = z_raw.to(tl.float32)
        y = y * zv * sigmoid(zv)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ssd_gate_grad_kernel(
    dout_ptr, z_ptr, ungated_ptr, dz_ptr, gated_ptr, seqlen, nheads, headdim,
    s_gb, s_gt, s_gh, s_gp, s_zb, s_zt, s_zh, s_zp, s_ub, s_ut, s_uh, s_up,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Grid (cdiv(seqlen, BLOCK_T), batch * nheads). Through the gate out = y * silu(z), from y before it
    (ungated): dz = dout y silu'(z), and into gated dout * silu(z), the gradient of y (x's layout, contiguous,
    in the backward's GEMM operand dtype: what the dX and dB/dC passes multiply)."""
    b, h = _batch_head(tl.program_id(1), nheads)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = t < seqlen
    pp = tl.arange(0, BLOCK_P)
    dout = _tile(dout_ptr + b * s_gb + h * s_gh, t, valid, s_gt, pp, headdim, s_gp)
    zv = _tile(z_ptr + b * s_zb + h * s_zh, t, valid, s_zt, pp, headdim, s_zp)
    y = _tile(ungated_ptr + b * s_ub + h * s_uh, t, valid, s_ut, pp, headdim, s_up)
    sig = sigmoid(zv)
    offsets = ((b * seqlen + t[:, None]) * nheads + h) * headdim + pp[None, :]
    mask = valid[:, None] & (pp < headdim)[None, :]
    tl.store(gated_ptr + offsets, (dout * zv * sig).to(gated_ptr.dtype.element_ty), mask=mask)
    tl.store(dz_ptr + offsets, (dout * y * sig * (1.0 + zv * (1.0 - sig))).to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ssd_state_grads_kernel(
    dt_ptr, A_ptr, C_ptr, bias_ptr, seq_ptr, gated_ptr, dfinal_ptr, dvarlen_ptr, cu_ptr, first_ptr,
    dends_ptr, dinit_ptr, states_ptr, states16_ptr, dends16_ptr,
    seqlen, nheads, headdim, dstate, Q, nchunks, heads_per_group, lo, hi,
    s_dtb, s_dtt, s_dth, s_Cb, s_Ct, s_Cg, s_Cn, s_yb, s_yt, s_yh, s_yp, s_seqb, s_seqt,
    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_DVARLEN: tl.constexpr, HAS_INIT: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK_TOKENS: tl.constexpr, BLOCK_SUMS: tl.constexpr,
):
    """Grid (state tiles, batch * nheads). From gated, the gradient of the output before the gate
    (ssd_gate_grad_kernel's), writes dends (batch, nchunks * nheads, headdim, dstate): the
    gradient of the state after each chunk, and dinit, the gradient of the state entering chunk 0
    (both contiguous float32). dfinal and dvarlen are contiguous float32; first[c] is the first
    varlen sequence ending in chunk c or later. With 16-bit GEMM operands (not DOT_F32) it also writes
    dends and the chunk states (states, float32) in that dtype, as the backward's GEMMs take them, into
    dends16 and states16 (contiguous, like dends): the chunk passes then read half the bytes of what
    each of their programs reads whole, the same values their GEMMs rounded them to."""
    tiles_n = tl.cdiv(dstate, BLOCK_N)
    pp = (tl.program_id(0) // tiles_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    b, h = _batch_head(tl.program_id(1), nheads)
    _, dt_row, _, C_row, seq_row, bias, A = _head(
        b, h, heads_per_group, dt_ptr, dt_ptr, A_ptr, C_ptr, C_ptr, bias_ptr, seq_ptr,
        0, 0, s_dtb, s_dth, s_Cb, s_Cg, s_Cb, s_Cg, s_seqb, HAS_BIAS)
    gated_row = gated_ptr + b * s_yb + h * s_yh
    if HAS_DFINAL:
        grad = _state_tile(dfinal_ptr, b * nheads + h, pp, nn, headdim, dstate)
    else:
        grad = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for cc in range(0, nchunks):
        c = nchunks - 1 - cc
        row = (b * nchunks + c) * nheads + h
        _store_state_tile(dends_ptr, row, pp, nn, headdim, dstate, grad)
        if not DOT_F32:
            _store_state_tile(dends16_ptr, row, pp, nn, headdim, dstate, grad.to(dends16_ptr.dtype.element_ty))
            _store_state_tile(states16_ptr, row, pp, nn, headdim, dstate,
                              _state_tile(states_ptr, row, pp, nn, headdim, dstate).to(states16_ptr.dtype.element_ty))
        t0 = c * Q
        seq_before = _seq_at(seq_row, t0 - 1, s_seqt, HAS_SEQ)
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        run = 0.0
        for j in range(0, tl.cdiv(tl.minimum(Q, seqlen - t0), BLOCK_T)):
            t, valid = _block(t0, j, Q, seqlen, BLOCK_T)
            a = _dt(dt_row, t, valid, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)[1]
            sums, total = _block_log_decays(dt_row, a, t, t0, j, Q, seqlen, BLOCK_T, BLOCK_SUMS)
            L = run + sums
            run += total
            keep = valid & (_seq(seq_row, t, valid, s_seqt, HAS_SEQ) == seq_before)
            dy = _tile(gated_row, t, valid, s_yt, pp, headdim, s_yp) * tl.where(keep, exp(L), 0.0)[:, None]
            C_t = _tile(C_row, t, valid, s_Ct, nn, dstate, s_Cn)
            if HAS_SEQ:  # the other sequences' rows are selected out of both operands: either may hold a NaN
                dy = tl.where(keep[:, None], dy, 0.0)
                C_t = tl.where(keep[:, None], C_t, 0.0)
            acc += _dot(tl.trans(_operand(dy, C_ptr, DOT_F32)), _operand(C_t, C_ptr, DOT_F32), DOT_F32)
        if HAS_DVARLEN:
            for i in range(tl.load(first_ptr + c), tl.load(first_ptr + c + 1)):
                e = tl.load(cu_ptr + i + 1).to(tl.int32) - 1
                L_e = _log_decay_through(t0, e, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT,
                                         CHUNK_TOKENS)
                acc += tl.where(_seq_at(seq_row, e, s_seqt, HAS_SEQ) == seq_before,
                                exp(L_e) * _state_tile(dvarlen_ptr, i * nheads + h, pp, nn, headdim, dstate), 0.0)
        seq_end = _seq_at(seq_row, tl.minimum(t0 + Q, seqlen) - 1, s_seqt, HAS_SEQ)
        # (selected: the gradient of a later sequence's state, NaN perhaps, must not reach an earlier one)
        grad = tl.where(seq_end == seq_before, exp(run) * grad, 0.0) + acc
    if HAS_INIT:
        _store_state_tile(dinit_ptr, b * nheads + h, pp, nn, headdim, dstate, grad)


@triton.jit
def _add_at(ptr, value):
    """*ptr += value, a scalar of this program's own (one thread stores what it read)."""
    tl.store(ptr, tl.load(ptr) + value)


@triton.jit
def _store_rows(ptr, row0, t, valid, cols, ncols, value):
    """value (tokens, cols) into rows row0 + t of a contiguous (rows, ncols) buffer."""
    tl.store(ptr + (row0 + t[:, None]) * ncols + cols[None, :], value.to(ptr.dtype.element_ty),
             mask=valid[:, None] & (cols < ncols)[None, :])


@triton.jit
def _chunk_program(b, h, t0, heads_per_group, Q, seqlen, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, bias_ptr, seq_ptr,
                   s_xb, s_xh, s_dtb, s_dth, s_Bb, s_Bg, s_Cb, s_Cg, s_seqb, s_seqt, HAS_BIAS: tl.constexpr,
                   HAS_SEQ: tl.constexpr):
    """What the backward's chunk kernels read for (batch b, head h, chunk c from token t0): _head's rows, and
    the sequence before the chunk and at its end."""
    x_row, dt_row, B_row, C_row, seq_row, bias, A = _head(
        b, h, heads_per_group, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, bias_ptr, seq_ptr,
        s_xb, s_xh, s_dtb, s_dth, s_Bb, s_Bg, s_Cb, s_Cg, s_seqb, HAS_BIAS)
    return (x_row, dt_row, B_row, C_row, seq_row, bias, A, _seq_at(seq_row, t0 - 1, s_seqt, HAS_SEQ),
            _seq_at(seq_row, tl.minimum(t0 + Q, seqlen) - 1, s_seqt, HAS_SEQ))


@triton.jit
def _chunk_rows(b, h, c, nheads, nchunks, seqlen):
    """(batch b, head h, chunk c)'s row of the chunk states, its scratch row and its token-0 output row
    (indices only: see _batch_head)."""
    return (b * nchunks + c) * nheads + h, (b * nheads + h) * seqlen, b * seqlen * nheads + h


@triton.jit
def _end_decays(t0, j, nblocks, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi, a_s, valid_s, seq_s, seq_end,
                SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK_TOKENS: tl.constexpr,
                BLOCK_SUMS: tl.constexpr):
    """(ends, v) of block j's tokens s: which are of the sequence of the chunk's last token, and v_s = exp(L_end -
    L_s) for those (0 else), the exponent summed from s on (a difference of sums from the block start would take
    an earlier sequence's NaN dt in, NaN - NaN)."""
    to_end = _log_decay_from(t0, j + 1, nblocks, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT,
                             BLOCK_T, CHUNK_TOKENS, BLOCK_SUMS) + tl.cumsum(a_s, axis=0, reverse=True) - a_s
    ends = valid_s & (seq_s == seq_end)
    return ends, tl.where(ends, exp(to_end), 0.0)


@triton.jit
def _varlen_parts(acc, op, j, c, t0, h, nheads, Q, seqlen, headdim, dstate, t_s, valid_s, seq_s, a_s, dt_row,
                  seq_row, cu_ptr, first_ptr, dvarlen_ptr, x_ptr, bias, A, lo, hi, pp, nn, s_dtt, s_seqt,
                  DX: tl.constexpr, HAS_SEQ: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                  DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK_TOKENS: tl.constexpr):
    """acc plus the parts of the varlen states that end in chunk c, for block j's tokens s: v_e op dV_e (op: B_s
    for dX, X_s for dB), v_e = exp(L_e - L_s) for s <= e of e's sequence, the exponent summed from s on; the
    other tokens' products selected out (dV may hold a NaN)."""
    start = (j + 1) * BLOCK_T
    for k in range(tl.load(first_ptr + c), tl.load(first_ptr + c + 1)):
        e = tl.load(cu_ptr + k + 1).to(tl.int32) - 1
        ends = valid_s & (t_s <= e) & (seq_s == _seq_at(seq_row, e, s_seqt, HAS_SEQ))
        # over (s, e]: the block's tokens after s, then those after the block
        a_e = tl.where(t_s <= e, a_s, 0.0)
        to_e = tl.cumsum(a_e, axis=0, reverse=True) - a_e + _log_decay_through(
            t0 + start, e, Q - start, seqlen, dt_row, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT, CHUNK_TOKENS)
        dV = _operand(_state_tile(dvarlen_ptr, k * nheads + h, pp, nn, headdim, dstate), x_ptr, DOT_F32)
        if DX:
            part = _dot(op, tl.trans(dV), DOT_F32)
        else:
            part = _dot(op, dV, DOT_F32)
        acc += tl.where(ends[:, None], part * exp(to_e)[:, None], 0.0)
    return acc


@triton.jit
def ssd_bwd_dx_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, seq_ptr, dends_ptr, cb_ptr, gated_ptr, dvarlen_ptr, cu_ptr,
    first_ptr, dx_ptr, dD_ptr, R_ptr, xdx_ptr,
    seqlen, nheads, headdim, dstate, Q, nchunks, heads_per_group, lo, hi, blocks_per_chunk, cb_side,
    s_xb, s_xt, s_xh, s_xp, s_dtb, s_dtt, s_dth, s_Bb, s_Bt, s_Bg, s_Bn, s_Cb, s_Ct, s_Cg, s_Cn,
    s_yb, s_yt, s_yh, s_yp, s_seqb, s_seqt, s_Dh,
    HAS_D: tl.constexpr, D_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    HAS_DVARLEN: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK_TOKENS: tl.constexpr, BLOCK_SUMS: tl.constexpr,
):
    """Grid (nchunks * blocks_per_chunk, batch * nheads): a block of tokens s of one chunk of one head,
    dX_s = sum_{l >= s} M_ls dy_l (M_ls = (C_l . B_s) exp(L_l - L_s)) + the state outputs' parts. Writes
    dx (x's layout, contiguous), the partial dD (batch, nchunks, blocks_per_chunk, nheads, headdim) and,
    into scratch rows, x_s . dX_s and R_s = v_s X_s . (dE B_s), the end state's part of the log-decay
    gradient (see ssd_bwd_ddt_kernel).

    The loop, and the end (D's part), read dy, the gradient of y before the gate, from gated: written by
    ssd_gate_grad_kernel (dout itself without z), so that they load one tile, not dout's and z's, and compute
    no gate: done per trip in the operand's layout, the gate took two thirds of the loop's instructions (sm_90:
    476 instructions; 196 without)."""
    c = tl.program_id(0) // blocks_per_chunk
    j = tl.program_id(0) % blocks_per_chunk
    b, h = _batch_head(tl.program_id(1), nheads)
    t0 = c * Q
    x_row, dt_row, B_row, C_row, seq_row, bias, A, seq_before, seq_end = _chunk_program(
        b, h, t0, heads_per_group, Q, seqlen, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, bias_ptr, seq_ptr,
        s_xb, s_xh, s_dtb, s_dth, s_Bb, s_Bg, s_Cb, s_Cg, s_seqb, s_seqt, HAS_BIAS, HAS_SEQ)
    state_row, scratch_row, out_row = _chunk_rows(b, h, c, nheads, nchunks, seqlen)
    gated_row = gated_ptr + b * s_yb + h * s_yh  # dout * silu(z) (dout without z) in the loop's GEMM operand dtype
    pp = tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    nblocks = tl.cdiv(tl.minimum(Q, seqlen - t0), BLOCK_T)
    t_s, valid_s = _block(t0, j, Q, seqlen, BLOCK_T)
    dt_s, a_s = _dt(dt_row, t_s, valid_s, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)
    seq_s = _seq(seq_row, t_s, valid_s, s_seqt, HAS_SEQ)
    L_s = _log_decays(a_s, seq_s, dt_row, t_s, t0, j, Q, seqlen, HAS_SEQ, BLOCK_T, BLOCK_SUMS)  # from the block start
    # (the later blocks summed from their tokens: their block sums' loads spilled 16 bytes here under Triton 3.9)
    ends, v = _end_decays(t0, j, nblocks, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi, a_s, valid_s, seq_s, seq_end,
                          SOFTPLUS, HAS_LIMIT, BLOCK_T, CHUNK_TOKENS, False)
    D_p = _D_row(D_ptr, h, pp, headdim, s_Dh, HAS_D, D_CHANNEL, BLOCK_P)  # (at the end: a latency after the GEMMs)
    acc = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
    cb_rows = cb_ptr + ((b * nchunks + c) * (nheads // heads_per_group) + h // heads_per_group) * cb_side * cb_side
    # The later blocks, walked forward from this one, then the block itself. With seq_idx only the sequence of
    # its last token reaches the later blocks, whose rows of it are taken alone, and whose NaN the product spreads
    # to every column: the columns of other sequences are selected out before the block's own rows are added
    seq_last = _seq_at(seq_row, tl.minimum(t0 + tl.minimum(j * BLOCK_T + BLOCK_T, Q), seqlen) - 1, s_seqt, HAS_SEQ)
    L_c = -(tl.cumsum(a_s, axis=0, reverse=True) - a_s)  # minus the sum of a over the block after s
    between = 0.0  # the sum of a from this block's end to the row block's
    for i in range(j + 1, nblocks):
        t_l, valid_l = _block(t0, i, Q, seqlen, BLOCK_T)
        a_l = _dt(dt_row, t_l, valid_l, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)[1]
        sums_l, total_l = _block_log_decays(dt_row, a_l, t_l, t0, i, Q, seqlen, BLOCK_T, BLOCK_SUMS)
        L_l = between + sums_l  # L_l - L_c: the sum of a over (s, l]
        between += total_l
        # (every row comes after every column: no causal mask. The rows past seqlen have dy 0 and C_l . B_s 0:
        # their products are 0, whatever the decay a real row of theirs has)
        CB = tl.load(cb_rows + (t_l - t0)[:, None] * cb_side + (t_s - t0)[None, :], mask=valid_l[:, None],
                     other=0.0).to(tl.float32)  # ssd_cb_kernel's C_l . B_s
        M = CB * _decay(L_l, L_c)
        dy_l = _raw_tile(gated_row, t_l, valid_l, s_yt, pp, headdim, s_yp)
        if HAS_SEQ:
            seq_l = _seq(seq_row, t_l, valid_l, s_seqt, HAS_SEQ)
            M = tl.where(seq_l[:, None] == seq_s[None, :], M, 0.0)
            dy_l = tl.where((seq_l == seq_last)[:, None], dy_l, 0.0)
        acc += _dot(tl.trans(_operand(M, x_ptr, DOT_F32)), _operand(dy_l, x_ptr, DOT_F32), DOT_F32)
    # The block's own tiles, loaded after the loop, whose registers they would take, in one latency. (The end
    # state's product came first: the loop's first loads waited for it, a latency more a program.)
    dy_s = _tile(gated_row, t_s, valid_s, s_yt, pp, headdim, s_yp)  # the block's own: its product, and D's part
    x_s = _tile(x_row, t_s, valid_s, s_xt, pp, headdim, s_xp)
    CB = tl.load(cb_rows + (t_s - t0)[:, None] * cb_side + (t_s - t0)[None, :]).to(tl.float32)  # (written whole)
    B_s = _operand(_tile(B_row, t_s, valid_s, s_Bt, nn, dstate, s_Bn), x_ptr, DOT_F32)
    dE = _state_tile(dends_ptr, state_row, pp, nn, headdim, dstate)
    # The state after the chunk, H_end = w_end S + sum_s v_s X_s B_s^T, v_s = exp(L_end - L_s), and the
    # varlen states ending in the chunk likewise: dX_s += v_s dE B_s, the other sequences' rows selected out
    # (a NaN of dE or B would reach them); R_s, the end state's part of the log-decay gradient
    end_part = tl.where(ends[:, None], _dot(B_s, tl.trans(_operand(dE, x_ptr, DOT_F32)), DOT_F32) * v[:, None], 0.0)
    R = tl.where(ends, tl.sum(x_s * end_part, axis=1) * dt_s, 0.0)
    acc += end_part
    dy_own = dy_s
    if HAS_SEQ:  # (the block's own non-finite dy enters as 0, and reaches its columns below)
        acc = tl.where((seq_s == seq_last)[:, None], acc, 0.0)
        dy_own = tl.where(dy_s * 0.0 == 0.0, dy_s, 0.0)
    M = _decayed_own(CB, L_s, seq_s, HAS_SEQ, BLOCK_T)
    acc += _dot(tl.trans(_operand(M, x_ptr, DOT_F32)), _operand(dy_own, x_ptr, DOT_F32), DOT_F32)
    if HAS_SEQ:  # the block's NaN and inf of dy, to its columns before them of their sequence: NaN
        first_bad = tl.associative_scan(tl.where(dy_s * 0.0 == 0.0, 2147483647, seq_s[:, None]), 0, _minimum,
                                        reverse=True)
        acc = tl.where(first_bad == seq_s[:, None], float("nan"), acc)
    if HAS_DVARLEN:
        acc = _varlen_parts(acc, B_s, j, c, t0, h, nheads, Q, seqlen, headdim, dstate, t_s, valid_s, seq_s, a_s,
                            dt_row, seq_row, cu_ptr, first_ptr, dvarlen_ptr, x_ptr, bias, A, lo, hi, pp, nn, s_dtt,
                            s_seqt, True, HAS_SEQ, SOFTPLUS, HAS_LIMIT, DOT_F32, BLOCK_T, CHUNK_TOKENS)
    dx = acc * dt_s[:, None]
    if HAS_D:
        dx += D_p[None, :] * dy_s
    tl.store(R_ptr + scratch_row + t_s, R, mask=valid_s)
    tl.store(xdx_ptr + scratch_row + t_s, tl.sum(x_s * acc, axis=1), mask=valid_s)
    if HAS_D:
        part = ((b * nchunks + c) * blocks_per_chunk + j) * nheads + h
        tl.store(dD_ptr + part * headdim + pp, tl.sum(dy_s * x_s, axis=0), mask=pp < headdim)
    _store_rows(dx_ptr, out_row, t_s * nheads, valid_s, pp, headdim, dx)


@triton.jit
def _log_decay_from(t0, j, nblocks, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi, SOFTPLUS: tl.constexpr,
                    HAS_LIMIT: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK_TOKENS: tl.constexpr,
                    BLOCK_SUMS: tl.constexpr):
    """The sum of a over the chunk's blocks j .. nblocks - 1 (a sum of them, not a difference of sums): of their
    sums, ssd_dt_kernel's (BLOCK_SUMS; a few values, where the tokens' sum is a reduction over the chunk)."""
    if BLOCK_SUMS:
        k = tl.arange(0, CHUNK_TOKENS // BLOCK_T)
        real = (k >= j) & (k < nblocks) & (k * BLOCK_T < Q) & (t0 + k * BLOCK_T < seqlen)
        total = tl.sum(tl.load(dt_row + seqlen + _block_last(t0, k, Q, seqlen, BLOCK_T), mask=real, other=0.0),
                       axis=0)
    else:
        total = _a_sum(dt_row, t0 + j * BLOCK_T, t0 + tl.minimum(nblocks * BLOCK_T, Q), seqlen, s_dtt, bias, A, lo,
                       hi, SOFTPLUS, HAS_LIMIT, CHUNK_TOKENS)
    return total


@triton.jit
def _pair(p):
    """(i, j), j <= i, the p-th block pair of a chunk's lower triangle in the order (0, 0), (1, 0), (1, 1), ..."""
    i = ((tl.sqrt((8 * p + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= p, i + 1, i)  # (the float root's rounding, either way)
    i = tl.where(i * (i + 1) // 2 > p, i - 1, i)
    return i, p - i * (i + 1) // 2


@triton.jit
def _group_run(pid, ngroups, splits, heads_per_group):
    """(batch, group, first head) of a program walking one of a group's `splits` runs of heads (indices only:
    see _batch_head)."""
    b = (pid // (ngroups * splits)).to(tl.int64)
    g = (pid // splits) % ngroups
    return b, g, g * heads_per_group + (pid % splits) * (heads_per_group // splits)


@triton.jit
def ssd_bwd_dcb_kernel(
    x_ptr, dt_ptr, A_ptr, bias_ptr, seq_ptr, cb_ptr, gated_ptr, dcb_ptr, dlC_ptr, dlB_ptr,
    batch, seqlen, nheads, headdim, Q, nchunks, heads_per_group, lo, hi, ngroups, splits, npairs, cb_side, dcb_side,
    s_xb, s_xt, s_xh, s_xp, s_dtb, s_dtt, s_dth, s_yb, s_yt, s_yh, s_yp, s_seqb, s_seqt,
    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK_TOKENS: tl.constexpr,
    BLOCK_SUMS: tl.constexpr,
):
    """Grid (nchunks * npairs, batch * ngroups * splits): a block pair (i, j), j <= i, of one chunk and a run
    of a group's heads. The gradient of C_l . B_s summed over the run's heads,

        dCB_ls = sum_h (dy_l^h . X_s^h) exp(L_l^h - L_s^h)  (s <= l, one sequence; X = dt x),

    into dcb (splits, batch, nchunks, ngroups, dcb_side, dcb_side) in the GEMMs' operand dtype: the dB and
    dC of the whole run are then GEMMs with C and B (ssd_bwd_group_kernel), once per run, not per head.
    Each head's parts of the log-decay gradient from it, C_l . dC_l's and B_s . dB_s's without the
    diagonal s = l (their terms there cancel in dL_l, exactly so when left out), are the row and column
    sums of dCB's terms times C_l . B_s (ssd_cb_kernel's): into the partial rows dlC[j] and dlB[i],
    (blocks, batch, nheads, seqlen) float32, which ssd_bwd_group_kernel sums."""
    c = tl.program_id(0) // npairs
    i, j = _pair(tl.program_id(0) % npairs)
    b, g, h0 = _group_run(tl.program_id(1), ngroups, splits, heads_per_group)
    t0 = c * Q
    pp = tl.arange(0, BLOCK_P)
    t_l, valid_l = _block(t0, i, Q, seqlen, BLOCK_T)
    t_s, valid_s = _block(t0, j, Q, seqlen, BLOCK_T)
    seq_row = seq_ptr + b * s_seqb
    seq_l = _seq(seq_row, t_l, valid_l, s_seqt, HAS_SEQ)
    seq_s = _seq(seq_row, t_s, valid_s, s_seqt, HAS_SEQ)
    cb_tile = cb_ptr + ((b * nchunks + c) * ngroups + g) * cb_side * cb_side
    CB = tl.load(cb_tile + (t_l - t0)[:, None] * cb_side + (t_s - t0)[None, :],
                 mask=valid_l[:, None] & valid_s[None, :], other=0.0).to(tl.float32)
    # the pairs of C.dC's and B.dB's terms (C.B^T of another sequence's tokens may hold its NaN)
    strict = (t_s[None, :] < t_l[:, None]) & (seq_s[None, :] == seq_l[:, None])
    acc = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for r in range(0, heads_per_group // splits):
        h = h0 + r
        x_row, dt_row, _, _, _, bias, A = _head(
            b, h, heads_per_group, x_ptr, dt_ptr, A_ptr, x_ptr, x_ptr, bias_ptr, seq_ptr,
            s_xb, s_xh, s_dtb, s_dth, 0, 0, 0, 0, s_seqb, HAS_BIAS)
        a_l = _dt(dt_row, t_l, valid_l, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)[1]
        dt_s, a_s = _dt(dt_row, t_s, valid_s, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)
        # L_l - L_s over (s, l]: in one block from its start (a sequence's own sums with seq_idx), else the row
        # block's up to l, the blocks between and block j's after s
        between = _log_decay_from(t0, j + 1, i, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT,
                                  BLOCK_T, CHUNK_TOKENS, BLOCK_SUMS)
        L_l = _log_decays(a_l, seq_l, dt_row, t_l, t0, i, Q, seqlen, HAS_SEQ, BLOCK_T, BLOCK_SUMS)
        L_s = tl.where(j < i, -(between + tl.cumsum(a_s, axis=0, reverse=True) - a_s), L_l)
        # (the tiles go from their loads to the GEMM as they are: dt scales the product's columns, not x's rows)
        dy_l = _operand(_raw_tile(gated_ptr + b * s_yb + h * s_yh, t_l, valid_l, s_yt, pp, headdim, s_yp), x_ptr,
                        DOT_F32)
        x_s = _operand(_raw_tile(x_row, t_s, valid_s, s_xt, pp, headdim, s_xp), x_ptr, DOT_F32)
        dM = _decayed(_dot(dy_l, tl.trans(x_s), DOT_F32) * dt_s[None, :], L_l, L_s, t_l, t_s, valid_l, valid_s, seq_l,
                      seq_s, False)
        acc += dM
        q = tl.where(strict, dM * CB, 0.0)
        tl.store(dlC_ptr + ((j * batch + b) * nheads + h) * seqlen + t_l, tl.sum(q, axis=1), mask=valid_l)
        tl.store(dlB_ptr + ((i * batch + b) * nheads + h) * seqlen + t_s, tl.sum(q, axis=0), mask=valid_s)
    run = tl.program_id(1) % splits
    out = dcb_ptr + ((((run * batch + b) * nchunks + c) * ngroups + g) * dcb_side + i * BLOCK_T) * dcb_side + \
        j * BLOCK_T
    rows = tl.arange(0, BLOCK_T)
    tl.store(out + rows[:, None] * dcb_side + rows[None, :], acc.to(dcb_ptr.dtype.element_ty))


@triton.jit
def ssd_bwd_group_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, bias_ptr, seq_ptr, states_ptr, dvarlen_ptr, cu_ptr, first_ptr, gated_ptr,
    dcb_ptr, dl_part_ptr, dl_ptr, out_ptr,
    batch, seqlen, nheads, headdim, dstate, Q, nchunks, heads_per_group, lo, hi, ngroups, splits, blocks_per_chunk,
    dcb_side,
    s_xb, s_xt, s_xh, s_xp, s_dtb, s_dtt, s_dth, s_Bb, s_Bt, s_Bg, s_Bn, s_Cb, s_Ct, s_Cg, s_Cn, s_yb, s_yt, s_yh,
    s_yp, s_seqb, s_seqt,
    DB: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_DVARLEN: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_TOKENS: tl.constexpr, BLOCK_SUMS: tl.constexpr,
):
    """Grid (nchunks * blocks_per_chunk, batch * ngroups * splits): a block k of one chunk and a run of a
    group's heads; its part of dC (as rows l) or, with DB, of dB (as columns s), float32 into out (splits,
    batch, seqlen, ngroups, dstate), which torch sums over the runs. states: the chunk states entering
    each chunk, or with DB dE, the gradients of those leaving it (as the GEMMs take them). With dCB from
    ssd_bwd_dcb_kernel,

        dC_l = sum_h w_l^h dy_l^h S^h + sum_{s <= l} dCB_ls B_s,
        dB_s = sum_h (v_s^h X_s^h dE^h + the varlen states' parts) + sum_{l >= s} dCB_ls C_l,

    and into dl (batch, nheads, seqlen) float32 each head's C_l . dC_l (or B_s . dB_s without the end state's
    part, which ssd_bwd_ddt_kernel takes as R): its state part here, the rest summed from the partial rows
    dl_part (ssd_bwd_dcb_kernel's)."""
    c = tl.program_id(0) // blocks_per_chunk
    k = tl.program_id(0) % blocks_per_chunk
    b, g, h0 = _group_run(tl.program_id(1), ngroups, splits, heads_per_group)
    t0 = c * Q
    pp = tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    nblocks = tl.cdiv(tl.minimum(Q, seqlen - t0), BLOCK_T)
    t_k, valid_k = _block(t0, k, Q, seqlen, BLOCK_T)
    seq_row = seq_ptr + b * s_seqb
    seq_k = _seq(seq_row, t_k, valid_k, s_seqt, HAS_SEQ)
    B_row, C_row = B_ptr + b * s_Bb + g * s_Bg, C_ptr + b * s_Cb + g * s_Cg
    # the block's pairs in dCB, (p, k) for dB and (k, p) for dC, p in [first_pair, last_pair); the sequence whose
    # rows the other blocks reach (see the quadratic part below)
    if DB:  # the state after the chunk (v) and the varlen states: the tokens of the sequence at their ends
        seq_out = _seq_at(seq_row, tl.minimum(t0 + Q, seqlen) - 1, s_seqt, HAS_SEQ)
        dl_tile = _tile(B_row, t_k, valid_k, s_Bt, nn, dstate, s_Bn)
        first_pair, last_pair = k, nblocks
        seq_one = _seq_at(seq_row, tl.minimum(t0 + tl.minimum(k * BLOCK_T + BLOCK_T, Q), seqlen) - 1, s_seqt,
                          HAS_SEQ)
    else:  # the state entering the chunk (w): the tokens of the sequence before it
        seq_out = _seq_at(seq_row, t0 - 1, s_seqt, HAS_SEQ)
        dl_tile = _tile(C_row, t_k, valid_k, s_Ct, nn, dstate, s_Cn)
        first_pair, last_pair = 0, k + 1
        seq_one = _seq_at(seq_row, tl.minimum(t0 + k * BLOCK_T, seqlen - 1), s_seqt, HAS_SEQ)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    varlen = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)  # (added after dCB's part: see below)
    for r in range(0, heads_per_group // splits):
        h = h0 + r
        x_row, dt_row, _, _, _, bias, A = _head(
            b, h, heads_per_group, x_ptr, dt_ptr, A_ptr, x_ptr, x_ptr, bias_ptr, seq_ptr,
            s_xb, s_xh, s_dtb, s_dth, 0, 0, 0, 0, s_seqb, HAS_BIAS)
        dt_k, a_k = _dt(dt_row, t_k, valid_k, s_dtt, bias, A, lo, hi, SOFTPLUS, HAS_LIMIT)
        state = _operand(_state_tile(states_ptr, (b * nchunks + c) * nheads + h, pp, nn, headdim, dstate), x_ptr,
                         DOT_F32)
        dl_row = (b * nheads + h) * seqlen
        dl = tl.zeros([BLOCK_T], dtype=tl.float32)
        # each head's state part, its other sequences' rows selected out (a NaN of the state would reach them)
        if DB:
            ends, v = _end_decays(t0, k, nblocks, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi, a_k, valid_k, seq_k,
                                  seq_out, SOFTPLUS, HAS_LIMIT, BLOCK_T, CHUNK_TOKENS, BLOCK_SUMS)
            # (x to the GEMM as loaded: dt scales the product's rows, with v)
            x_k = _operand(_raw_tile(x_row, t_k, valid_k, s_xt, pp, headdim, s_xp), x_ptr, DOT_F32)
            acc += tl.where(ends[:, None], _dot(x_k, state, DOT_F32) * (dt_k * v)[:, None], 0.0)
            if HAS_DVARLEN:
                X_k = _operand(_tile(x_row, t_k, valid_k, s_xt, pp, headdim, s_xp) * dt_k[:, None], x_ptr, DOT_F32)
                part = _varlen_parts(tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32), X_k, k, c, t0, h, nheads, Q,
                                     seqlen, headdim, dstate, t_k, valid_k, seq_k, a_k, dt_row, seq_row, cu_ptr,
                                     first_ptr, dvarlen_ptr, x_ptr, bias, A, lo, hi, pp, nn, s_dtt, s_seqt, False,
                                     HAS_SEQ, SOFTPLUS, HAS_LIMIT, DOT_F32, BLOCK_T, CHUNK_TOKENS)
                varlen += part
                dl = tl.sum(dl_tile * part, axis=1)
        else:
            carried = valid_k & (seq_k == seq_out)
            # (the earlier blocks summed from their tokens: their block sums' loads spilled 16 bytes more on sm_80)
            w = tl.where(carried, exp(_log_decay_from(t0, 0, k, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi, SOFTPLUS,
                                                         HAS_LIMIT, BLOCK_T, CHUNK_TOKENS, False) +
                                         _block_log_decays(dt_row, a_k, t_k, t0, k, Q, seqlen, BLOCK_T,
                                                           BLOCK_SUMS)[0]), 0.0)
            # (dy to the GEMM as loaded: w scales the product's rows)
            dy = _operand(_raw_tile(gated_ptr + b * s_yb + h * s_yh, t_k, valid_k, s_yt, pp, headdim, s_yp), x_ptr,
                          DOT_F32)
            part = tl.where(carried[:, None], _dot(dy, state, DOT_F32) * w[:, None], 0.0)
            acc += part
            dl = tl.sum(dl_tile * part, axis=1)
        # (the partial rows in one load: a loop here would keep the pipeliner off this loop)
        pairs = tl.arange(0, CHUNK_TOKENS // BLOCK_T)
        dl += tl.sum(tl.load(dl_part_ptr + (pairs[:, None] * batch * nheads * seqlen + dl_row) + t_k[None, :],
                             mask=((pairs >= first_pair) & (pairs < last_pair))[:, None] & valid_k[None, :], other=0.0),
                     axis=0)
        tl.store(dl_ptr + dl_row + t_k, dl, mask=valid_k)
    # The run's quadratic part: dCB's row block k against B (dC), or its column block k against C (dB). With
    # seq_idx the block itself comes last: the other blocks reach its rows (columns) of one sequence only, its
    # first (last), whose rows alone are taken from B (C) there; the block's rows of other sequences, which a NaN
    # of B (C) in the product would reach, are selected out before the block itself is added, and its own
    # non-finite B (C) enters as 0 and reaches its rows of its sequence after (before) it.
    run = tl.program_id(1) % splits
    dcb = dcb_ptr + (((run * batch + b) * nchunks + c) * ngroups + g) * dcb_side * dcb_side
    rows = tl.arange(0, BLOCK_T)
    for kk in range(0, last_pair - first_pair):
        if DB:
            i = k + kk
            if HAS_SEQ:
                i = tl.where(k + kk + 1 < nblocks, k + kk + 1, k)
            t_i, valid_i = _block(t0, i, Q, seqlen, BLOCK_T)
            tile = tl.trans(tl.load(dcb + (i * BLOCK_T + rows)[:, None] * dcb_side + (k * BLOCK_T + rows)[None, :]))
            other = _tile(C_row, t_i, valid_i, s_Ct, nn, dstate, s_Cn)
        else:
            i = kk
            t_i, valid_i = _block(t0, i, Q, seqlen, BLOCK_T)
            tile = tl.load(dcb + (k * BLOCK_T + rows)[:, None] * dcb_side + (i * BLOCK_T + rows)[None, :])
            other = _tile(B_row, t_i, valid_i, s_Bt, nn, dstate, s_Bn)
        if HAS_SEQ:
            seq_i = _seq(seq_row, t_i, valid_i, s_seqt, HAS_SEQ)
            other = tl.where(((seq_i == seq_one)[:, None] | (i == k)) & ((other * 0.0 == 0.0) | (i != k)), other,
                             0.0)
            acc = tl.where((seq_k == seq_one)[:, None] | (i != k), acc, 0.0)
        acc += _dot(tile, _operand(other, x_ptr, DOT_F32), DOT_F32)
    if HAS_SEQ:  # the block's own NaN and inf of B (C) to its rows after (before) them of their sequence: NaN
        if DB:
            own = _tile(C_row, t_k, valid_k, s_Ct, nn, dstate, s_Cn)
            bad = tl.associative_scan(tl.where(own * 0.0 == 0.0, 2147483647, seq_k[:, None]), 0, _minimum,
                                      reverse=True)
        else:
            own = _tile(B_row, t_k, valid_k, s_Bt, nn, dstate, s_Bn)
            bad = tl.associative_scan(tl.where(own * 0.0 == 0.0, -1, seq_k[:, None]), 0, _maximum)
        acc = tl.where(bad == seq_k[:, None], float("nan"), acc)
    if DB and HAS_DVARLEN:
        acc += varlen
    out_row = ((run * batch + b) * seqlen + t_k) * ngroups + g
    tl.store(out_ptr + out_row[:, None] * dstate + nn[None, :], acc,
             mask=valid_k[:, None] & (nn < dstate)[None, :])


@triton.jit
def ssd_bwd_ddt_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, bias_ptr, seq_ptr, states_ptr, dends_ptr, dvarlen_ptr, cu_ptr, first_ptr,
    dlC_ptr, dlB_ptr, R_ptr, xdx_ptr, ddt_ptr, dA_ptr, dbias_ptr,
    seqlen, nheads, headdim, dstate, Q, nchunks, heads_per_group, lo, hi,
    s_xb, s_xt, s_xh, s_xp, s_dtb, s_dtt, s_dth, s_Bb, s_Bt, s_Bg, s_Bn, s_seqb, s_seqt,
    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    HAS_DVARLEN: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK_TOKENS: tl.constexpr,
):
    """Grid (nchunks, batch * nheads). ddt (dt's layout, contiguous) and the float32 partials of dA and
    dt_bias (batch * nchunks * nheads,), from the scratch rows of the two kernels above.

    a_t = dt_t A enters every L_l from t on, so da_t = sum_{l >= t} dL_l, with dL_l = C_l . dC_l -
    B_l . dB_l (the part of the quadratic form and the entering state) plus <dH_e, H_e> at each state
    output e. For the end state, H_end = w_end S + sum_s v_s X_s B_s^T, those terms add up in da_t to
    w_end <dE, S> + sum_{s < t} R_s, taken so: summing the large terms that cancel would round."""
    c = tl.program_id(0)
    b, h = _batch_head(tl.program_id(1), nheads)
    t0 = c * Q
    x_row, dt_row, B_row, _, seq_row, bias, A, seq_before, seq_end = _chunk_program(
        b, h, t0, heads_per_group, Q, seqlen, x_ptr, dt_ptr, A_ptr, B_ptr, B_ptr, bias_ptr, seq_ptr,
        s_xb, s_xh, s_dtb, s_dth, s_Bb, s_Bg, s_Bb, s_Bg, s_seqb, s_seqt, HAS_BIAS, HAS_SEQ)
    state_row, scratch_row, _ = _chunk_rows(b, h, c, nheads, nchunks, seqlen)
    pp = tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    nblocks = tl.cdiv(tl.minimum(Q, seqlen - t0), BLOCK_T)
    state = _state_tile(states_ptr, state_row, pp, nn, headdim, dstate)
    if HAS_DVARLEN:  # <dV_e, H_e> enters dL_e at each varlen end e of the chunk
        for k in range(tl.load(first_ptr + c), tl.load(first_ptr + c + 1)):
            e = tl.load(cu_ptr + k + 1).to(tl.int32) - 1
            H_e = _state_at(state, t0, e, seq_before, Q, seqlen, x_row, dt_row, B_row, seq_row, bias, A, lo, hi,
                            pp, nn, headdim, dstate, s_xt, s_xp, s_dtt, s_Bt, s_Bn, s_seqt,
                            SOFTPLUS, HAS_LIMIT, HAS_SEQ, DOT_F32, BLOCK_T, BLOCK_P, BLOCK_N)
            dV = _state_tile(dvarlen_ptr, k * nheads + h, pp, nn, headdim, dstate)
            _add_at(dlC_ptr + scratch_row + e, tl.sum(tl.sum(dV * H_e, axis=1), axis=0))
            tl.debug_barrier()
    # the end state's part of da, first to last (R is turned into it in place)
    L_end = _log_decay_through(t0, tl.minimum(t0 + Q, seqlen) - 1, Q, seqlen, dt_row, s_dtt, bias, A, lo, hi,
                               SOFTPLUS, HAS_LIMIT, CHUNK_TOKENS)
    da_end = tl.where(seq_end == seq_before, exp(L_end) * tl.sum(tl.sum(
        _state_tile(dends_ptr, state_row, pp, nn, headdim, dstate) * state, axis=1), axis=0), 0.0)
    for j in range(0, nblocks):
        t, valid = _block(t0, j, Q, seqlen, BLOCK_T)
        R = tl.load(R_ptr + scratch_row + t, mask=valid, other=0.0)
        tl.store(R_ptr + scratch_row + t, da_end + tl.cumsum(R, axis=0) - R, mask=valid)
        da_end += tl.sum(R, axis=0)
    tl.debug_barrier()
    # the rest of da, last to first; ddt = x . dX + A da, through the clamp and softplus; dA = sum dt da
    # (with seq_idx da_t sums dL over t's own sequence: a later sequence's NaN must not reach it)
    after = 0.0  # the sum of dL over the blocks after this one (with seq_idx: over their first token's sequence)
    after_seq = -1
    dA_acc = 0.0
    dbias_acc = 0.0
    for jj in range(0, nblocks):
        t, valid = _block(t0, nblocks - 1 - jj, Q, seqlen, BLOCK_T)
        raw, pre, dt = _dt_steps(dt_row, t, valid, s_dtt, bias, lo, hi, SOFTPLUS, HAS_LIMIT)
        dl = tl.load(dlC_ptr + scratch_row + t, mask=valid, other=0.0) - \
            tl.load(dlB_ptr + scratch_row + t, mask=valid, other=0.0)
        R = tl.load(R_ptr + scratch_row + t, mask=valid, other=0.0)
        if HAS_SEQ:
            seq = _seq(seq_row, t, valid, s_seqt, HAS_SEQ)
            first = _seq_at(seq_row, t0 + (nblocks - 1 - jj) * BLOCK_T, s_seqt, HAS_SEQ)
            da = tl.where(seq == after_seq, after, 0.0) + \
                tl.associative_scan((dl, seq), 0, _add_within_sequence, reverse=True)[0] + R
            after = tl.where(first == after_seq, after, 0.0) + tl.sum(tl.where(seq == first, dl, 0.0), axis=0)
            after_seq = first
        else:
            da = after + tl.cumsum(dl, axis=0, reverse=True) + R
            after += tl.sum(dl, axis=0)
        dA_acc += tl.sum(dt * da, axis=0)
        ddt = tl.load(xdx_ptr + scratch_row + t, mask=valid, other=0.0) + A * da
        if HAS_LIMIT:
            ddt = tl.where(_unclamped(pre, lo, hi), ddt, 0.0)
        if SOFTPLUS:
            ddt = tl.where(raw <= 20.0, ddt * sigmoid(raw), ddt)
        ddt = tl.where(valid, ddt, 0.0)
        dbias_acc += tl.sum(ddt, axis=0)
        tl.store(ddt_ptr + (b * seqlen + t) * nheads + h, ddt.to(ddt_ptr.dtype.element_ty), mask=valid)
    part = (b * nchunks + c) * nheads + h
    tl.store(dA_ptr + part, dA_acc)
    if HAS_BIAS:
        tl.store(dbias_ptr + part, dbias_acc)
