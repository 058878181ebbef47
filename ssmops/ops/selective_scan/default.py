"""The `default` backend: pure PyTorch, any device.

The sequence is processed in blocks of T timesteps, time-major, so that one
timestep's state `(batch, dim, dstate)` is a contiguous slab and the recurrence
costs one fused `addcmul_` per step; everything else (exp, products with B and C,
gradients) is vectorised over the block. A block's working set is kept near 1 MiB
so it stays in cache, and no tensor ever spans the whole `seqlen * dstate`.

The backward recomputes: for each 2048-step chunk it runs forward from the saved
chunk-start state to collect block-start states, then walks the blocks in reverse,
recomputing each block's states from its start.

Complex A (mamba_ssm's complex mode) runs the same code on complex states: the state, A
and B/C are complex64 (a variable B/C's interleaved re/im pairs are viewed as complex),
y is twice the real part of <h, C>, and the backward takes conjugates where a real scan
has none (PyTorch's gradient convention, dL/d(re) + i dL/d(im)); on real tensors
`conj_physical()` returns the tensor itself, so the real scan pays nothing for it. (Not the
lazy `conj()`: inside a kernel that a TorchDispatchMode such as `use_backend` re-dispatches,
torch 2.13's mul, addcmul_ and einsum read a conjugate view as if it were not conjugated.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import CHUNK_LEN, ScanDims, check_scan_grad_inputs, check_scan_inputs, num_chunks

# Elements of one (T, batch, dim, dstate) block buffer; ~1 MiB of float32.
_BLOCK_ELEMS = 1 << 18
# Elements of one (span, batch, dim) input or output buffer; ~4 MiB of float32.
_SPAN_ELEMS = 1 << 20


def _block_len(dims: ScanDims, A: Tensor) -> int:
    """Largest power of two (so it divides CHUNK_LEN) keeping a block near _BLOCK_ELEMS
    (float32 elements: a complex state counts twice)."""
    slab = dims.batch * dims.dim * dims.dstate * (A.element_size() // 4)
    T = 1
    while T < CHUNK_LEN and 2 * T * slab <= _BLOCK_ELEMS:
        T *= 2
    return T


def _span_len(dims: ScanDims, T: int) -> int:
    """Timesteps whose (span, batch, dim) inputs are transposed to time-major at once:
    a multiple of T dividing CHUNK_LEN, near _SPAN_ELEMS elements."""
    S = T
    while S < CHUNK_LEN and 2 * S * dims.batch * dims.dim <= _SPAN_ELEMS:
        S *= 2
    return S


def _time_major(x: Tensor, t0: int, t1: int, dims: ScanDims) -> Tensor:
    """(batch, dim, seqlen) slice -> float32 (T, batch, groups, dim // groups)."""
    return x[:, :, t0:t1].permute(2, 0, 1).float().reshape(
        t1 - t0, dims.batch, dims.groups, dims.dim // dims.groups
    )


class _SpanWriter:
    """Writes (..., seqlen) outputs from time-major blocks: each block goes to a small
    time-major buffer, and a whole span is copied to the output at once, one long
    strided copy instead of a short one per block."""

    def __init__(self, span: int, outputs: dict[str, Tensor]):
        # time-major views of the outputs: (seqlen, batch, ...); buffers in float32 (or complex64)
        self.outs = {k: v.movedim(-1, 0) for k, v in outputs.items()}
        self.bufs = {
            k: v.new_empty((span, *v.shape[1:]), dtype=torch.promote_types(v.dtype, torch.float32))
            for k, v in self.outs.items()
        }
        self.span, self.s0, self.filled = span, None, 0

    def put(self, name: str, t0: int, t1: int, value: Tensor) -> None:
        s0 = t0 - t0 % self.span
        if s0 != self.s0:
            self.flush()
            self.s0 = s0
        buf = self.bufs[name]
        buf[t0 - s0 : t1 - s0] = value.reshape(t1 - t0, *buf.shape[1:])
        self.filled = max(self.filled, t1 - s0)

    def flush(self) -> None:
        if self.s0 is not None:
            for name, out in self.outs.items():
                out[self.s0 : self.s0 + self.filled] = self.bufs[name][: self.filled]
        self.s0, self.filled = None, 0


def _state_bc(M: Tensor, A: Tensor, seqlen: int) -> Tensor:
    """B or C with the state's element type: with complex A, a variable one (real, re/im
    interleaved along 2 * seqlen) viewed as complex (..., seqlen); otherwise M itself."""
    if A.is_complex() and M.dim() > 2:
        return torch.view_as_complex(M.float().unflatten(-1, (seqlen, 2)).contiguous())
    return M


class _Operands:
    """The scan's inputs, served block by block as float32 time-major tensors (B, C and
    the decay in the state's dtype, complex64 for complex A).

    Per block: u, dt (after bias/softplus) and z as (T, b, G, dg); B and C as
    (T, b, G, 1, n) when variable or (1, 1, G, dg, n) when constant, so both
    broadcast against a (T, b, G, dg, n) state block. Inputs are transposed a span
    of blocks at a time (kept until a block outside it is asked for), so blocks may
    be visited forward or in reverse.
    """

    def __init__(self, u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims: ScanDims, span: int,
                 dout: Tensor | None = None):
        self.u, self.delta, self.z, self.dout = u, delta, z, dout
        self.B, self.C = _state_bc(B, A, dims.seqlen), _state_bc(C, A, dims.seqlen)
        self.dims, self.span = dims, span
        G, dg, n = dims.groups, dims.dim // dims.groups, dims.dstate
        self.A = A.reshape(G, dg, n)
        # y = <h, C> for a real state; 2 Re<h, C> for a complex one (its conjugate pair is implied)
        self.y_scale = 2 if A.is_complex() else 1
        self.A_log2e = self.A * math.log2(math.e)  # torch's exp2 is several times faster than exp
        self.D = None if D is None else D.float().reshape(G, dg)
        self.bias = None if delta_bias is None else delta_bias.float().reshape(G, dg)
        self.softplus = delta_softplus
        self.s0, self.cached = None, {}

    def _bc_span(self, M: Tensor, t0: int, t1: int) -> Tensor:
        G, dg, n = self.dims.groups, self.dims.dim // self.dims.groups, self.dims.dstate
        state = self.A.dtype
        if M.dim() == 2:
            return M.to(state).reshape(1, 1, G, dg, n)
        M4 = M.unsqueeze(1) if M.dim() == 3 else M  # (b, groups_M, n, l)
        blk = M4[..., t0:t1].permute(3, 0, 1, 2).to(state)  # (T, b, groups_M, n)
        # contiguous: a strided operand makes the batched matmuls copy it matrix by matrix
        return blk.expand(t1 - t0, self.dims.batch, G, n).contiguous().unsqueeze(3)

    def _load_span(self, t0: int) -> int:
        s0 = t0 - t0 % self.span
        if s0 != self.s0:
            s1 = min(s0 + self.span, self.dims.seqlen)
            dt_raw = _time_major(self.delta, s0, s1, self.dims)
            if self.bias is not None:
                dt_raw = dt_raw + self.bias
            self.cached = {
                "u": _time_major(self.u, s0, s1, self.dims),
                "dt_raw": dt_raw,
                "dt": F.softplus(dt_raw) if self.softplus else dt_raw,
                "z": None if self.z is None else _time_major(self.z, s0, s1, self.dims),
                "dout": None if self.dout is None else _time_major(self.dout, s0, s1, self.dims),
                "B": self._bc_span(self.B, s0, s1),
                "C": self._bc_span(self.C, s0, s1),
            }
            self.s0 = s0
        return s0

    def block(self, t0: int, t1: int) -> dict[str, Tensor | None]:
        s0 = self._load_span(t0)
        blk = {
            k: v if v is None or v.shape[0] == 1 else v[t0 - s0 : t1 - s0]  # constant B/C: not sliced
            for k, v in self.cached.items()
        }
        dt = blk["dt"]
        blk["decay"] = (dt.unsqueeze(-1) * self.A_log2e).exp2_()
        blk["drive"] = (dt * blk["u"]).unsqueeze(-1) * blk["B"]
        return blk


def _scan_block(decay: Tensor, drive: Tensor, h: Tensor) -> Tensor:
    """Runs h_t = decay_t * h_{t-1} + drive_t in place over the block; drive becomes the states."""
    for t in range(drive.shape[0]):
        h = drive[t].addcmul_(decay[t], h)
    return drive


def _sum_state(x: Tensor, M: Tensor, variable: bool) -> Tensor:
    """sum_n x[..., n] * M[..., n] for a (T, b, G, dg, n) block -> (T, b, G, dg).

    M is (T, b, G, 1, n) when variable, else (1, 1, G, dg, n); einsum turns both
    into batched matrix products, well ahead of a broadcast multiply and sum.
    """
    if variable:
        return torch.einsum("tbgdn,tbgn->tbgd", x, M.squeeze(3))
    return torch.einsum("tbgdn,gdn->tbgd", x, M[0, 0])


def _grad_bc(x: Tensor, v: Tensor, variable: bool) -> Tensor:
    """d/dM of sum x * v * M (v real): (T, b, G, n) when M is variable, else summed to (G, dg, n)."""
    if variable:
        return (x * v.unsqueeze(-1)).sum(3)
    return torch.einsum("tbgdn,tbgd->gdn", x, v.to(x.dtype))


def _output(states: Tensor, ops: _Operands, blk) -> Tensor:
    """y_t = <h_t, C_t> + D u_t over a block (2 Re<h_t, C_t> for a complex state)."""
    y = _sum_state(states, blk["C"], ops.C.dim() > 2)
    if y.is_complex():
        y = ops.y_scale * y.real
    return y if ops.D is None else y + ops.D * blk["u"]


def _input_layout(dM: Tensor, M: Tensor) -> Tensor:
    """A variable B/C's complex gradient (..., seqlen) in M's real layout, re/im interleaved."""
    return torch.view_as_real(dM).flatten(-2) if dM.is_complex() and not M.is_complex() else dM


def _blocks(t0: int, t1: int, T: int):
    return [(s, min(s + T, t1)) for s in range(t0, t1, T)]


def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus):
    dims = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, dim, seqlen, n, G = dims
    T = _block_len(dims, A)
    span = _span_len(dims, T)
    ops = _Operands(u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims, span)
    out = torch.empty_like(u, memory_format=torch.contiguous_format)
    out_z = torch.empty_like(out) if z is not None else u.new_empty(0)
    writer = _SpanWriter(span, {"out": out, "out_z": out_z} if z is not None else {"out": out})
    x = u.new_empty(batch, dim, num_chunks(seqlen), 2 * n, dtype=A.dtype)
    shape5 = (batch, G, dim // G, n)
    h = initial_state.reshape(shape5) if initial_state is not None else u.new_zeros(shape5, dtype=A.dtype)
    dt_total = u.new_zeros(batch, G, dim // G, dtype=torch.float32)
    for c in range(num_chunks(seqlen)):
        c0, c1 = c * CHUNK_LEN, min((c + 1) * CHUNK_LEN, seqlen)
        for t0, t1 in _blocks(c0, c1, T):
            blk = ops.block(t0, t1)
            states = _scan_block(blk["decay"], blk["drive"], h)
            h = states[-1]
            y = _output(states, ops, blk)
            writer.put("out", t0, t1, y)
            if z is not None:
                writer.put("out_z", t0, t1, y * F.silu(blk["z"]))
            dt_total += blk["dt"].sum(0)
        # mamba_ssm's layout: cumulative decay since t=0 (even) and state (odd) at chunk end
        x[:, :, c, 0::2] = torch.exp(dt_total.unsqueeze(-1) * ops.A).reshape(batch, dim, n)
        x[:, :, c, 1::2] = h.reshape(batch, dim, n)
    writer.flush()
    return out, x.view(batch, dim, -1), out_z, h.reshape(batch, dim, n).clone()


def selective_scan_bwd(
    u, delta, A, B, C, D, z, delta_bias, initial_state, dout, scan_intermediates, dlast_state,
    delta_softplus,
):
    dims = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    check_scan_grad_inputs(dims, u, A, dout, scan_intermediates, dlast_state)
    batch, dim, seqlen, n, G = dims
    dg = dim // G
    T = _block_len(dims, A)
    span = _span_len(dims, T)
    ops = _Operands(u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims, span, dout=dout)
    f32 = dict(dtype=torch.float32, device=u.device)
    state = dict(dtype=A.dtype, device=u.device)  # the states' and A's (complex64 for complex A)
    du = torch.empty_like(u, memory_format=torch.contiguous_format)
    ddelta = torch.empty_like(du)
    dz = torch.empty_like(du) if z is not None else u.new_empty(0)
    dA = torch.zeros(G, dg, n, **state)
    dD = torch.zeros(G, dg, **f32)
    dbias = torch.zeros(G, dg, **f32)
    # Variable B/C gradients are written per block as (b, groups, n, l); constant ones summed.
    dBC = {}
    for name, M in (("B", B), ("C", C)):
        dBC[name] = (
            torch.zeros(batch, M.shape[1] if M.dim() == 4 else 1, n, seqlen, **state)
            if M.dim() > 2
            else torch.zeros(G, dg, n, **state)
        )
    carry = (
        dlast_state.reshape(batch, G, dg, n).clone()
        if dlast_state is not None
        else torch.zeros(batch, G, dg, n, **state)
    )
    per_step = {"du": du, "ddelta": ddelta, **({"dz": dz} if z is not None else {})}
    per_step.update({f"d{k}": v for k, v in dBC.items() if v.dim() == 4})  # variable B/C
    writer = _SpanWriter(span, per_step)
    chunk_states = scan_intermediates.reshape(batch, dim, num_chunks(seqlen), 2 * n)[..., 1::2]
    for c in reversed(range(num_chunks(seqlen))):
        c0, c1 = c * CHUNK_LEN, min((c + 1) * CHUNK_LEN, seqlen)
        if c > 0:
            h = chunk_states[:, :, c - 1].reshape(batch, G, dg, n)
        elif initial_state is not None:
            h = initial_state.reshape(batch, G, dg, n)
        else:
            h = torch.zeros(batch, G, dg, n, **state)
        starts = []
        for t0, t1 in _blocks(c0, c1, T):
            starts.append(h)
            blk = ops.block(t0, t1)
            h = _scan_block(blk["decay"], blk["drive"], h)[-1].clone()
        for (t0, t1), h0 in reversed(list(zip(_blocks(c0, c1, T), starts))):
            blk = ops.block(t0, t1)
            decay = blk["decay"]
            states = _scan_block(decay, blk["drive"], h0)
            g_out = blk["dout"]
            if blk["z"] is not None:
                y = _output(states, ops, blk)
                sig = torch.sigmoid(blk["z"])
                silu = blk["z"] * sig
                writer.put("dz", t0, t1, g_out * y * (sig + silu * (1 - sig)))
                dy = g_out * silu
            else:
                dy = g_out
            dy_state = ops.y_scale * dy if ops.y_scale != 1 else dy  # d loss / d <h_t, C_t>
            # g_t = conj(C_t) dy_t + conj(decay_{t+1}) g_{t+1}: total gradient reaching h_t.
            decay_c = decay.conj_physical()
            g = dy_state.unsqueeze(-1) * blk["C"].conj_physical()
            g[-1] += carry
            for t in range(g.shape[0] - 2, -1, -1):
                g[t].addcmul_(decay_c[t + 1], g[t + 1])
            carry = decay_c[0] * g[0]
            q = g * decay_c  # times conj(h_{t-1}): d/d(dt * A) of the decay term
            q[0] *= h0.conj_physical()
            q[1:] *= states[:-1].conj_physical()
            dA += torch.einsum("tbgdn,tbgd->gdn", q, blk["dt"].to(q.dtype))
            ddt = _sum_state(q, ops.A[None, None].conj_physical(), False).real
            d_dtu = _sum_state(g, blk["B"].conj_physical(), B.dim() > 2).real  # d/d(dt * u) of the drive term
            ddt = ddt + d_dtu * blk["u"]
            du_blk = d_dtu * blk["dt"]
            if ops.D is not None:
                du_blk = du_blk + ops.D * dy
                dD += (dy * blk["u"]).sum((0, 1))
            if delta_softplus:
                ddt = ddt * torch.sigmoid(blk["dt_raw"])
            dbias += ddt.sum((0, 1))
            writer.put("du", t0, t1, du_blk)
            writer.put("ddelta", t0, t1, ddt)
            for name, M, x, v in (
                ("B", B, g, blk["dt"] * blk["u"]),
                ("C", C, states.conj_physical(), dy_state),
            ):
                grad = _grad_bc(x, v, M.dim() > 2)
                if M.dim() > 2:
                    # sum the channel groups that share one B/C group
                    grad = grad.reshape(t1 - t0, batch, dBC[name].shape[1], -1, n).sum(3)
                    writer.put(f"d{name}", t0, t1, grad)
                else:
                    dBC[name] += grad
    writer.flush()
    dB, dC = (_input_layout(dBC[k], M).reshape(M.shape).to(M.dtype) for k, M in (("B", B), ("C", C)))
    return (
        du, ddelta, dA.reshape(dim, n), dB, dC,
        dD.reshape(dim) if D is not None else u.new_empty(0, dtype=torch.float32),
        dbias.reshape(dim) if delta_bias is not None else u.new_empty(0, dtype=torch.float32),
        dz,
        carry.reshape(batch, dim, n) if initial_state is not None else u.new_empty(0, dtype=torch.float32),
    )
