"""The SSD scan's Triton backend: launchers, and the `ssmops::ssd_scan_{fwd,bwd}_triton` operators.

`ssd_fwd` and `ssd_bwd` take the arguments of the main operators' schemas, in the same order,
check them, allocate the outputs and launch the kernels (`triton_kernels.py`, which explains
the work division) through `torch.library.wrap_triton`, so that torch.compile and AOTInductor
record the kernel launches themselves. They serve CUDA/ROCm/XPU tensors, and CPU tensors
under `TRITON_INTERPRET=1`. The `triton_op`s below wrap them; the registry gives those the
main operators' fakes and autograd.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from .. import _triton, _tuning
from .checks import check_sequence_values, check_ssd_grad_inputs, check_ssd_inputs, keeps_ungated, num_chunks
from .triton_kernels import (
    ssd_bwd_dcb_kernel, ssd_bwd_ddt_kernel, ssd_bwd_dx_kernel, ssd_bwd_group_kernel, ssd_cb_kernel,
    ssd_chunk_scan_kernel, ssd_chunk_states_kernel, ssd_dt_kernel, ssd_gate_grad_kernel, ssd_state_grads_kernel,
    ssd_state_passing_kernel, ssd_varlen_states_kernel,
)

# Tiles, warps and software-pipelining stages (num_stages: loads in flight in the GEMM loops; Triton's default
# on NVIDIA is 3) of the launches: module constants, read at each launch, so that `benchmarks/gpu.py --sweep`
# can retune them on a GPU. Chosen from the sm_90 compile at Mamba-2's sizes (benchmarks/triton_static.py,
# docs/limits.md; tests/test_triton.py holds them to no spills there), then from an H200's sweep at mamba2-2.7b's
# layer (28 Nov, Triton 3.6): 4 warps beat 8 in the output kernel and the dX pass.
SCAN_BLOCK_T = 64  # the forward's output kernel: tokens a program (and the side of C.B^T's tiles)
SCAN_BLOCK_P = 64  # its channels a program (32: twice the programs and C.B^T reads, 143 registers under Triton 3.6,
# three programs an SM; 180 under 3.9, two)
SCAN_WARPS = 4  # (8 warps, the sm_90 compile's choice, ran 4.95 ms where 4 ran 3.82 on an H200: docs/limits.md)
SCAN_STAGES = 2  # 225 registers on sm_90 (Triton 3.9; 229 under 3.6): two programs an SM with 1 to 3 stages
# The backward's dX pass takes token blocks of 64, headdim and dstate whole (blocks of 32: twice the programs,
# each reading dE whole and the gated dout's blocks after its own: 6.1 GB requested from the L2 at mamba2-2.7b's
# layer, not 4.8), on 4 warps: 222 registers on sm_90, and ~1.6 ms less a forward+backward than 8 on an H200.
BWD_BLOCK_T = 64
BWD_WARPS = 4
BWD_STAGES = 2
GATE_BLOCK_T = 32  # the gradient through the gate: elementwise, (32, headdim) tiles
# dB and dC: a program walks a run of at most GROUP_HEADS heads of a group (the group's heads split into equal
# runs; torch sums the runs), summing the gradient of C.B^T over them (ssd_bwd_dcb_kernel, a pair of token blocks
# a program), then multiplying it by B and C once a run (ssd_bwd_group_kernel, a token block a program). 4 warps
# ran mamba2-2.7b's forward+backward in 11.6-11.7 ms where 8 ran 12.3-12.4 (two sweeps on an H200, 28 Nov),
# although the dC launch then spilled 112 bytes on sm_90 inside its loop over the heads (24 since its dy goes to the
# GEMM as loaded; 104 under Triton 3.6).
GROUP_BLOCK_T = 64
GROUP_HEADS = 16
GROUP_WARPS = 4
GROUP_STAGES = 2
DCB_WARPS = 4
STATE_WARPS = 8  # the state passes, forward and backward (a (64, 64) state tile and a block's tiles)
STATE_STAGES = 3  # (2: 134 and 136 registers on sm_90, still over 128, and 16 bytes spilled on sm_80)
# The state tiles' states (a (64, STATE_BLOCK_N) tile a program): batch x nheads x dstate / STATE_BLOCK_N programs
# in the backward's walk over the chunks, nchunks times as many in the forward's chunk states. Whole (128) reads x
# once, not once per 64 states (0.5 ms less a forward at mamba2-2.7b's layer on an H200, when the forward walked
# too), but leaves mamba2-130m's layer 24 programs in the walk (docs/limits.md).
STATE_BLOCK_N = 128
# The forward's state passing, element-wise: (PASSING_BLOCK_P, STATE_BLOCK_N) states a program, 2,560 programs at
# mamba2-2.7b's layer, each walking the chunks.
PASSING_BLOCK_P = 16
# C.B^T's tiles in the GEMMs' 16-bit operand dtype (when x, B and C share one): half the output loop's largest
# read and 128 registers with SCAN_STAGES 2 (float32 tiles: 1 program an SM), for one more rounding of C.B^T
# before its decay (bf16 errors against the float64 oracle up to ~1.9x, inside the tolerances; docs/limits.md).
# mamba_ssm keeps its CB in float32: False does too.
CB_IN_OPERAND_DTYPE = True

# What SSMOPS_AUTOTUNE=1 times per shape (ops/_tuning.py), each phase's knobs in the call that launches with them:
# the state passes' are the forward's (the backward's state pass reads them too).
# (CB_IN_OPERAND_DTYPE is a precision and SCAN_BLOCK_T the layout of C.B^T's tiles: not tuned.)
TUNING_SPACE = {"SCAN_BLOCK_P": (32, 64), "SCAN_WARPS": (4, 8), "SCAN_STAGES": (1, 2, 3), "STATE_WARPS": (4, 8),
                "STATE_STAGES": (1, 2, 3), "STATE_BLOCK_N": (32, 64, 128),
                "BWD_BLOCK_T": (32, 64), "BWD_WARPS": (4, 8), "BWD_STAGES": (1, 2, 3), "GROUP_BLOCK_T": (32, 64),
                "GROUP_HEADS": (4, 8, 16, 32), "GROUP_WARPS": (4, 8), "GROUP_STAGES": (1, 2, 3), "DCB_WARPS": (4, 8)}
FORWARD_KNOBS = ("SCAN_BLOCK_P", "SCAN_WARPS", "SCAN_STAGES", "STATE_WARPS", "STATE_STAGES", "STATE_BLOCK_N")
BACKWARD_KNOBS = tuple(name for name in TUNING_SPACE if name not in FORWARD_KNOBS)
TUNER = _tuning.Tuner("ssd", lambda: {name: globals()[name] for name in (*TUNING_SPACE, "SCAN_BLOCK_T",
                                                                          "CB_IN_OPERAND_DTYPE")}, TUNING_SPACE)


def _config(chunk_size: int, headdim: int, dstate: int, knobs: dict) -> dict:
    """Token blocks of SCAN_BLOCK_T (16 at least: a GEMM side), dstate whole (the C.B^T contraction) and
    headdim in blocks of SCAN_BLOCK_P in the forward's output kernel; 16-bit GEMM operands need sides of 16.
    CHUNK_TOKENS: a chunk's tokens rounded up to a power of two, what a kernel loads at once to sum the log
    decays of several blocks (`_a_sum`)."""
    return dict(BLOCK_T=_triton.pow2_tile(chunk_size, 16, knobs["SCAN_BLOCK_T"]),
                BLOCK_P=_triton.pow2_tile(headdim, 16, knobs["SCAN_BLOCK_P"]),
                BLOCK_N=_triton.pow2_tile(dstate, 16, _triton.NO_CAP),
                CHUNK_TOKENS=_triton.pow2_tile(chunk_size, 16, _triton.NO_CAP))


def _state_tiles(headdim: int, dstate: int, knobs: dict) -> dict:
    """(headdim, dstate) tiles of the state-passing kernels: 64 x STATE_BLOCK_N, so that batch * nheads * tiles
    programs fill the GPU while each walks the chunks in order."""
    return dict(BLOCK_P=_triton.pow2_tile(headdim, 16, 64),
                BLOCK_N=_triton.pow2_tile(dstate, 16, knobs["STATE_BLOCK_N"]))


def _dot_f32(x: Tensor, B: Tensor, C: Tensor) -> bool:
    """GEMMs in float32 unless x, B and C share one 16-bit dtype (then their operands are in it)."""
    return not (x.dtype == B.dtype == C.dtype and x.dtype in (torch.float16, torch.bfloat16))


def _strides(t: Optional[Tensor], rank: int) -> tuple:
    return tuple(t.stride()) if t is not None else (0,) * rank


def _is_real(t: Optional[Tensor]) -> bool:
    """A tensor with data (not a fake or functional one being traced): the value checks can read it."""
    return t is None or type(t) is Tensor


def _varlen_firsts(cu_seqlens: Tensor, nchunks: int, chunk_size: int) -> Tensor:
    """firsts[c]: the first sequence whose last token, cu_seqlens[i + 1] - 1, is in chunk c or later."""
    ends = cu_seqlens[1:].to(torch.int64) - 1
    starts = torch.arange(nchunks + 1, device=cu_seqlens.device, dtype=torch.int64) * chunk_size
    return torch.searchsorted(ends, starts).to(torch.int32)


class _Launch:
    """What every launch of one call shares: sizes, the per-token inputs' strides, the flags."""

    def __init__(self, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size,
                 dt_softplus, dt_limit):
        self.batch, self.seqlen, self.nheads, self.headdim, self.ngroups, self.dstate, self.nseq = check_ssd_inputs(
            x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_limit)
        if _is_real(seq_idx) and _is_real(cu_seqlens):
            check_sequence_values(self.seqlen, seq_idx, cu_seqlens)
        self.chunk_size = chunk_size
        self.nchunks = num_chunks(self.seqlen, chunk_size)
        lo, hi = (float(v) for v in dt_limit) if len(dt_limit) == 2 else (0.0, 0.0)
        self.sizes = (self.seqlen, self.nheads, self.headdim, self.dstate, chunk_size, self.nchunks,
                      self.nheads // self.ngroups, lo, hi)
        self.inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, bias=dt_bias, seq=seq_idx)
        self.flags = dict(HAS_BIAS=dt_bias is not None, HAS_SEQ=seq_idx is not None, SOFTPLUS=bool(dt_softplus),
                          HAS_LIMIT=len(dt_limit) == 2, DOT_F32=_dot_f32(x, B, C))
        self.d_flags = dict(HAS_D=D is not None, D_CHANNEL=D is not None and D.dim() == 2)
        self.key = self._tuning_key(B, chunk_size, cu_seqlens)
        self.knobs, self.cfg = {}, {}  # (use_knobs)
        self.given_strides = {}  # an input's strides where its tensor is a flat buffer (dt_processed's)
        self.block_sums = 0  # the tokens of the blocks dt_processed's sums of a are over (0: none)

    def use_knobs(self, knobs: dict) -> "_Launch":
        """This launch with its knobs (TUNER's choice) and the output kernel's tiles they set."""
        self.knobs, self.cfg = knobs, _config(self.chunk_size, self.headdim, self.dstate, knobs)
        return self

    def _tuning_key(self, B: Tensor, chunk_size: int, cu_seqlens: Optional[Tensor]) -> Optional[str]:
        """What the knobs are tuned for: the sizes a model layer keeps from call to call, the dtypes and which
        optionals are given; not batch or seqlen (dynamic in a compiled graph). None where a size is symbolic."""
        sizes = (self.nheads, self.ngroups, self.headdim, self.dstate, chunk_size)
        if not all(type(size) is int for size in sizes):
            return None
        given = [name for name in ("D", "z", "bias", "seq") if self.inputs[name] is not None]
        given += ["D per channel"] * self.d_flags["D_CHANNEL"] + ["cu_seqlens"] * (cu_seqlens is not None)
        return (f"heads {self.nheads} groups {self.ngroups} headdim {self.headdim} dstate {self.dstate} "
                f"chunk {chunk_size} {self.inputs['x'].dtype}/{B.dtype} {'+'.join(given)}")

    def ptr(self, name: str) -> Tensor:
        """An input, or a stand-in pointer for an absent one (never read)."""
        t = self.inputs[name]
        return t if t is not None else self.inputs["x"]

    def token_strides(self, *names: str) -> tuple:
        """(batch, seqlen, head/group, channel/state) strides of x, B, C, z or dout; (batch, seqlen,
        head) of dt; (batch, seqlen) of seq_idx; zeros for an absent one."""
        rank = {"dt": 3, "seq": 2}
        return sum((self.given_strides.get(n) or _strides(self.inputs.get(n), rank.get(n, 4)) for n in names), ())

    def dt_processed(self) -> "_Launch":
        """This launch with dt in place of dt + dt_bias through softplus and the clamp, as ssd_dt_kernel writes it
        (float32, a contiguous row of tokens per (batch, head), followed by the sums of a = dt A over each block of
        the output kernel's tokens up to each token): dt_bias, softplus and dt_limit are then done. Every kernel
        but ssd_bwd_ddt_kernel (which differentiates through them) reads it."""
        dt = self.inputs["dt"]
        rows = _triton.output((self.batch * self.nheads * 2 * self.seqlen,), torch.float32, dt.device)
        block = self.cfg["BLOCK_T"]
        blocks = _triton.cdiv(self.chunk_size, block)
        _triton.launch(ssd_dt_kernel, (self.nchunks * blocks, self.batch * self.nheads), (
            dt, self.ptr("bias"), self.inputs["A"], rows, self.seqlen, self.nheads, self.chunk_size, blocks,
            *self.sizes[-2:], *dt.stride(),
        ), dict(**{k: self.flags[k] for k in ("HAS_BIAS", "SOFTPLUS", "HAS_LIMIT")}, BLOCK_T=block, num_warps=4))
        processed = copy.copy(self)
        # (the flat buffer with its strides as numbers: a traced view's strides may not be the ones Inductor
        # gives it, see _triton.contiguous_when_traced)
        processed.inputs = dict(self.inputs, dt=rows, bias=None)
        processed.given_strides = dict(dt=(self.nheads * 2 * self.seqlen, 1, 2 * self.seqlen))
        processed.flags = dict(self.flags, HAS_BIAS=False, SOFTPLUS=False, HAS_LIMIT=False)
        processed.block_sums = block
        return processed

    def sums_over(self, block: int) -> bool:
        """Whether dt holds dt_processed's sums of a over blocks of `block` tokens (a kernel's BLOCK_SUMS)."""
        return self.block_sums == block

    def state_launch(self) -> dict:
        """The state passes' warps and stages (forward and backward)."""
        return dict(num_warps=self.knobs["STATE_WARPS"], num_stages=self.knobs["STATE_STAGES"])

    def state_grid(self, tiles: dict, rows: int) -> tuple:
        return (_triton.cdiv(self.headdim, tiles["BLOCK_P"]) * _triton.cdiv(self.dstate, tiles["BLOCK_N"]), rows)

    def cb_side(self) -> int:
        """The side of each chunk's C . B^T in cb_tiles' buffer: the chunk in whole blocks of the forward's tokens."""
        return _triton.cdiv(self.chunk_size, self.cfg["BLOCK_T"]) * self.cfg["BLOCK_T"]

    def cb_tiles(self) -> Tensor:
        """C . B^T of each chunk's blocks (the lower block triangle), once per group of heads: (batch, nchunks,
        ngroups, cb_side, cb_side), for the output kernel and the backward's dX pass. In the GEMMs' operand
        dtype: 16-bit where x, B and C share one (the tiles are the output loop's largest read, and each
        becomes a 16-bit GEMM operand once decayed), else float32."""
        cfg, side = self.cfg, self.cb_side()
        blocks = side // cfg["BLOCK_T"]
        x = self.inputs["x"]
        f32 = self.flags["DOT_F32"] or not self.knobs["CB_IN_OPERAND_DTYPE"]
        cb = _triton.output((self.batch, self.nchunks, self.ngroups, side, side), torch.float32 if f32 else x.dtype,
                            x.device)
        _triton.launch(ssd_cb_kernel, (self.nchunks * blocks, self.batch * self.ngroups), (
            self.ptr("B"), self.ptr("C"), cb, self.seqlen, self.ngroups, self.chunk_size, self.nchunks, blocks,
            *self.token_strides("B", "C"), self.dstate,
        ), dict(DOT_F32=self.flags["DOT_F32"], BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], num_warps=4))
        return cb

    def chunk_scan(self, states: Tensor, cb: Tensor, out: Tensor, ungated: Optional[Tensor] = None,
                   gate: bool = True) -> None:
        """out = the scan's output (x's layout), by blocks of tokens and channels of each head, reading cb
        (cb_tiles); with z, into ungated the output before the gate too, where given. gate False: out is y
        before the gate."""
        cfg = self.cfg
        blocks = _triton.cdiv(self.chunk_size, cfg["BLOCK_T"])
        D = self.inputs["D"]
        grid = (self.nchunks * blocks, self.batch * self.nheads, _triton.cdiv(self.headdim, cfg["BLOCK_P"]))
        _triton.launch(ssd_chunk_scan_kernel, grid, (
            *(self.ptr(n) for n in ("x", "dt", "A", "B", "C", "D", "z", "bias", "seq")), states, cb, out,
            ungated if ungated is not None else out, *self.sizes, blocks,
            *self.token_strides("x", "dt", "B", "C", "z", "seq"), D.stride(0) if D is not None else 0,
        ), dict(**self.d_flags, HAS_Z=gate and self.inputs["z"] is not None, KEEP_UNGATED=ungated is not None,
                **self.flags, **cfg, BLOCK_SUMS=self.sums_over(cfg["BLOCK_T"]), num_warps=self.knobs["SCAN_WARPS"],
                num_stages=self.knobs["SCAN_STAGES"]))


def ssd_fwd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    dt_bias: Optional[Tensor], initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
    cu_seqlens: Optional[Tensor], chunk_size: int, dt_softplus: bool, dt_limit: list[float],
    keep_ungated: bool = False, knobs: Optional[dict] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(knobs: the launch knobs, TUNER's for the call's key when None.)"""
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = _triton.contiguous_when_traced(
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
    args = (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus, dt_limit)
    run = _Launch(*args)
    run = run.use_knobs(TUNER.choose(run.key, x.device, "forward", FORWARD_KNOBS,
                                     lambda k: ssd_fwd(*args, keep_ungated, k), knobs)).dt_processed()
    f32 = dict(dtype=torch.float32, device=x.device)
    batch, nheads, headdim, dstate = run.batch, run.nheads, run.headdim, run.dstate
    # every buffer a kernel writes is 1-D (contiguous), viewed as its shape after the launch (_triton.output)
    states_shape, final_shape = (batch, run.nchunks * nheads, headdim, dstate), (batch, nheads, headdim, dstate)
    states, final = _triton.output(states_shape, **f32), _triton.output(final_shape, **f32)
    # the chunk states as the output kernel's GEMM takes them: in its 16-bit operand dtype where it has one (each
    # of its programs reads a whole state), else the float32 buffer itself
    states_op = states if run.flags["DOT_F32"] else _triton.output(states_shape, x.dtype, x.device)
    # every chunk's own part of the state after it, into states, then the chunks passed in order (element-wise).
    # (Registers for two programs an SM, 128 at 8 warps: ptxas takes 133 on sm_90 under Triton 3.6 and spills
    # 8 bytes at 128; 3.9 takes 118. A traced launch leaves them to ptxas: _triton.launch.)
    tiles = _state_tiles(headdim, dstate, run.knobs)
    decays = _triton.output((batch, run.nchunks, nheads), **f32)
    per_chunk = run.state_grid(tiles, 1)[0]
    _triton.launch(ssd_chunk_states_kernel, (run.nchunks * per_chunk, batch * nheads), (
        *(run.ptr(n) for n in ("x", "dt", "A", "B", "bias", "seq")), states, decays, *run.sizes, per_chunk,
        *run.token_strides("x", "dt", "B", "seq"),
    ), dict(**run.flags, BLOCK_T=run.cfg["BLOCK_T"], **tiles, **run.state_launch(),
            maxnreg=min(255, 32768 // (32 * run.knobs["STATE_WARPS"]))))
    passing = dict(BLOCK_P=_triton.pow2_tile(headdim, 16, PASSING_BLOCK_P), BLOCK_N=tiles["BLOCK_N"])
    _triton.launch(ssd_state_passing_kernel, run.state_grid(passing, batch * nheads), (
        states, states_op, decays, initial_states if initial_states is not None else x, run.ptr("seq"), final,
        *run.sizes[:6], *run.token_strides("seq"), *_strides(initial_states, 4),
    ), dict(HAS_INIT=initial_states is not None, HAS_SEQ=run.flags["HAS_SEQ"], DOT_F32=run.flags["DOT_F32"],
            **passing, num_warps=4))
    out = _triton.output(x.shape, x.dtype, x.device)
    ungated = _triton.output(x.shape, x.dtype, x.device) if keeps_ungated(z, keep_ungated) else None
    run.chunk_scan(states_op, run.cb_tiles(), out, ungated)
    varlen = x.new_empty(0, dtype=torch.float32)
    if cu_seqlens is not None:
        varlen = _triton.output((run.nseq, nheads, headdim, dstate), **f32)
        _triton.launch(ssd_varlen_states_kernel, run.state_grid(tiles, run.nseq * nheads), (
            *(run.ptr(n) for n in ("x", "dt", "A", "B", "bias", "seq")), cu_seqlens, states, varlen, *run.sizes,
            *x.stride()[1:], *run.token_strides("dt")[1:], *B.stride()[1:], seq_idx.stride(1),
        ), dict(**run.flags, BLOCK_T=run.cfg["BLOCK_T"], **tiles, **run.state_launch()))
    return out.view(x.shape), final.view(final_shape), states.view(states_shape), \
        varlen.view(run.nseq, nheads, headdim, dstate) if cu_seqlens is not None else varlen, \
        ungated.view(x.shape) if ungated is not None else x.new_empty(0)


def ssd_bwd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    dt_bias: Optional[Tensor], initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
    cu_seqlens: Optional[Tensor], chunk_size: int, dt_softplus: bool, dt_limit: list[float], dout: Tensor,
    chunk_states: Tensor, dfinal_states: Optional[Tensor], dvarlen_states: Optional[Tensor],
    ungated: Optional[Tensor] = None, knobs: Optional[dict] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(knobs: the launch knobs, TUNER's for the call's key when None.)"""
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dout, ungated = _triton.contiguous_when_traced(
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dout, ungated)
    args = (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus, dt_limit)
    grad_args = (dout, chunk_states, dfinal_states, dvarlen_states, ungated)
    raw = _Launch(*args)
    raw.use_knobs(TUNER.choose(raw.key, x.device, "backward", BACKWARD_KNOBS, lambda k: ssd_bwd(*args, *grad_args, k),
                               knobs))
    run = raw.dt_processed()  # (ssd_bwd_ddt_kernel differentiates through dt_bias, softplus and the clamp: raw)
    dims = (run.batch, run.seqlen, run.nheads, run.headdim, run.ngroups, run.dstate, run.nseq)
    check_ssd_grad_inputs(dims, x, chunk_size, dout, chunk_states, dfinal_states, dvarlen_states, z, ungated)
    batch, seqlen, nheads, headdim, ngroups, dstate, _ = dims
    nchunks = run.nchunks
    f32 = dict(dtype=torch.float32, device=x.device)
    states = chunk_states.contiguous()
    dfinal = dfinal_states.contiguous() if dfinal_states is not None else None
    dvarlen = dvarlen_states.contiguous() if dvarlen_states is not None and cu_seqlens is not None else None
    firsts = _varlen_firsts(cu_seqlens, nchunks, chunk_size) if dvarlen is not None else None
    varlen_args = (dvarlen, cu_seqlens, firsts) if dvarlen is not None else (states, states, states)
    # every buffer a kernel writes is 1-D (contiguous), viewed as its shape after the launch (_triton.output)
    state_shape = (batch, nheads, headdim, dstate)
    dends = _triton.output(states.shape, **f32)
    dinit = _triton.output(state_shape, **f32) if initial_states is not None else x.new_empty(0, dtype=torch.float32)
    # the chunk states and dends as the chunk passes' GEMMs take them: in their 16-bit operand dtype where
    # they have one (written by the same launch), else the float32 buffers themselves
    states_op, dends_op = states, dends
    if not run.flags["DOT_F32"]:
        states_op, dends_op = (_triton.output(states.shape, x.dtype, x.device) for _ in range(2))
    cb = run.cb_tiles()  # (for the dX pass, and the output before the gate where the forward did not keep it)
    dz, gated = _through_gate(run, states, cb, dout, ungated)

    # the gradient of the state after each chunk, walking the chunks back
    tiles = _state_tiles(headdim, dstate, run.knobs)
    _triton.launch(ssd_state_grads_kernel, run.state_grid(tiles, batch * nheads), (
        *(run.ptr(n) for n in ("dt", "A", "C", "bias", "seq")), gated,
        dfinal if dfinal is not None else states, *varlen_args, dends, dinit if initial_states is not None else dends,
        states, states_op, dends_op,
        *run.sizes, *run.token_strides("dt", "C"), *gated.stride(), *run.token_strides("seq"),
    ), dict(HAS_DFINAL=dfinal is not None, HAS_DVARLEN=dvarlen is not None, HAS_INIT=initial_states is not None,
            **run.flags, BLOCK_T=run.cfg["BLOCK_T"], CHUNK_TOKENS=run.cfg["CHUNK_TOKENS"], **tiles,
            BLOCK_SUMS=run.sums_over(run.cfg["BLOCK_T"]), **run.state_launch()))

    # every chunk's gradients, by blocks of tokens: dx per head, dB and dC per run of a group's heads
    dx = _triton.output(x.shape, x.dtype, x.device)
    ddt = _triton.output(dt.shape, dt.dtype, x.device)
    cfg = dict(run.cfg, BLOCK_T=min(run.cfg["BLOCK_T"], run.knobs["BWD_BLOCK_T"]),
               BLOCK_P=_triton.pow2_tile(headdim, 16, _triton.NO_CAP))
    blocks = _triton.cdiv(chunk_size, cfg["BLOCK_T"])
    parts = batch * nchunks * nheads
    dA_part, dbias_part = _triton.output((parts,), **f32), _triton.output((parts,), **f32)
    dD_part = _triton.output((parts * blocks, headdim), **f32)
    # per token: the kernels' scratch rows
    dlC, dlB, R, xdx = (_triton.output((batch * nheads * seqlen,), **f32) for _ in range(4))
    strides = (*run.token_strides("x", "dt", "B", "C"), *gated.stride(), *run.token_strides("seq"))
    _triton.launch(ssd_bwd_dx_kernel, (nchunks * blocks, batch * nheads), (
        *(run.ptr(n) for n in ("x", "dt", "A", "B", "C", "D", "bias", "seq")), dends_op, cb, gated,
        *varlen_args, dx, dD_part, R, xdx, *run.sizes, blocks, run.cb_side(), *strides,
        D.stride(0) if D is not None else 0,
    ), dict(**run.d_flags, HAS_DVARLEN=dvarlen is not None, **run.flags, **cfg,
            BLOCK_SUMS=run.sums_over(cfg["BLOCK_T"]), num_warps=run.knobs["BWD_WARPS"],
            num_stages=run.knobs["BWD_STAGES"]))
    dB, dC = _group_grads(run, states_op, dends_op, varlen_args, dvarlen is not None, gated, cb, dlC, dlB)
    _triton.launch(ssd_bwd_ddt_kernel, (nchunks, batch * nheads), (
        *(raw.ptr(n) for n in ("x", "dt", "A", "B", "bias", "seq")), states, dends, *varlen_args, dlC, dlB, R, xdx,
        ddt, dA_part, dbias_part, *raw.sizes, *raw.token_strides("x", "dt", "B", "seq"),
    ), dict(HAS_DVARLEN=dvarlen is not None, **raw.flags, BLOCK_T=cfg["BLOCK_T"],
            BLOCK_P=cfg["BLOCK_P"], BLOCK_N=cfg["BLOCK_N"], CHUNK_TOKENS=cfg["CHUNK_TOKENS"], num_warps=4))

    def optional(grad: Tensor, like: Optional[Tensor]) -> Tensor:
        return grad.to(like.dtype) if like is not None else x.new_empty(0, dtype=torch.float32)

    dD = dD_part.view(-1, nheads, headdim).sum(0)
    return (
        dx.view(x.shape), ddt.view(dt.shape), dA_part.view(-1, nheads).sum(0), dB.to(B.dtype), dC.to(C.dtype),
        optional(dD if D is None or D.dim() == 2 else dD.sum(-1), D),
        dz, optional(dbias_part.view(-1, nheads).sum(0), dt_bias),
        optional(dinit.view(state_shape) if initial_states is not None else dinit, initial_states),
    )


def _through_gate(run: _Launch, states: Tensor, cb: Tensor, dout: Tensor,
                  ungated: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(dz, gated): with z, dz and the gradient of the output before the gate, dout * silu(z), which every later
    pass of the backward reads (x's shape, in the GEMMs' operand dtype), from the forward's output before the gate,
    recomputed where not given (from the float32 chunk states: the same values as the forward's operands once
    rounded); without z, an empty dz and dout itself."""
    x, z = run.inputs["x"], run.inputs["z"]
    if z is None:
        return x.new_empty(0, dtype=torch.float32), dout
    if ungated is None:
        ungated = _triton.output(x.shape, x.dtype, x.device)
        run.chunk_scan(states, cb, ungated, gate=False)
        ungated = ungated.view(x.shape)
    dz = _triton.output(x.shape, z.dtype, x.device)
    gated = _triton.output(x.shape, torch.float32 if run.flags["DOT_F32"] else x.dtype, x.device)
    tile = dict(BLOCK_T=GATE_BLOCK_T, BLOCK_P=_triton.pow2_tile(run.headdim, 16, _triton.NO_CAP))
    _triton.launch(ssd_gate_grad_kernel, (_triton.cdiv(run.seqlen, GATE_BLOCK_T), run.batch * run.nheads), (
        dout, z, ungated, dz, gated, run.seqlen, run.nheads, run.headdim, *dout.stride(), *z.stride(),
        *ungated.stride(),
    ), dict(**tile, num_warps=4))
    return dz.view(x.shape), gated.view(x.shape)


def _head_runs(heads_per_group: int, most: int) -> int:
    """Into how many equal runs of at most `most` heads (GROUP_HEADS) the backward's group kernels split a group."""
    return next(n for n in range(1, heads_per_group + 1) if heads_per_group % n == 0 and heads_per_group // n <= most)


def _group_grads(run: _Launch, states_op: Tensor, dends_op: Tensor, varlen_args: tuple, has_dvarlen: bool,
                 gated: Tensor, cb: Tensor, dlC: Tensor, dlB: Tensor) -> tuple[Tensor, Tensor]:
    """(dB, dC), float32 in B's and C's shapes, and into dlC and dlB each head's C_l . dC_l and B_s . dB_s (the
    parts of the log-decay gradient ssd_bwd_ddt_kernel takes from them): the gradient of C.B^T summed over runs of
    a group's heads, then multiplied by B and C once a run, with the per-head state parts."""
    batch, seqlen, nheads, ngroups = run.batch, run.seqlen, run.nheads, run.ngroups
    x = run.inputs["x"]
    f32 = dict(dtype=torch.float32, device=x.device)
    knobs = run.knobs
    splits = _head_runs(nheads // ngroups, knobs["GROUP_HEADS"])
    tile = _triton.pow2_tile(run.chunk_size, 16, knobs["GROUP_BLOCK_T"])
    blocks = _triton.cdiv(run.chunk_size, tile)
    npairs = blocks * (blocks + 1) // 2
    side = blocks * tile
    dcb = _triton.output((splits, batch, run.nchunks, ngroups, side, side),
                         torch.float32 if run.flags["DOT_F32"] else x.dtype, x.device)
    dlC_part, dlB_part = (_triton.output((blocks * batch * nheads * seqlen,), **f32) for _ in range(2))
    tiles = dict(BLOCK_T=tile, BLOCK_P=_triton.pow2_tile(run.headdim, 16, _triton.NO_CAP),
                 CHUNK_TOKENS=run.cfg["CHUNK_TOKENS"])
    lo, hi = run.sizes[-2:]
    _triton.launch(ssd_bwd_dcb_kernel, (run.nchunks * npairs, batch * ngroups * splits), (
        *(run.ptr(n) for n in ("x", "dt", "A", "bias", "seq")), cb, gated, dcb, dlC_part, dlB_part,
        batch, seqlen, nheads, run.headdim, run.chunk_size, run.nchunks, nheads // ngroups, lo, hi, ngroups, splits,
        npairs, run.cb_side(), side, *run.token_strides("x", "dt"), *gated.stride(), *run.token_strides("seq"),
    ), dict(**{k: run.flags[k] for k in ("HAS_BIAS", "HAS_SEQ", "SOFTPLUS", "HAS_LIMIT", "DOT_F32")}, **tiles,
            BLOCK_SUMS=run.sums_over(tile), num_warps=knobs["DCB_WARPS"], num_stages=knobs["GROUP_STAGES"]))
    grads = []
    for db, states, dl_part, dl in ((True, dends_op, dlB_part, dlB), (False, states_op, dlC_part, dlC)):
        out = _triton.output((splits, batch, seqlen, ngroups, run.dstate), **f32)
        _triton.launch(ssd_bwd_group_kernel, (run.nchunks * blocks, batch * ngroups * splits), (
            *(run.ptr(n) for n in ("x", "dt", "A", "B", "C", "bias", "seq")), states, *varlen_args, gated, dcb,
            dl_part, dl, out, batch, seqlen, nheads, run.headdim, run.dstate, run.chunk_size, run.nchunks,
            nheads // ngroups, lo, hi, ngroups, splits, blocks, side,
            *run.token_strides("x", "dt", "B", "C"), *gated.stride(), *run.token_strides("seq"),
        ), dict(DB=db, **run.flags, HAS_DVARLEN=has_dvarlen, **tiles, BLOCK_N=run.cfg["BLOCK_N"],
                BLOCK_SUMS=run.sums_over(tile), num_warps=knobs["GROUP_WARPS"], num_stages=knobs["GROUP_STAGES"]))
        shape = (batch, seqlen, ngroups, run.dstate)
        grads.append(out.view(shape) if splits == 1 else out.view(splits, *shape).sum(0))
    return grads[0], grads[1]


KERNELS = {"ssd_scan_fwd": ssd_fwd, "ssd_scan_bwd": ssd_bwd}


# --- the operators Inductor traces into ------------------------------------------------


@triton_op("ssmops::ssd_scan_fwd_triton", mutates_args=())
def ssd_scan_fwd_triton(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    dt_bias: Optional[Tensor], initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
    cu_seqlens: Optional[Tensor], chunk_size: int, dt_softplus: bool, dt_limit: list[float],
    keep_ungated: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`ssmops::ssd_scan_fwd` on the Triton kernels; same schema and conventions."""
    return ssd_fwd(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus,
                   dt_limit, keep_ungated)


@triton_op("ssmops::ssd_scan_bwd_triton", mutates_args=())
def ssd_scan_bwd_triton(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    dt_bias: Optional[Tensor], initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
    cu_seqlens: Optional[Tensor], chunk_size: int, dt_softplus: bool, dt_limit: list[float], dout: Tensor,
    chunk_states: Tensor, dfinal_states: Optional[Tensor], dvarlen_states: Optional[Tensor],
    ungated: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`ssmops::ssd_scan_bwd` on the Triton kernels; same schema and conventions."""
    return ssd_bwd(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus,
                   dt_limit, dout, chunk_states, dfinal_states, dvarlen_states, ungated)


TRITON_OPS = {"ssd_scan_fwd": ssd_scan_fwd_triton, "ssd_scan_bwd": ssd_scan_bwd_triton}
