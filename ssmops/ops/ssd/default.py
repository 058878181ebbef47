"""Mamba-2's SSD chunked scan in plain PyTorch: the operator's `default` backend, any device.

The sequence is cut into chunks of `chunk_size` tokens and walked chunk by chunk,
carrying the state `(batch, nheads, headdim, dstate)` across chunks. Within a chunk:

* the carried state reaches every token through `C @ state^T`, decayed by exp(cumsum(dt * A));
* tokens reach later tokens of the chunk through the quadratic (attention-like) form
  `(C B^T * decay mask) @ (dt * x)`; the rows are processed in blocks of `_ROW_BLOCK`,
  so only the lower-triangular part is computed, and only the diagonal blocks need a
  per-head `(rows, rows)` decay mask. Earlier rows reach a row block through
  `C B^T @ (x decayed to the block start)`: the decay between two tokens factors at the
  block boundary into two terms that are both <= 1 when dt * A <= 0, so the per-group
  `C B^T` is shared by all heads of its group in one GEMM;
* the state after the chunk is `(x decayed to the chunk end)^T @ B` plus the decayed carry.

Everything is computed in float32. Every product is a GEMM batched over
`(batch, ngroups)` with the group's heads side by side (B and C are never copied per
head) or over `(batch, nheads)`. Memory is bounded by one chunk's working set; nothing
spans all chunks except `chunk_states`, one state per chunk.

The backward walks the chunks in reverse. Each chunk's forward is recomputed from its
saved entering state (`chunk_states`) under autograd and differentiated with the
gradient of its outgoing state as carry; the gradient of its entering state is the
carry for the chunk before. Autograd of the same `_chunk_scan` that the forward runs,
instead of hand-written backward formulas, keeps one statement of the math (no second
derivation to drift from the first) at the cost of some autograd overhead per chunk,
and it is deterministic: the graph is a fixed sequence of GEMMs and reductions.

Packed sequences (seq_idx) are kept apart as in the reference: the products between two
sequences are selected out, never multiplied by 0, so that a NaN or inf in one reaches no
other. A masked GEMM's gradient cannot be selected so (it sums one sequence's zeros times
another's values), so where a chunk holds a NaN or inf its gradients are taken with each
sequence scanned on its own (`_by_sequence`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_sequence_values, check_ssd_grad_inputs, check_ssd_inputs, keeps_ungated, limit_bounds

# Rows of a chunk processed together in the quadratic form; the per-head decay mask is
# built only for the (_ROW_BLOCK, _ROW_BLOCK) diagonal blocks.
_ROW_BLOCK = 64
# Exponents of decay factors are clamped to +-_EXP_LIMIT: beyond it float32's exp leaves the
# normal range (exp(-87) = 1.6e-38), where torch's CPU exp is ~40x slower and the factor is
# below any rounding of the O(1) terms it is added to (or is an overflow anyway).
_EXP_LIMIT = 87.0


def _decay(log_decay: Tensor) -> Tensor:
    """exp of a log decay, clamped to float32's normal range (see _EXP_LIMIT)."""
    return torch.exp(log_decay.clamp(-_EXP_LIMIT, _EXP_LIMIT))


def discretize_dt(
    dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: list[float] | tuple[float, float]
) -> Tensor:
    """dt + dt_bias, through softplus (identity above 20, as mamba_ssm) and the clamp
    to dt_limit ([low, high]; [] or the default (0, inf) leave it out altogether)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt, threshold=20.0)
    if len(dt_limit) == 2 and tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(*limit_bounds(dt_limit))
    return dt


def _by_group(t: Tensor, ngroups: int) -> Tensor:
    """(batch, tokens, nheads, headdim) -> (batch, ngroups, tokens, heads_per_group * headdim):
    a group's heads side by side, to be multiplied with the group's B or C at once."""
    batch, tokens, nheads, headdim = t.shape
    return t.reshape(batch, tokens, ngroups, nheads // ngroups * headdim).transpose(1, 2)


def _by_head(t: Tensor, nheads: int) -> Tensor:
    """Inverse of _by_group: (batch, ngroups, tokens, heads_per_group * headdim) ->
    (batch, tokens, nheads, headdim)."""
    batch, ngroups, tokens, width = t.shape
    return t.transpose(1, 2).reshape(batch, tokens, nheads, ngroups * width // nheads)


def _log_decay(a: Tensor, seq: Tensor | None) -> Tensor:
    """log_decay_l = the sum of a (batch, length, nheads) over the chunk's tokens up to l. With seq
    (batch, length), where a is not all finite (one reduction tells), the sum runs over l's own
    sequence only: a NaN or inf in an earlier sequence's dt must not reach the decays of a later one
    (a cumulative sum would carry it on, and differences of sums would not take it out: NaN - NaN)."""
    log_decay = torch.cumsum(a, dim=1)
    if seq is None or log_decay.detach()[:, -1].isfinite().all():
        return log_decay
    length = a.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    own = causal & (seq[:, :, None] == seq[:, None, :])  # (batch, l, s): s is in l's sequence and before it
    return torch.where(own[..., None], a[:, None], 0.0).sum(2)


def _decayed_to(xdt: Tensor, log_decay: Tensor, t: int, same_seq: Tensor | None = None) -> Tensor:
    """dt_s * x_s * exp(log_decay_t - log_decay_s) for the tokens s <= t: their
    contribution to the state after token t. `same_seq` (batch, t + 1) selects the tokens of
    t's sequence, 0 for the others (selected, not multiplied: they may hold a NaN).
    Returns (batch, t + 1, nheads, headdim)."""
    weight = _decay(log_decay[:, t : t + 1] - log_decay[:, : t + 1])  # (batch, t + 1, nheads)
    decayed = xdt[:, : t + 1] * weight[..., None]
    return decayed if same_seq is None else torch.where(same_seq[..., None, None], decayed, 0.0)


def _causal_product(mixer: Tensor, xdt: Tensor, seq: Tensor | None = None) -> Tensor:
    """mixer @ xdt for lower-triangular mixers (n, block, block) and xdt (n, block, headdim), where a
    NaN or inf in xdt's row s reaches the rows from s on of its own sequence only (seq (n, block): the
    rows' sequence ids; one sequence without it). The product meets it with the zeros above the
    diagonal and between sequences too (0 * NaN = NaN): where xdt is not all finite (one reduction
    tells; a sum that overflows only takes the slower way), it enters the product as 0 and reaches
    its rows as a NaN added to them, those where the last non-finite row so far is of their
    sequence (no gradient: 0)."""
    if xdt.detach().sum().isfinite():
        return mixer @ xdt
    seq = torch.zeros(xdt.shape[:2], dtype=torch.long, device=xdt.device) if seq is None else seq.long()
    last_bad_seq = torch.where(xdt.detach().isfinite(), -1, seq[..., None]).cummax(dim=1).values
    from_it_on = torch.where(last_bad_seq == seq[..., None], math.nan, 0.0).to(xdt.dtype)
    return torch.baddbmm(from_it_on, mixer, xdt.nan_to_num(0.0, 0.0, 0.0))


def _gate(y: Tensor, z: Tensor) -> Tensor:
    """y * silu(z), in float32."""
    return y * F.silu(z.float())


def _pad_tokens(t: Tensor, length: int) -> Tensor:
    """(batch, q, ...) -> (batch, length, ...), zero-padded."""
    pad = length - t.shape[1]
    return t if pad == 0 else torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)


def _chunk_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    state: Tensor,
    seq: Tensor | None,
    seq_before: Tensor | None,
    state_offsets: list[int],
    dt_softplus: bool,
    dt_limit: list[float],
) -> tuple[Tensor, list[Tensor]]:
    """One chunk of q tokens entered with `state` (batch, nheads, headdim, dstate) float32.

    x, z: (batch, q, nheads, headdim); dt: (batch, q, nheads); B, C: (batch, q, ngroups, dstate);
    seq: (batch, q) sequence ids, seq_before: (batch,) the id of the token before the chunk.
    Returns the float32 output (batch, q, nheads, headdim) and the states after the tokens
    at `state_offsets` (each (batch, nheads, headdim, dstate) float32).
    """
    batch, q, nheads, headdim = x.shape
    ngroups = B.shape[2]
    # The diagonal blocks are batched in one GEMM: pad to whole blocks with tokens that change
    # nothing (dt = 0: no decay, no input) and belong to the last sequence.
    block = min(_ROW_BLOCK, q)
    length = -(-q // block) * block
    nblocks = length // block
    dt = _pad_tokens(discretize_dt(dt, dt_bias, dt_softplus, dt_limit), length)
    xdt = _pad_tokens(x.float(), length) * dt[..., None]  # (batch, length, nheads, headdim)
    B_g = _pad_tokens(B.float(), length).transpose(1, 2)  # (batch, ngroups, length, dstate)
    C_g = _pad_tokens(C.float(), length).transpose(1, 2)
    if seq is not None:
        seq = torch.cat([seq, seq[:, -1:].expand(batch, length - q)], dim=1)
    log_decay = _log_decay(dt * A, seq)  # (batch, length, nheads): log of the decay from the chunk start through l

    # The carried state, read by C and decayed to each token (unless a new sequence began since).
    # Between sequences products are selected out, never multiplied by 0: an earlier sequence's NaN
    # or inf must not reach a later one (0 * NaN = NaN), as in the reference.
    state_g = state.reshape(batch, ngroups, -1, state.shape[-1])  # (batch, ngroups, heads_per_group * headdim, dstate)
    y = _by_head(C_g @ state_g.transpose(-1, -2), nheads) * _decay(log_decay)[..., None]
    if seq is not None:
        y = torch.where((seq == seq_before[:, None])[..., None, None], y, 0.0)

    # C_l . B_s, zero between different sequences; the causal mask is applied per block below.
    CB = C_g @ B_g.transpose(-1, -2)  # (batch, ngroups, length, length)
    if seq is not None:
        CB = torch.where(seq[:, None, :, None] == seq[:, None, None, :], CB, 0.0)

    # Diagonal blocks: the per-head decay between two tokens of a block, causal.
    block_decay = log_decay.view(batch, nblocks, block, nheads).permute(0, 3, 1, 2)  # (batch, nheads, nblocks, block)
    decay = _decay(block_decay[..., :, None] - block_decay[..., None, :])  # (batch, nheads, nblocks, block, block)
    CB_diagonal = torch.diagonal(CB.unflatten(2, (nblocks, block)).unflatten(4, (nblocks, block)), dim1=2, dim2=4)
    CB_diagonal = CB_diagonal.permute(0, 1, 4, 2, 3)  # (batch, ngroups, nblocks, block, block)
    # (batch, ngroups, heads_per_group, nblocks, block, block). The causal mask zeroes the product
    # rather than multiplying it: above the diagonal the decay is the exp of a positive sum (up to
    # e^87, or NaN from a later dt) and CB may hold a later token's NaN, and 0 * inf = NaN, in the
    # product as in its gradient.
    mixer = decay.unflatten(1, (ngroups, -1)) * CB_diagonal[:, :, None]
    seq_by_block = None
    if seq is not None:  # (the decay between two sequences may be NaN: one of an earlier sequence's dt)
        seq_by_block = seq.view(batch, 1, nblocks, block).expand(batch, nheads, nblocks, block)
        same = (seq_by_block[..., :, None] == seq_by_block[..., None, :]).unflatten(1, (ngroups, -1))
        mixer = torch.where(same, mixer, 0.0)
        seq_by_block = seq_by_block.reshape(-1, block)
    mixer = mixer.tril_()
    # Head-major copy: bmm copies matrices one by one unless they are contiguous.
    xdt_by_head = xdt.transpose(1, 2).reshape(-1, block, headdim)  # (batch * nheads * nblocks, block, headdim)
    y_diagonal = _causal_product(mixer.reshape(-1, block, block), xdt_by_head, seq_by_block)
    y_diagonal = y_diagonal.view(batch, nheads, length, headdim)
    y = y + y_diagonal.transpose(1, 2)

    # Earlier blocks: their tokens decayed to the token before the row block, through the
    # group's CB shared by its heads, then decayed from there. (Concatenated rather than
    # added to slices of y in place: autograd would copy all of y's gradient per slice.)
    from_earlier = [y.new_zeros(batch, block, nheads, headdim)]
    for r0 in range(block, length, block):
        r1 = r0 + block
        # (batch, ngroups, r0, heads_per_group * headdim)
        # (with seq: the tokens of the sequence at r0 - 1, which reach the rows of that sequence alone)
        in_seq = None if seq is None else seq[:, :r0] == seq[:, r0 - 1 : r0]
        earlier = _by_group(_decayed_to(xdt, log_decay, r0 - 1, in_seq), ngroups)
        reach = _decay(log_decay[:, r0:r1] - log_decay[:, r0 - 1 : r0])[..., None]
        rows = _by_head(CB[:, :, r0:r1, :r0] @ earlier, nheads) * reach
        if seq is not None:
            rows = torch.where((seq[:, r0:r1] == seq[:, r0 - 1 : r0])[..., None, None], rows, 0.0)
        from_earlier.append(rows)
    y = y + torch.cat(from_earlier, dim=1)

    y = y[:, :q]
    if D is not None:
        y = y + x.float() * (D.float() if D.dim() == 2 else D.float()[:, None])
    if z is not None:
        y = _gate(y, z)

    states = []
    for t in state_offsets:
        same_seq = None if seq is None else seq[:, : t + 1] == seq[:, t : t + 1]
        contributions = _by_group(_decayed_to(xdt, log_decay, t, same_seq), ngroups)
        B_t = B_g[:, :, : t + 1] if seq is None else torch.where(same_seq[:, None, :, None], B_g[:, :, : t + 1], 0.0)
        new = (contributions.transpose(-1, -2) @ B_t).reshape(state.shape)
        kept = state * _decay(log_decay[:, t])[..., None, None]  # (batch, nheads, headdim, dstate)
        if seq is not None:
            kept = torch.where((seq[:, t] == seq_before)[:, None, None, None], kept, 0.0)
        states.append(new + kept)
    return y, states


class _Chunk:
    """Tokens [start, stop) of the sequence, and the states the scan must return from it:
    the state after its last token, then those after the varlen sequence ends inside it."""

    def __init__(self, index: int, start: int, stop: int, varlen_ends: list[tuple[int, int]]):
        self.index, self.start, self.stop = index, start, stop
        self.varlen_ids = [i for i, _ in varlen_ends]
        self.state_offsets = [stop - start - 1] + [end - start for _, end in varlen_ends]

    def slice(self, t: Tensor | None) -> Tensor | None:
        """The chunk's tokens of a (batch, seqlen, ...) tensor."""
        return None if t is None else t[:, self.start : self.stop]

    def seq_before(self, seq_idx: Tensor | None) -> Tensor | None:
        """The sequence id of the token before the chunk; 0 before the first one, which is
        the sequence `initial_states` belongs to."""
        if seq_idx is None:
            return None
        if self.start == 0:
            return torch.zeros_like(seq_idx[:, 0])
        return seq_idx[:, self.start - 1]


# The dispatch keys autograd records through; a kernel run inside a TorchDispatchMode (`use_backend`,
# opcheck's schema check) runs with them excluded.
_AUTOGRAD_KEYS = [getattr(torch._C.DispatchKey, name) for name in torch._C.DispatchKey.__members__
                  if name.startswith("Autograd") or name == "ADInplaceOrView"]


@contextlib.contextmanager
def _autograd_enabled():
    """Grad mode with the autograd dispatch keys re-included, for the backward's per-chunk
    recomputation wherever this kernel is called (no public API re-includes them)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


def _chunks(seqlen: int, chunk_size: int, cu_seqlens: Tensor | None) -> list[_Chunk]:
    """The chunks, each with the varlen sequences (id, last token) that end in it."""
    ends = [] if cu_seqlens is None else [int(e) - 1 for e in cu_seqlens[1:].tolist()]
    return [
        _Chunk(index, start, min(start + chunk_size, seqlen),
               [(i, e) for i, e in enumerate(ends) if start <= e < start + chunk_size])
        for index, start in enumerate(range(0, seqlen, chunk_size))
    ]


def ssd_fwd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    initial_states: Tensor | None,
    seq_idx: Tensor | None,
    cu_seqlens: Tensor | None,
    chunk_size: int,
    dt_softplus: bool,
    dt_limit: list[float],
    keep_ungated: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The SSD scan. Returns out (x's shape and dtype), final_states (batch, nheads, headdim,
    dstate), chunk_states (batch, nchunks * nheads, headdim, dstate): the state entering each
    chunk, varlen_states (nseq, nheads, headdim, dstate), empty without cu_seqlens, and the
    output before the gate where kept (schema.py), else empty; states are float32."""
    check_ssd_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_limit)
    check_sequence_values(x.shape[1], seq_idx, cu_seqlens)
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.shape[-1]
    chunks = _chunks(seqlen, chunk_size, cu_seqlens)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    keep = keeps_ungated(z, keep_ungated)
    ungated = torch.empty_like(out) if keep else x.new_empty(0)
    chunk_states = x.new_empty(batch, len(chunks), nheads, headdim, dstate, dtype=torch.float32)
    nseq = 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    varlen_states = x.new_empty(nseq, nheads, headdim, dstate, dtype=torch.float32)
    state = (
        x.new_zeros(batch, nheads, headdim, dstate, dtype=torch.float32)
        if initial_states is None
        else initial_states.float()
    )
    with torch.no_grad():
        for chunk in chunks:
            chunk_states[:, chunk.index] = state
            y, (state, *ends) = _chunk_scan(
                chunk.slice(x), chunk.slice(dt), A, chunk.slice(B), chunk.slice(C), D, None, dt_bias,
                state, chunk.slice(seq_idx), chunk.seq_before(seq_idx), chunk.state_offsets, dt_softplus, dt_limit,
            )  # fmt: skip
            if keep:
                ungated[:, chunk.start : chunk.stop] = y
            out[:, chunk.start : chunk.stop] = y if z is None else _gate(y, chunk.slice(z))
            for i, end_state in zip(chunk.varlen_ids, ends):
                varlen_states[i] = end_state[0]
    if cu_seqlens is None:
        varlen_states = x.new_empty(0, dtype=torch.float32)
    return out, state, chunk_states.view(batch, -1, headdim, dstate), varlen_states, ungated


def _all_finite(*tensors: Tensor | None) -> bool:
    """Whether every element of the tensors given is finite (one reduction and one sync)."""
    return bool(torch.stack([t.detach().isfinite().all() for t in tensors if t is not None]).all())


def _by_sequence(chunk: _Chunk, seq_idx: Tensor, local: dict, shared: dict, state: Tensor, dout: Tensor,
                 dstate: Tensor | None, dvarlen: list[Tensor] | None, dt_softplus: bool,
                 dt_limit: list[float]) -> tuple[list[Tensor], list[Tensor]]:
    """The chunk's outputs (under autograd) and their cotangents, each row's sequences scanned one by one, as
    the backward takes them where a NaN or inf is about: autograd's products of a masked GEMM multiply the
    zeros of one sequence by another's values (0 * NaN = NaN, in the gradients of either), and selecting
    element by element cannot undo that once a GEMM has summed them. A sequence that continues the one before
    the chunk enters with `state`, the others with zeros; the end state and the varlen states come from the
    sequences they end."""
    rows, before = chunk.slice(seq_idx).tolist(), chunk.seq_before(seq_idx).tolist()
    outputs, cotangents = [], []
    cotangent_of_state = [dstate] + (dvarlen or [None] * (len(chunk.state_offsets) - 1))
    for b, row in enumerate(rows):
        starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]]
        for start, stop in zip(starts, starts[1:] + [len(row)]):
            def piece(t: Tensor | None) -> Tensor | None:
                return None if t is None else t[b : b + 1, start:stop]

            entering = state[b : b + 1] if start == 0 and row[0] == before[b] else torch.zeros_like(state[:1])
            ends = [(i, t - start) for i, t in enumerate(chunk.state_offsets)
                    if start <= t < stop and cotangent_of_state[i] is not None]
            y, states = _chunk_scan(
                piece(local["x"]), piece(local["dt"]), shared["A"], piece(local["B"]), piece(local["C"]),
                shared.get("D"), piece(local.get("z")), shared.get("dt_bias"), entering, None, None,
                [t for _, t in ends], dt_softplus, dt_limit,
            )  # fmt: skip
            outputs += [y, *states]
            cotangents += [dout[b : b + 1, start:stop], *(cotangent_of_state[i][b : b + 1] for i, _ in ends)]
    return outputs, cotangents


def ssd_bwd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    initial_states: Tensor | None,
    seq_idx: Tensor | None,
    cu_seqlens: Tensor | None,
    chunk_size: int,
    dt_softplus: bool,
    dt_limit: list[float],
    dout: Tensor,
    chunk_states: Tensor,
    dfinal_states: Tensor | None,
    dvarlen_states: Tensor | None,
    ungated: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states) of ssd_fwd's out,
    final_states and varlen_states, from ssd_fwd's chunk_states (recomputing each chunk: `ungated`
    is checked, not read); each in its input's dtype, an empty tensor for an absent optional input."""
    dims = check_ssd_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_limit)
    check_ssd_grad_inputs(dims, x, chunk_size, dout, chunk_states, dfinal_states, dvarlen_states, z, ungated)
    check_sequence_values(x.shape[1], seq_idx, cu_seqlens)
    batch, seqlen, nheads, headdim = x.shape
    chunks = _chunks(seqlen, chunk_size, cu_seqlens)
    chunk_states = chunk_states.view(batch, len(chunks), nheads, headdim, -1)
    per_token = {name: t for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C), ("z", z)) if t is not None}
    grads = {name: torch.empty_like(t, memory_format=torch.contiguous_format) for name, t in per_token.items()}
    # Inputs shared by all chunks: float32 leaves whose gradients add up over the chunks.
    shared = {name: t.detach().float().requires_grad_()
              for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)) if t is not None}
    shared_grads = {name: torch.zeros_like(t) for name, t in shared.items()}
    dstate = dfinal_states
    for chunk in reversed(chunks):
        local = {name: chunk.slice(t).detach().requires_grad_() for name, t in per_token.items()}
        state_needs_grad = chunk.index > 0 or initial_states is not None
        state = chunk_states[:, chunk.index].detach().requires_grad_(state_needs_grad)
        dout_c = chunk.slice(dout).float()
        dvarlen_c = None if dvarlen_states is None else [dvarlen_states[i][None] for i in chunk.varlen_ids]
        with _autograd_enabled():
            if seq_idx is not None and not _all_finite(*local.values(), state, dout_c, dstate, *(dvarlen_c or [])):
                outputs, cotangents = _by_sequence(chunk, seq_idx, local, shared, state, dout_c, dstate, dvarlen_c,
                                                   dt_softplus, dt_limit)
            else:
                y, (end_state, *varlen_ends) = _chunk_scan(
                    local["x"], local["dt"], shared["A"], local["B"], local["C"], shared.get("D"), local.get("z"),
                    shared.get("dt_bias"), state, chunk.slice(seq_idx), chunk.seq_before(seq_idx),
                    chunk.state_offsets, dt_softplus, dt_limit,
                )  # fmt: skip
                outputs, cotangents = [y], [dout_c]
                if dstate is not None:
                    outputs.append(end_state)
                    cotangents.append(dstate)
                if dvarlen_c is not None:
                    outputs += varlen_ends
                    cotangents += dvarlen_c
        inputs = {**local, **shared, **({"state": state} if state_needs_grad else {})}
        results = dict(zip(inputs, torch.autograd.grad(outputs, list(inputs.values()), cotangents,
                                                       materialize_grads=True)))
        for name in local:
            grads[name][:, chunk.start : chunk.stop] = results[name]
        for name in shared:
            shared_grads[name] += results[name]
        dstate = results.get("state")

    def optional(grad: Tensor | None, like: Tensor | None) -> Tensor:
        """An optional input's gradient in its dtype; an empty float32 tensor when it is absent."""
        return x.new_empty(0, dtype=torch.float32) if like is None else grad.to(like.dtype)

    return (
        grads["x"], grads["dt"], shared_grads["A"], grads["B"], grads["C"],
        optional(shared_grads.get("D"), D), optional(grads.get("z"), z),
        optional(shared_grads.get("dt_bias"), dt_bias), optional(dstate, initial_states),
    )  # fmt: skip
