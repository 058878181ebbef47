"""The scan's Triton backend: launchers, and the `ssmops::selective_scan_{fwd,bwd}_triton` operators.

`selective_scan_fwd` and `selective_scan_bwd` take the arguments of the main operators'
schemas, in the same order, check them, allocate the outputs and launch the kernels
(`triton_kernels.py`) through `torch.library.wrap_triton`, so that a tracer
(torch.compile's AOTDispatcher, AOTInductor) records the kernel launches themselves. They
serve CUDA/ROCm/XPU tensors, and CPU tensors under `TRITON_INTERPRET=1`.

`selective_scan_fwd_triton` and `selective_scan_bwd_triton` wrap them as
`torch.library.triton_op`s: operators whose implementation Inductor sees through, so a
compiled graph or an AOTInductor package launches the kernels itself (no call back into
ssmops). The registry gives them the main operators' fake kernels and autograd, and
registers the launchers as the GPU kernels of the main operators.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_true
from torch.library import triton_op

from .. import _triton, _tuning
from .checks import CHUNK_LEN, check_scan_grad_inputs, check_scan_inputs, num_chunks
from .triton_kernels import selective_scan_bwd_kernel, selective_scan_fwd_kernel

def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two dividing n, at most cap."""
    p = 1
    while p < cap and n % (2 * p) == 0:
        p *= 2
    return p


# The kernels' tile sizes (the speed knobs a GPU run tunes: benchmarks/gpu.py --sweep). A thread scans one
# channel, so a program of *_WARPS warps takes 32 * *_WARPS channels of one batch row and loads each step's B
# and C once for all of them. A thread keeps up to *_STATES states in registers (more are taken in turns, a
# pass over the sequence each) and walks the sequence a tile of steps at a time, a tile holding at most *_TILE
# (step, state) pairs. The forward's: ptxas computes a tile's decays ahead of the recurrence that needs them,
# a register each (128, 8 steps of 16 states, fit in its 255 registers with nothing spilled in the loop over
# time, and each row's loads and stores are then 16 bytes).
FORWARD_WARPS = 4
FORWARD_STATES = 16
FORWARD_TILE = 128
# FORWARD_SEGMENT: steps a program walks (0: the whole sequence). A thread per channel gives (batch x dim) / 32
# warps, 1,024 at the benchmark's shape, 8 an SM of an H200, which ran the forward at 8% of its copy rate
# (docs/limits.md); segments walked side by side multiply the warps, for a second, shorter pass that reads u,
# delta and B once more to find the states each segment starts from. Off until a GPU has timed it.
FORWARD_SEGMENT = 0
# FORWARD_PREFETCH: steps ahead of its step that a variable B's or C's row is loaded (0-2; 32 registers a step
# ahead, B's and C's). Each is an L2 hit whose latency, with a load at its step, was paid every step: the sm_90
# compiles put the loads 2-130 instructions before their use, a step's arithmetic being ~180.
FORWARD_PREFETCH = 2
# FORWARD_STAGES: Triton's software pipelining of the loop over tiles (1: none), which copies each step's B and C
# rows (and the tiles' u, delta, z) into shared memory asynchronously STAGES - 1 tiles ahead. The rows loaded ahead
# in registers (FORWARD_PREFETCH) cross the loop in a layout of their own, moved to the one every thread reads
# through shared memory with a barrier at every step (8 a tile on sm_90, Triton 3.6); pipelined with PREFETCH 0,
# a tile has 2, the rows are read from shared memory, and the kernel takes 168 registers (three programs an SM,
# where 252 hold two), for ~20% more instructions. For a GPU to weigh (the sweep's row
# FORWARD_PREFETCH=0+FORWARD_STAGES=3).
FORWARD_STAGES = 1
# FORWARD_REGISTERS: the registers a thread may take, given to ptxas for the one-walk forward over full tiles of
# 16 states (0: ptxas's choice). On sm_90 under Triton 3.6 ptxas chose 182 for the default knobs, which hold two
# programs an SM as 255 do, and then put each B/C row's load 94-146 instructions before its use, under one step's
# arithmetic (~175); allowed 255, it puts them 184-300 before (Triton 3.9 takes 255 either way). Segmented passes
# and smaller state tiles keep ptxas's choice: 80-127 registers hold four to six programs an SM.
FORWARD_REGISTERS = 255
# The backward keeps a register tile's states and decays (two registers a pair) while the adjoint runs back
# over it; it reads its inputs a tile of 16-byte rows at a time (8 steps of a 16-bit input), and reaches each
# register tile from the read tile's start by walking the register tiles before it. BACKWARD_SEGMENT: read
# tiles between two checkpoints of its first walk (a float32 state per channel, state and segment:
# seqlen / (SEGMENT * tile steps) of them); a read tile is then reached by walking up to SEGMENT - 1 tiles
# from its segment's checkpoint. BACKWARD_ATOMIC: variable dB/dC added atomically into one (batch, group) row
# after a sum over BACKWARD_REDUCE channels (lane shuffles), or (False, and always under
# torch.use_deterministic_algorithms) summed over a warp's channels of a group into rows of their own, which
# torch sums in a fixed order: at the benchmark's shape on an H200 the atomics took 89 ms, the rows 18.7.
# BACKWARD_TILE 16 (a step of 16 states a register tile) ran the backward in 16.5 ms where 32 ran 17.4 (H200,
# 28 Nov, ninth session's sweep: docs/limits.md), before BACKWARD_WARP_ROWS; with it, 32 compiles to fewer
# instructions per (step, state) under Triton 3.6 (59.9, where 16 takes 63.3): the next sweep decides.
BACKWARD_WARPS = 4
BACKWARD_STATES = 16
BACKWARD_TILE = 16
BACKWARD_SEGMENT = 1
BACKWARD_ATOMIC = False
BACKWARD_REDUCE = 1
# BACKWARD_WARP_ROWS: without atomics, each warp sums its 32 channels into a row of its own (lane shuffles only),
# rather than the program all of its channels (False), whose sum goes through shared memory: sm_90's compile then
# puts 4 barriers and 16 shared-memory accesses in each step of the walk back, which hold the program's warps in
# step. The rows are then a float32 (step, state) per 32 channels: as many bytes as a 16-bit du.
BACKWARD_WARP_ROWS = True
# BACKWARD_READ: bytes of each input row a read tile takes (8: 4 steps of a 16-bit input). 16 halves the
# checkpoints and the sectors of the rows (each 8-byte row is charged a 32-byte one), but holds more across the
# register tiles (1,768 bytes spilled on sm_90 at the benchmark's shape, docs/limits.md): for a GPU to weigh.
BACKWARD_READ = 8
# BACKWARD_PREFETCH: FORWARD_PREFETCH for the backward's first walk (the walk back reads its tile's B and C rows
# more than once, close together).
BACKWARD_PREFETCH = 2
# What SSMOPS_AUTOTUNE=1 times per shape (ops/_tuning.py), each phase's in its own call; benchmarks/gpu.py --sweep
# times the same values. (One warp: Triton lays the state tiles out so that ptxas spills in the walk.)
TUNING_SPACE = {"FORWARD_WARPS": (2, 4, 8), "FORWARD_TILE": (32, 64, 128), "FORWARD_SEGMENT": (0, 256, 512, 1024),
                "FORWARD_PREFETCH": (0, 1, 2), "FORWARD_STAGES": (1, 2, 3), "FORWARD_REGISTERS": (0, 168, 255),
                "BACKWARD_WARPS": (2, 4, 8), "BACKWARD_TILE": (16, 32, 64), "BACKWARD_SEGMENT": (1, 2, 4),
                "BACKWARD_ATOMIC": (False, True), "BACKWARD_REDUCE": (1, 4, 32), "BACKWARD_WARP_ROWS": (True, False),
                "BACKWARD_READ": (8, 16), "BACKWARD_PREFETCH": (0, 1, 2)}
FORWARD_KNOBS = ("FORWARD_WARPS", "FORWARD_TILE", "FORWARD_SEGMENT", "FORWARD_PREFETCH", "FORWARD_STAGES",
                 "FORWARD_REGISTERS")
BACKWARD_KNOBS = ("BACKWARD_WARPS", "BACKWARD_TILE", "BACKWARD_SEGMENT", "BACKWARD_ATOMIC", "BACKWARD_REDUCE",
                  "BACKWARD_WARP_ROWS", "BACKWARD_READ", "BACKWARD_PREFETCH")
TUNER = _tuning.Tuner("selective_scan", lambda: {name: globals()[name] for name in TUNING_SPACE}, TUNING_SPACE)


def _tuning_key(u: Tensor, A: Tensor, B: Tensor, C: Tensor, flags: dict) -> Optional[str]:
    """What the knobs are tuned for: dim, dstate, the dtypes, B's and C's layouts, the optionals given; not
    batch or seqlen (dynamic in a compiled graph). None where a size is symbolic."""
    dim, dstate = A.shape
    if not (type(dim) is int and type(dstate) is int):
        return None

    def layout(M: Tensor) -> str:
        return "const" if M.dim() == 2 else "var" if M.dim() == 3 else f"{M.shape[1]} groups"

    given = "+".join(name for name, on in flags.items() if on and not name.endswith("_VAR"))
    return f"dim {dim} dstate {dstate} {u.dtype}/{B.dtype} B {layout(B)} C {layout(C)} {given}"


def _tiles(dim: int, dstate: int, element_size: int, warps: int, max_states: int, tile: int) -> dict:
    """A tile's steps are at most one 16-byte vector load per row, so that Triton's layout keeps them
    inside the thread: the recurrence along them is plain arithmetic in registers, and a step's
    column of the (channels, steps) tiles is a register."""
    # (at least 2 warps: with one, Triton lays the state tiles out so that ptxas spills in the walk)
    block_d = _triton.pow2_tile(dim, 64, 32 * warps)
    states = _triton.pow2_tile(dstate, 1, max_states)
    tiles = _triton.cdiv(dstate, states)
    # (several state tiles: half the steps, as the partial sums' loads and stores take registers too)
    steps = max(1, min(16 // element_size, tile // states // (2 if tiles > 1 else 1)))
    return dict(BLOCK_D=block_d, BLOCK_T=steps, STATES=states, STATE_TILES=tiles,
                PADDED_STATES=tiles * states != dstate, num_warps=block_d // 32)


def _forward_config(dim: int, dstate: int, element_size: int, knobs: dict) -> dict:
    return dict(_tiles(dim, dstate, element_size, knobs["FORWARD_WARPS"], FORWARD_STATES, knobs["FORWARD_TILE"]),
                CHUNK=CHUNK_LEN, PREFETCH=knobs["FORWARD_PREFETCH"], STAGES=knobs["FORWARD_STAGES"])


def _backward_config(dim: int, dstate: int, element_size: int, aligned: bool, knobs: dict) -> dict:
    """The backward runs the adjoint a register tile of SUB_T steps at a time (BACKWARD_TILE (step, state)
    pairs), and reads its inputs a tile of BACKWARD_READ-byte rows (BLOCK_T steps) at a time where the rows are aligned
    for vector loads and the states take one tile (else a register tile at a time: the loads element by
    element and the partial sums over state tiles take the registers a read tile would)."""
    cfg = _tiles(dim, dstate, element_size, knobs["BACKWARD_WARPS"], BACKWARD_STATES, knobs["BACKWARD_TILE"])
    read = max(cfg["BLOCK_T"], knobs["BACKWARD_READ"] // element_size) if aligned and cfg["STATE_TILES"] == 1 \
        else cfg["BLOCK_T"]
    return dict(cfg, BLOCK_T=read, SUB_T=cfg["BLOCK_T"], SEGMENT=knobs["BACKWARD_SEGMENT"],
                PREFETCH=knobs["BACKWARD_PREFETCH"])


def _time_major(M: Tensor, cfg: dict) -> Tensor:
    """A variable B or C as the forward reads it: float32, time-major ((batch, [groups,] steps, states):
    a step's states are one vector load), with zeros past seqlen and dstate to whole tiles, so that its
    loads need no masks (and PREFETCH steps more: the loads ahead). Every thread of a block reads each
    value, and widening a 16-bit one would cost it an instruction or two per value, as much as the
    recurrence's own arithmetic. (A copy about 1/dim the size of u.) Returned as a (..., states, steps) view,
    the layout the kernel's strides describe."""
    *_, dstate, seqlen = M.shape
    steps = _triton.cdiv(seqlen, cfg["BLOCK_T"]) * cfg["BLOCK_T"] + cfg["PREFETCH"]
    # (clone, not contiguous, which refuses fake CUDA tensors in CPU-only torch; pad returns its input
    # where there is nothing to pad)
    time_major = M.transpose(-1, -2).float().clone(memory_format=torch.contiguous_format)
    padded = F.pad(time_major, (0, cfg["STATES"] * cfg["STATE_TILES"] - dstate, 0, steps - seqlen))
    return padded.transpose(-1, -2)


def _bc_strides(M: Tensor) -> tuple:
    """(batch, group, state, time) strides of B or C; a constant one gives (0, dim, state, 0)."""
    if M.dim() == 2:
        return 0, M.stride(0), M.stride(1), 0
    if M.dim() == 3:
        return M.stride(0), 0, M.stride(1), M.stride(2)
    return tuple(M.stride())


def _strides3(x: Optional[Tensor]) -> tuple:
    return tuple(x.stride()) if x is not None else (0, 0, 0)


def _flags(B, C, D, z, delta_bias, initial_state, delta_softplus) -> dict:
    return dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
                HAS_INIT=initial_state is not None, SOFTPLUS=bool(delta_softplus),
                B_VAR=B.dim() > 2, C_VAR=C.dim() > 2)


def _check_real_A(A: Tensor) -> None:
    """The kernels scan real states; complex A (mamba_ssm's complex mode) is not theirs."""
    if A.is_complex():
        raise NotImplementedError(
            f"selective_scan on the triton backend: A must be float32, got {A.dtype}; complex A runs on the "
            "default backend (with ssmops.use_backend('default'), on any device) and the cpu backend"
        )


def _groups(M: Tensor) -> int:
    """B/C groups (1 when B or C is shared by all channels or constant)."""
    return M.shape[1] if M.dim() == 4 else 1


def selective_scan_fwd(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
    delta_softplus: bool, knobs: Optional[dict] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(knobs: the launch knobs, TUNER's for the call's key when None.)"""
    dims = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    _check_real_A(A)
    u, delta, A, B, C, D, z, delta_bias, initial_state = _triton.contiguous_when_traced(
        u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, dim, seqlen, dstate, _ = dims
    flags = _flags(B, C, D, z, delta_bias, initial_state, delta_softplus)
    args = (u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus)
    knobs = TUNER.choose(_tuning_key(u, A, B, C, flags), u.device, "forward", FORWARD_KNOBS,
                         lambda k: selective_scan_fwd(*args, k), knobs)
    cfg = _forward_config(dim, dstate, u.element_size(), knobs)
    B, C = (_time_major(M, cfg) if M.dim() > 2 else M for M in (B, C))
    n_chunks = num_chunks(seqlen)
    # every buffer a kernel writes is 1-D, viewed as its shape after the launch (_triton.output)
    out_shape, x_shape, last_shape = (batch, dim, seqlen), (batch, dim, n_chunks * 2 * dstate), (batch, dim, dstate)
    out = _triton.output(out_shape, u.dtype, u.device)
    out_z = _triton.output(out_shape, u.dtype, u.device) if z is not None else u.new_empty(0)
    x = _triton.output(x_shape, torch.float32, u.device)
    last = _triton.output(last_shape, torch.float32, u.device)
    # the partial sums over the states of the earlier state tiles, when the states take several
    y_partial = _triton.output(out_shape, torch.float32, u.device) if cfg["STATE_TILES"] > 1 else None
    # a variable B/C is loaded once per step for the whole block where the block lies in one group
    shared = {f"{name}_SHARED": M.dim() == 3 or (M.dim() == 4 and (dim // M.shape[1]) % cfg["BLOCK_D"] == 0)
              for name, M in (("B", B), ("C", C))}
    # FORWARD_SEGMENT: steps a program walks, the sequence cut into segments walked side by side (two passes:
    # the kernel's docstring), or 0: the whole sequence a program (a plain-int seqlen longer than a segment only)
    seg_len = knobs["FORWARD_SEGMENT"]
    if seg_len and (CHUNK_LEN % seg_len or seg_len % cfg["BLOCK_T"]):
        raise ValueError(f"FORWARD_SEGMENT must divide {CHUNK_LEN} (a chunk of mamba_ssm's x) in whole tiles of "
                         f"{cfg['BLOCK_T']} steps, got {seg_len}")
    segments = type(seqlen) is int and 0 < seg_len < seqlen
    n_segments = _triton.cdiv(seqlen, seg_len) if segments else 1
    seg_h = _triton.output((batch, dim, n_segments, dstate), torch.float32, u.device) if segments else x
    seg_dt = _triton.output((batch, dim, n_segments), torch.float32, u.device) if segments else x

    full_tiles = cfg["STATES"] == FORWARD_STATES
    registers = dict(maxnreg=knobs["FORWARD_REGISTERS"]) if knobs["FORWARD_REGISTERS"] and full_tiles and not segments \
        else {}
    for segment_pass in (1, 2) if segments else (0,):  # (the first pass reads no z)
        _triton.launch(selective_scan_fwd_kernel, (_triton.cdiv(dim, cfg["BLOCK_D"]), batch, n_segments), (
            u, delta, A, B, C, D if D is not None else A, z if z is not None else u,
            delta_bias if delta_bias is not None else A,
            initial_state if initial_state is not None else A,
            out, out_z if z is not None else out, x, last, y_partial if y_partial is not None else x, seg_h, seg_dt,
            dim, seqlen, dstate, n_chunks, dim // _groups(B), dim // _groups(C), seg_len if segments else seqlen,
            n_segments,
            *u.stride(), *delta.stride(), *_strides3(z),
            *A.stride(),
            *_bc_strides(B), *_bc_strides(C),
            *_strides3(initial_state),
        ), dict(flags, **shared, **cfg, **registers, SEGMENT_PASS=segment_pass,
                HAS_Z=flags["HAS_Z"] and segment_pass != 1))
    return out.view(out_shape), x.view(x_shape), out_z.view(out_shape) if z is not None else out_z, \
        last.view(last_shape)


def selective_scan_bwd(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
    dout: Tensor, scan_intermediates: Tensor, dlast_state: Optional[Tensor], delta_softplus: bool,
    knobs: Optional[dict] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(knobs: the launch knobs, TUNER's for the call's key when None.)"""
    dims = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    check_scan_grad_inputs(dims, u, A, dout, scan_intermediates, dlast_state)
    _check_real_A(A)
    # (the chunk states are not read: the kernel's first walk recomputes finer checkpoints, from the start)
    u, delta, A, B, C, D, z, delta_bias, initial_state, dout, dlast_state = _triton.contiguous_when_traced(
        u, delta, A, B, C, D, z, delta_bias, initial_state, dout, dlast_state)
    batch, dim, seqlen, dstate, _ = dims
    flags = _flags(B, C, D, z, delta_bias, initial_state, delta_softplus)
    args = (u, delta, A, B, C, D, z, delta_bias, initial_state, dout, scan_intermediates, dlast_state, delta_softplus)
    knobs = TUNER.choose(_tuning_key(u, A, B, C, flags), u.device, "backward", BACKWARD_KNOBS,
                         lambda k: selective_scan_bwd(*args, k), knobs)
    # (rows start at multiples of 16 bytes: Triton then reads them in vectors; taken as so while a symbolic
    # seqlen is traced, which a guard on its divisibility would specialise)
    aligned = all(guard_or_true(x.stride(i) * x.element_size() % 16 == 0)
                  for x in (u, delta, dout, z) if x is not None for i in (0, 1))
    cfg = _backward_config(dim, dstate, u.element_size(), aligned, knobs)
    B_read, C_read = (_time_major(M, cfg) if M.dim() > 2 else M for M in (B, C))
    # variable dB/dC: summed over BACKWARD_REDUCE channels of a group in a program, then added atomically (order
    # not fixed); or summed over a warp's (BACKWARD_WARP_ROWS) or a program's channels of a group into rows of their
    # own, which are summed below in a fixed order: always under torch.use_deterministic_algorithms, else unless
    # BACKWARD_ATOMIC or a row would sum fewer than 32 channels (a group's channels an odd multiple of 16 or fewer:
    # the float32 rows would outweigh du)
    def reduced(M: Tensor, atomic: bool) -> int:  # channels summed in a program: a power of two dividing a group
        rows_of = min(32, cfg["BLOCK_D"]) if knobs["BACKWARD_WARP_ROWS"] else cfg["BLOCK_D"]
        cap = min(knobs["BACKWARD_REDUCE"], cfg["BLOCK_D"]) if atomic else rows_of
        return _pow2_divisor(dim // _groups(M), cap) if M.dim() > 2 else 1

    bc_atomic = not torch.are_deterministic_algorithms_enabled() and (
        knobs["BACKWARD_ATOMIC"] or any(M.dim() > 2 and reduced(M, False) < 32 for M in (B, C)))

    reduce_B, reduce_C = reduced(B, bc_atomic), reduced(C, bc_atomic)
    padded_dim = _triton.cdiv(dim, cfg["BLOCK_D"]) * cfg["BLOCK_D"]  # (the deterministic rows of every channel)
    rows_B, rows_C = ((_groups(M) if bc_atomic else padded_dim // r) for M, r in ((B, reduce_B), (C, reduce_C)))
    steps, states = _triton.cdiv(seqlen, cfg["BLOCK_T"]) * cfg["BLOCK_T"], cfg["STATES"] * cfg["STATE_TILES"]
    n_segments = _triton.cdiv(_triton.cdiv(seqlen, cfg["BLOCK_T"]), cfg["SEGMENT"])
    f32 = dict(dtype=torch.float32, device=u.device)
    # every buffer a kernel writes is 1-D, viewed as its shape after the launch (_triton.output)
    grad_shape = (batch, dim, seqlen)
    du = _triton.output(grad_shape, u.dtype, u.device)
    ddelta = _triton.output(grad_shape, u.dtype, u.device)
    dz = _triton.output(grad_shape, u.dtype, u.device) if z is not None else u.new_empty(0)
    dA_part = _triton.output((batch, dim, dstate), **f32)
    dD_part = _triton.output((batch, dim), **f32) if D is not None else u.new_empty(0, dtype=torch.float32)
    dbias_part = _triton.output((batch, dim), **f32) if delta_bias is not None else u.new_empty(0, dtype=torch.float32)
    dinit = _triton.output((batch, dim, dstate), **f32) if initial_state is not None else u.new_empty(0, **f32)
    checkpoints = _triton.output((batch, dim, n_segments * cfg["STATES"]), **f32)
    # the sums over the states of the earlier state tiles (y, d(dt u), d dt), when the states take several
    part = _triton.output((3, batch, dim, seqlen), **f32) if cfg["STATE_TILES"] > 1 else None

    def bc_part(M: Tensor, rows: int) -> Tensor:
        if M.dim() == 2:
            return _triton.output((batch, dim, dstate), **f32)
        return _triton.output((batch, rows, steps, states), **f32, zero=bc_atomic)

    dB_part, dC_part = bc_part(B, rows_B), bc_part(C, rows_C)
    shared = {f"{name}_SHARED": M.dim() == 3 or (M.dim() == 4 and (dim // M.shape[1]) % cfg["BLOCK_D"] == 0)
              for name, M in (("B", B), ("C", C))}
    grid = (_triton.cdiv(dim, cfg["BLOCK_D"]), batch)
    _triton.launch(selective_scan_bwd_kernel, grid, (
        u, delta, A, B_read, C_read, D if D is not None else A, z if z is not None else u,
        delta_bias if delta_bias is not None else A,
        initial_state if initial_state is not None else A, dout,
        dlast_state if dlast_state is not None else A,
        du, ddelta, dz if z is not None else du, dA_part, dB_part, dC_part,
        dD_part if D is not None else dA_part, dbias_part if delta_bias is not None else dA_part,
        dinit if initial_state is not None else dA_part, checkpoints, part if part is not None else checkpoints,
        dim, seqlen, dstate, dim // _groups(B), dim // _groups(C), rows_B, rows_C, n_segments,
        *u.stride(), *delta.stride(), *_strides3(z), *dout.stride(),
        *A.stride(),
        *_bc_strides(B_read), *_bc_strides(C_read),
        *_strides3(initial_state), *_strides3(dlast_state),
    ), dict(HAS_DLAST=dlast_state is not None, BC_ATOMIC=bc_atomic, REDUCE_B=reduce_B, REDUCE_C=reduce_C,
            **flags, **shared, **cfg))

    def bc_grad(part: Tensor, M: Tensor, rows: int, per_row: int) -> Tensor:
        if M.dim() == 2:
            return part.view(batch, dim, dstate).sum(0).to(M.dtype)
        groups = _groups(M)
        if bc_atomic:
            part = part.view(batch, groups, steps, states)
        else:  # a group's rows, summed in order (the rows of channels past dim are left out)
            part = part.view(batch, rows, steps, states).narrow(1, 0, dim // per_row)
            part = part.reshape(batch, groups, dim // groups // per_row, steps, states).sum(2)
        # time-major to M's layout, without the padding (narrow and clone, not [...] and contiguous, which
        # refuse fake CUDA tensors in CPU-only torch)
        grad = part.narrow(-2, 0, seqlen).narrow(-1, 0, dstate).transpose(-1, -2).to(M.dtype)
        grad = grad.clone(memory_format=torch.contiguous_format)
        return grad.view(M.shape)

    def summed(part: Tensor, present: bool) -> Tensor:  # a (batch, dim) partial over the batch
        return part.view(batch, dim).sum(0) if present else part

    return (
        du.view(grad_shape), ddelta.view(grad_shape), dA_part.view(batch, dim, dstate).sum(0),
        bc_grad(dB_part, B, rows_B, reduce_B), bc_grad(dC_part, C, rows_C, reduce_C), summed(dD_part, D is not None),
        summed(dbias_part, delta_bias is not None), dz.view(grad_shape) if z is not None else dz,
        dinit.view(batch, dim, dstate) if initial_state is not None else dinit,
    )


KERNELS = {"selective_scan_fwd": selective_scan_fwd, "selective_scan_bwd": selective_scan_bwd}


# --- the operators Inductor traces into ------------------------------------------------


@triton_op("ssmops::selective_scan_fwd_triton", mutates_args=())
def selective_scan_fwd_triton(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
    delta_softplus: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`ssmops::selective_scan_fwd` on the Triton kernels; same schema and conventions."""
    return selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus)


@triton_op("ssmops::selective_scan_bwd_triton", mutates_args=())
def selective_scan_bwd_triton(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
    dout: Tensor, scan_intermediates: Tensor, dlast_state: Optional[Tensor], delta_softplus: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`ssmops::selective_scan_bwd` on the Triton kernels; same schema and conventions."""
    return selective_scan_bwd(
        u, delta, A, B, C, D, z, delta_bias, initial_state, dout, scan_intermediates, dlast_state,
        delta_softplus,
    )


TRITON_OPS = {"selective_scan_fwd": selective_scan_fwd_triton, "selective_scan_bwd": selective_scan_bwd_triton}
