"""Mamba-2's SSD scan as standard operators, for ONNX export: a decomposition of `ssd_scan_fwd`
into aten ops plus one `scan` over chunks (torch.onnx writes it as one ONNX `Scan`).

Each iteration takes one chunk of `q = min(chunk_size, MAX_CHUNK)` tokens and the state entering it, and computes
the chunk in SSD's quadratic form: tokens reach later tokens of the chunk through
`(C B^T * causal decay) @ (dt * x)`, the entering state reaches every token through `C @ state^T`
decayed by exp(cumsum(dt * A)), and the state leaving the chunk is `(x dt decayed to its end)^T
@ B` plus the decayed entering state. The graph has a fixed size whatever the sequence length
and runs `max(ceil(seqlen / q), 2)` iterations. The sequence is padded to whole chunks with
tokens that change nothing (dt = 0: no decay, no input) and belong to the last sequence.

`seq_idx` restarts the state where it changes, within a chunk (a mask on C B^T and on the
tokens that make the leaving state) and across chunks (the sequence id of the token before the
chunk is carried with the state). `cu_seqlens` (the varlen states) is not supported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.scan import scan

from .checks import keeps_ungated, num_chunks
from .default import discretize_dt

# Tokens per scan iteration (at most): the quadratic form costs q per token, an iteration's fixed cost
# is spread over q tokens
MAX_CHUNK = 64


def _chunks(t: Tensor, padded: int, q: int) -> Tensor:
    """(batch, seqlen, ...) -> (nchunks, batch, q, ...), zero-padded to `padded` tokens."""
    pad = [0, 0] * (t.dim() - 2) + [0, padded - t.shape[1]]
    return F.pad(t, pad).unflatten(1, (padded // q, q)).movedim(1, 0)


def ssd_scan_fwd(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus,
                 dt_limit, keep_ungated=False):
    """`ssmops::ssd_scan_fwd` from aten ops and a scan over chunks; `chunk_states` and `ungated` serve the
    backward only (an exported graph has none): zeros of their shapes."""
    if cu_seqlens is not None:
        raise NotImplementedError("ONNX export of ssd_scan_fwd: cu_seqlens (return_varlen_states) is not "
                                  "supported; pack sequences with seq_idx alone")
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.shape[-1]
    # At least two chunks: a symbolic count whose example value is 1 would be specialised by export.
    # The scan's chunks need not be the operator's (a speed setting): at most MAX_CHUNK tokens, the
    # quadratic form's cost per token
    q = min(chunk_size, MAX_CHUNK)
    padded = torch.sym_max((seqlen + q - 1) // q, 2) * q
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # before padding: padded tokens keep dt = 0
    ngroups = B.shape[2]
    per_group = nheads // ngroups
    A_col = A.float()[:, None]  # (nheads, 1)
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()

    # Heads (and groups) ahead of tokens, so that every product is a matrix product batched over
    # (batch, group, head): (nchunks, batch, nheads, q, headdim), (nchunks, batch, nheads, q) and
    # (nchunks, batch, ngroups, q, dstate); a group's C B^T is computed once for its heads.
    xs = [_chunks(x.float(), padded, q).permute(0, 1, 3, 2, 4), _chunks(dt, padded, q).transpose(2, 3),
          _chunks(B.float(), padded, q).transpose(2, 3), _chunks(C.float(), padded, q).transpose(2, 3)]
    if seq_idx is not None:
        # padded tokens belong to the last sequence, so that they never cut it off the leaving state
        last = torch.arange(padded, device=x.device).clamp(max=seqlen - 1)
        xs.append(seq_idx.long()[:, last].unflatten(1, (padded // q, q)).movedim(1, 0))

    def chunk(carry: list[Tensor], blk: list[Tensor]):
        state = carry[0]  # (batch, nheads, headdim, dstate)
        x_c, dt_c, B_c, C_c = blk[:4]
        batch_ = x_c.shape[0]
        by_group = (batch_, ngroups, per_group)
        log_decay = torch.cumsum(dt_c * A_col, dim=2)  # (batch, nheads, q) from the chunk start through l
        gap = log_decay[..., :, None] - log_decay[..., None, :]  # (batch, nheads, l, s)
        decay = torch.exp(gap.masked_fill(~causal, -torch.inf))
        mixer = decay.reshape(*by_group, q, q) * (C_c @ B_c.transpose(-1, -2)).unsqueeze(2)  # (b, g, hpg, l, s)
        carry_in = torch.exp(log_decay)  # the entering state's decay to each token
        to_end = torch.exp(log_decay[..., -1:] - log_decay)  # each token's decay to the chunk's end
        keep = torch.exp(log_decay[..., -1])  # (batch, nheads): the entering state's decay through the chunk
        if seq_idx is not None:
            seq_c, before = blk[4], carry[1]
            mixer = mixer * (seq_c[:, :, None] == seq_c[:, None, :])[:, None, None]
            carry_in = carry_in * (seq_c == before[:, None])[:, None]
            to_end = to_end * (seq_c == seq_c[:, -1:])[:, None]
            keep = keep * (seq_c[:, -1] == before)[:, None]
        xdt = (x_c * dt_c[..., None]).reshape(*by_group, q, headdim)
        y = mixer @ xdt  # (batch, ngroups, per_group, q, headdim)
        state_g = state.reshape(*by_group, headdim, dstate)
        y = y + (C_c.unsqueeze(2) @ state_g.transpose(-1, -2)) * carry_in.reshape(*by_group, q, 1)
        leaving = (xdt * to_end.reshape(*by_group, q, 1)).transpose(-1, -2) @ B_c.unsqueeze(2)
        leaving = leaving.reshape(state.shape) + state * keep[..., None, None]
        new_carry = [leaving] if seq_idx is None else [leaving, seq_c[:, -1].clone()]  # no aliases out of a scan
        return new_carry, y.reshape(batch_, nheads, q, headdim)

    state0 = (initial_states.float() if initial_states is not None
              else x.new_zeros(batch, nheads, headdim, dstate, dtype=torch.float32))
    # the initial state belongs to sequence 0 (mamba_ssm's rule)
    carry0 = [state0] if seq_idx is None else [state0, x.new_zeros(batch, dtype=torch.long)]
    carry, ys = scan(chunk, carry0, xs)
    # the padding cut off by a negative pad, not a slice: export cannot prove seqlen <= padded for a slice
    y = ys.permute(1, 0, 3, 2, 4).flatten(1, 2)  # (batch, padded, nheads, headdim)
    y = F.pad(y, (0, 0, 0, 0, 0, seqlen - padded))
    if D is not None:
        y = y + x.float() * (D.float() if D.dim() == 2 else D.float()[:, None])
    if z is not None:
        y = y * F.silu(z.float())
    chunk_states = x.new_zeros(batch, num_chunks(seqlen, chunk_size) * nheads, headdim, dstate, dtype=torch.float32)
    ungated = x.new_zeros(x.shape) if keeps_ungated(z, keep_ungated) else x.new_empty(0)
    return y.to(x.dtype), carry[0], chunk_states, x.new_empty(0, dtype=torch.float32), ungated
