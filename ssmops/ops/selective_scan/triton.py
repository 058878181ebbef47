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
from torch import Tensor
from torch.library import triton_op

from .. import _triton
from .checks import CHUNK_LEN, check_scan_grad_inputs, check_scan_inputs, num_chunks
from .triton_kernels import selective_scan_bwd_kernel, selective_scan_fwd_kernel

# Channels of one B/C group that a program of the deterministic backward walks in turn (its
# variable dB/dC partial rows are then dim / DETERMINISTIC_CHANNELS times B's size).
DETERMINISTIC_CHANNELS = 64


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two dividing n, at most cap."""
    p = 1
    while p < cap and n % (2 * p) == 0:
        p *= 2
    return p


def _config(seqlen: int, dstate: int, backward: bool) -> dict:
    """The time tile is the 2048-step chunk, or the whole sequence when shorter, spread over
    the warps so that a thread holds 16 consecutive steps in the forward and 8 in the
    backward, whose dozen live tiles would spill at 16. (From the sm_90 compiler's output:
    fewer steps a thread cost more instructions per (step, state) in the scan; see
    benchmarks/triton_static.py. tests/test_triton.py compiles the launches and checks for spills.)"""
    block_t = _triton.pow2_tile(seqlen, 16, CHUNK_LEN)
    steps_per_thread = 8 if backward else 16
    return dict(BLOCK_T=block_t, BLOCK_N=_triton.pow2_tile(dstate, 2, _triton.NO_CAP), CHUNK=CHUNK_LEN,
                num_warps=min(8, max(1, block_t // (32 * steps_per_thread))))



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
    delta_softplus: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dims = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    _check_real_A(A)
    u, delta, A, B, C, D, z, delta_bias, initial_state = _triton.contiguous_when_traced(
        u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, dim, seqlen, dstate, _ = dims
    cfg = _config(seqlen, dstate, backward=False)
    n_chunks = num_chunks(seqlen)
    # every buffer a kernel writes is 1-D, viewed as its shape after the launch (_triton.output)
    out_shape, x_shape, last_shape = (batch, dim, seqlen), (batch, dim, n_chunks * 2 * dstate), (batch, dim, dstate)
    out = _triton.output(out_shape, u.dtype, u.device)
    out_z = _triton.output(out_shape, u.dtype, u.device) if z is not None else u.new_empty(0)
    x = _triton.output(x_shape, torch.float32, u.device)
    last = _triton.output(last_shape, torch.float32, u.device)
    grid = (dim, batch)
    _triton.launch(selective_scan_fwd_kernel, grid, (
        u, delta, A, B, C, D if D is not None else A, z if z is not None else u,
        delta_bias if delta_bias is not None else A,
        initial_state if initial_state is not None else A,
        out, out_z if z is not None else out, x, last,
        dim, seqlen, dstate, n_chunks, dim // _groups(B), dim // _groups(C),
        *u.stride(), *delta.stride(), *_strides3(z),
        *A.stride(),
        *_bc_strides(B), *_bc_strides(C),
        *_strides3(initial_state),
        dim * seqlen, seqlen, x_shape[1] * x_shape[2], x_shape[2], dim * dstate, dstate,
    ), dict(**_flags(B, C, D, z, delta_bias, initial_state, delta_softplus), **cfg))
    return out.view(out_shape), x.view(x_shape), out_z.view(out_shape) if z is not None else out_z, \
        last.view(last_shape)


def selective_scan_bwd(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
    dout: Tensor, scan_intermediates: Tensor, dlast_state: Optional[Tensor], delta_softplus: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    dims = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    check_scan_grad_inputs(dims, u, A, dout, scan_intermediates, dlast_state)
    _check_real_A(A)
    u, delta, A, B, C, D, z, delta_bias, initial_state, dout, scan_intermediates, dlast_state = \
        _triton.contiguous_when_traced(u, delta, A, B, C, D, z, delta_bias, initial_state, dout,
                                       scan_intermediates, dlast_state)
    batch, dim, seqlen, dstate, groups = dims
    cfg = _config(seqlen, dstate, backward=True)
    # variable dB/dC: each channel's added atomically (fast, order not fixed), or, to be deterministic,
    # a program walks CHANNELS channels of one group, adds them up in its own rows, and the rows are
    # summed below in a fixed order
    bc_atomic = not torch.are_deterministic_algorithms_enabled()
    channels = 1 if bc_atomic or B.dim() == C.dim() == 2 else _pow2_divisor(dim // groups, DETERMINISTIC_CHANNELS)
    n_programs = dim // channels
    n_chunks = num_chunks(seqlen)
    f32 = dict(dtype=torch.float32, device=u.device)
    # every buffer a kernel writes is 1-D, viewed as its shape after the launch (_triton.output)
    grad_shape = (batch, dim, seqlen)
    du = _triton.output(grad_shape, u.dtype, u.device)
    ddelta = _triton.output(grad_shape, u.dtype, u.device)
    dz = _triton.output(grad_shape, u.dtype, u.device) if z is not None else u.new_empty(0)
    dA_part = _triton.output((batch, dim, dstate), **f32, zero=True)
    dD_part = _triton.output((batch, dim), **f32) if D is not None else u.new_empty(0, dtype=torch.float32)
    dbias_part = _triton.output((batch, dim), **f32) if delta_bias is not None else u.new_empty(0, dtype=torch.float32)
    carry = _triton.output((batch, dim, 2, dstate), **f32)  # d initial_state in half n_chunks % 2 at the end

    def bc_partial(M: Tensor) -> Tensor:
        if M.dim() == 2:
            return _triton.output((batch, dim, dstate), **f32, zero=True)
        return _triton.output((batch, _groups(M) if bc_atomic else n_programs, dstate, seqlen), **f32, zero=True)

    dB_part, dC_part = bc_partial(B), bc_partial(C)
    grid = (n_programs, batch)
    _triton.launch(selective_scan_bwd_kernel, grid, (
        u, delta, A, B, C, D if D is not None else A, z if z is not None else u,
        delta_bias if delta_bias is not None else A,
        initial_state if initial_state is not None else A, dout, scan_intermediates,
        dlast_state if dlast_state is not None else A,
        du, ddelta, dz if z is not None else du, dA_part, dB_part, dC_part,
        dD_part if D is not None else dA_part, dbias_part if delta_bias is not None else dA_part,
        carry,
        dim, seqlen, dstate, n_chunks, dim // _groups(B), dim // _groups(C),
        *u.stride(), *delta.stride(), *_strides3(z), *dout.stride(),
        *A.stride(),
        *_bc_strides(B), *_bc_strides(C),
        *_strides3(initial_state), scan_intermediates.stride(0), scan_intermediates.stride(1),
        *_strides3(dlast_state),
        dim * seqlen, seqlen,
    ), dict(HAS_DLAST=dlast_state is not None, BC_ATOMIC=bc_atomic, CHANNELS=channels,
            **_flags(B, C, D, z, delta_bias, initial_state, delta_softplus), **cfg))

    def bc_grad(part: Tensor, M: Tensor) -> Tensor:
        if M.dim() == 2:
            return part.view(batch, dim, dstate).sum(0).to(M.dtype)
        if not bc_atomic:
            part = part.view(batch, _groups(M), n_programs // _groups(M), dstate, seqlen).sum(2)
        return part.view(M.shape).to(M.dtype)

    def summed(part: Tensor, present: bool) -> Tensor:  # a (batch, dim) partial over the batch
        return part.view(batch, dim).sum(0) if present else part

    return (
        du.view(grad_shape), ddelta.view(grad_shape), dA_part.view(batch, dim, dstate).sum(0), bc_grad(dB_part, B),
        bc_grad(dC_part, C), summed(dD_part, D is not None), summed(dbias_part, delta_bias is not None),
        dz.view(grad_shape) if z is not None else dz,
        carry.view(batch, dim, 2, dstate)[:, :, n_chunks % 2].clone() if initial_state is not None
        else u.new_empty(0, **f32),
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
