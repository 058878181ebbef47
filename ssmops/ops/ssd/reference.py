"""Mamba-2's SSD scan in plain PyTorch, two ways: the executable definition and the chunked algorithm.

`ssd_scan_ref` is the per-timestep recurrence, one Python step per token: slow and
obvious, it is the oracle every backend is tested against. `ssd_chunked_ref` states the
SSD (state space duality) algorithm over the whole sequence at once, vectorised over
chunks, as a readable bridge between the recurrence and the fast backends.

Both take mamba_ssm's `mamba_chunk_scan_combined` arguments and return what it returns.
Per (batch, head), with h the (headdim, dstate) state:

    dt_t = softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias, clamped to dt_limit
           unless dt_limit is the default (0, inf)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * outer(x_t, B_t)
    y_t  = h_t @ C_t + D * x_t;   out = y * silu(z) when z is given

Head h reads group h // (nheads // ngroups) of B and C. With seq_idx the state restarts
from zero at each token whose id differs from the previous token's; `initial_states`
belongs to sequence 0, so it reaches the first tokens only when seq_idx[:, 0] == 0.
varlen_states[i] is the state after token cu_seqlens[i + 1] - 1.

Everything is computed in float32 (float64 when an input is float64, for gradcheck);
`out` has x's dtype, the states the compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _discretize_dt(
    dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]
) -> Tensor:
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)  # identity above 20, as mamba_ssm
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    return dt


def _per_head(M: Tensor, nheads: int, dtype: torch.dtype) -> Tensor:
    """(batch, seqlen, ngroups, dstate) -> (batch, seqlen, nheads, dstate)."""
    return M.to(dtype).repeat_interleave(nheads // M.shape[2], dim=2)


def _skip_and_gate(y: Tensor, x: Tensor, D: Tensor | None, z: Tensor | None) -> Tensor:
    """y + D * x, gated by silu(z)."""
    if D is not None:
        y = y + x * (D if D.dim() == 2 else D[:, None]).to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def _returns(
    out: Tensor, final_states: Tensor, varlen_states: Tensor | None, return_final_states: bool,
    return_varlen_states: bool,
) -> Tensor | tuple[Tensor, ...]:
    """mamba_chunk_scan_combined's return convention."""
    results = (out,) + ((final_states,) if return_final_states else ())
    results += (varlen_states,) if return_varlen_states else ()
    return results[0] if len(results) == 1 else results


def ssd_scan_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """The recurrence, token by token. x, z: (batch, seqlen, nheads, headdim); dt: (batch, seqlen,
    nheads); A: (nheads,); B, C: (batch, seqlen, ngroups, dstate); D: (nheads, headdim) | (nheads,);
    dt_bias: (nheads,); initial_states: (batch, nheads, headdim, dstate); seq_idx: (batch, seqlen);
    cu_seqlens: (nseq + 1,), batch 1. Returns out, then final_states and varlen_states as asked."""
    compute = _compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    batch, seqlen, nheads, headdim = x.shape
    xc = x.to(compute)
    dt = _discretize_dt(dt.to(compute), dt_bias, dt_softplus, dt_limit)
    decay = torch.exp(dt * A.to(compute))  # (batch, seqlen, nheads)
    Bh, Ch = _per_head(B, nheads, compute), _per_head(C, nheads, compute)
    state = (
        xc.new_zeros(batch, nheads, headdim, B.shape[-1])
        if initial_states is None
        else initial_states.to(compute)
    )
    varlen_ends = [] if cu_seqlens is None else [int(e) - 1 for e in cu_seqlens[1:].tolist()]
    states_at = {}
    previous_seq = None if seq_idx is None else torch.zeros_like(seq_idx[:, 0])
    ys = []
    for t in range(seqlen):
        if seq_idx is not None:  # a new sequence starts from a zero state (selected: 0 * NaN would be NaN)
            state = torch.where((seq_idx[:, t] == previous_seq)[:, None, None, None], state, 0.0)
            previous_seq = seq_idx[:, t]
        drive = (dt[:, t, :, None] * xc[:, t])[..., None] * Bh[:, t, :, None, :]  # (batch, nheads, headdim, dstate)
        state = decay[:, t, :, None, None] * state + drive
        ys.append((state @ Ch[:, t, :, :, None]).squeeze(-1))
        if t in varlen_ends:
            states_at[t] = state
    y = torch.stack(ys, dim=1) if ys else xc.new_zeros(x.shape)
    out = _skip_and_gate(y, xc, D, z).to(x.dtype)
    varlen_states = None if cu_seqlens is None else torch.cat([states_at[e] for e in varlen_ends])
    return _returns(out, state, varlen_states, return_final_states, return_varlen_states)


def ssd_chunked_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """The SSD chunked algorithm over the whole sequence; same arguments (plus chunk_size, where
    mamba_chunk_scan_combined has it) and results as ssd_scan_ref.

    Within a chunk the scan is a masked quadratic form, (C B^T * decay mask) @ (dt * x); across
    chunks a state is passed, read by each chunk's C. Indices: c chunk, l and s tokens of a chunk
    (l the output, s the input), h head, p headdim, n dstate. Its masks multiply (a statement of the
    algorithm, not of the kernels' care with non-finite values: a NaN or inf reaches every product of
    its chunk here, where ssd_scan_ref and the backends keep it to its own sequence and later tokens).
    """
    compute = _compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.shape[-1]
    nchunks = -(-seqlen // chunk_size)
    pad = nchunks * chunk_size - seqlen

    # Pad to whole chunks with tokens that change nothing (dt = 0: no decay, no input) and
    # belong to the last sequence, then cut into chunks.
    def chunked(t: Tensor) -> Tensor:
        t = torch.cat([t, t.new_zeros(batch, pad, *t.shape[2:])], dim=1)
        return t.view(batch, nchunks, chunk_size, *t.shape[2:])

    xc = x.to(compute)
    dt = _discretize_dt(dt.to(compute), dt_bias, dt_softplus, dt_limit)
    xs, dts = chunked(xc), chunked(dt)
    Bs, Cs = chunked(_per_head(B, nheads, compute)), chunked(_per_head(C, nheads, compute))
    seq = torch.zeros(batch, seqlen, dtype=torch.long, device=x.device) if seq_idx is None else seq_idx.long()
    seq = torch.cat([seq, seq[:, -1:].expand(batch, pad)], dim=1).view(batch, nchunks, chunk_size)
    # The sequence of the token before each chunk: 0 before the first (initial_states' sequence).
    seq_before = torch.cat([torch.zeros_like(seq[:, :1, -1]), seq[:, :-1, -1]], dim=1)  # (batch, nchunks)

    log_decay = torch.cumsum(dts * A.to(compute), dim=2)  # (b, c, l, h): decay from the chunk start through l
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    visible = causal & (seq[..., :, None] == seq[..., None, :])  # (b, c, l, s): s reaches l

    # 1. Within each chunk: y_l += sum_{s <= l} (C_l . B_s) exp(log_decay_l - log_decay_s) dt_s x_s.
    segment = log_decay.transpose(2, 3)[..., :, None] - log_decay.transpose(2, 3)[..., None, :]  # (b, c, h, l, s)
    decay_mask = torch.exp(segment.masked_fill(~visible[:, :, None], -math.inf))
    y = torch.einsum("bclhn,bcshn,bchls,bcsh,bcshp->bclhp", Cs, Bs, decay_mask, dts, xs)

    # 2. Each chunk's own contribution to the state after its last token.
    to_end = torch.exp(log_decay[:, :, -1:] - log_decay) * dts * (seq == seq[..., -1:])[..., None]  # (b, c, s, h)
    chunk_contributions = torch.einsum("bcshn,bcsh,bcshp->bchpn", Bs, to_end, xs)

    # 3. State passing: the state entering each chunk is the one before it, decayed over
    #    that chunk (or dropped when a new sequence ended it), plus its contribution.
    state = (
        xc.new_zeros(batch, nheads, headdim, dstate)
        if initial_states is None
        else initial_states.to(compute)
    )
    chunk_decay = torch.exp(log_decay[:, :, -1]) * (seq[..., -1] == seq_before)[..., None]  # (b, c, h)
    entering = []
    for c in range(nchunks):
        entering.append(state)
        state = chunk_decay[:, c, :, None, None] * state + chunk_contributions[:, c]
    entering = torch.stack(entering, dim=1)  # (b, c, h, p, n)

    # 4. The entering state, read by C and decayed to each token of the chunk's first sequence.
    from_state = torch.exp(log_decay) * (seq == seq_before[..., None])[..., None]  # (b, c, l, h)
    y = y + torch.einsum("bclhn,bchpn,bclh->bclhp", Cs, entering, from_state)
    y = y.reshape(batch, nchunks * chunk_size, nheads, headdim)[:, :seqlen]
    out = _skip_and_gate(y, xc, D, z).to(x.dtype)

    varlen_states = None
    if cu_seqlens is not None:
        # 5. The state after token e (chunk c, offset pos): the entering state decayed to pos, plus
        #    the chunk's tokens s <= pos of e's sequence decayed to pos.
        ends = cu_seqlens[1:].long() - 1
        c, pos = ends // chunk_size, ends % chunk_size
        ld_end = log_decay[0, c, pos]  # (nseq, h)
        seq_end = seq[0, c, pos]  # (nseq,)
        reach = visible[0, c, pos] & (seq[0, c] == seq_end[:, None])  # (nseq, s)
        to_end = (ld_end[:, None] - log_decay[0, c]).masked_fill(~reach[..., None], -math.inf)
        weight = torch.exp(to_end) * dts[0, c]  # (nseq, s, h)
        own = torch.einsum("ishn,ish,ishp->ihpn", Bs[0, c], weight, xs[0, c])
        kept = torch.exp(ld_end) * (seq_end == seq_before[0, c])[:, None]  # (nseq, h)
        varlen_states = own + kept[..., None, None] * entering[0, c]
    return _returns(out, state, varlen_states, return_final_states, return_varlen_states)
