"""The decoding step's Triton backend: the launcher and the `ssmops::selective_state_update_triton`
operator (a `triton_op`, so compiled decode graphs and AOTInductor packages launch the kernel
themselves). Serves CUDA/ROCm/XPU tensors, and CPU tensors under `TRITON_INTERPRET=1`.
"""

from typing import Optional

import torch
import triton
from torch import Tensor
from torch.library import triton_op

from .. import _triton
from .checks import check_state_update_inputs
from .triton_kernels import selective_state_update_kernel


def selective_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool,
) -> Tensor:
    batch, dim, dstate, groups = check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    out = torch.empty((batch, dim), dtype=x.dtype, device=x.device)
    block_n = max(triton.next_power_of_2(dstate), 2)
    block_d = min(max(1024 // block_n, 1), triton.next_power_of_2(dim))  # a (block_d, block_n) tile of 1024

    def bc_strides(M: Tensor) -> tuple:  # (batch, group, state); (batch, dstate) is one shared group
        return (M.stride(0), 0, M.stride(1)) if M.dim() == 2 else tuple(M.stride())

    _triton.launch(selective_state_update_kernel, (triton.cdiv(dim, block_d), batch), (
        state, x, dt, A, B, C, D if D is not None else A, z if z is not None else x,
        dt_bias if dt_bias is not None else A, out,
        dim, dstate, dim // groups,
        *state.stride(), *x.stride(), *dt.stride(), *(z.stride() if z is not None else (0, 0)), *A.stride(),
        *bc_strides(B), *bc_strides(C), D.stride(0) if D is not None else 0,
        dt_bias.stride(0) if dt_bias is not None else 0, out.stride(0),
    ), dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
            BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4))
    return out


@triton_op("ssmops::selective_state_update_triton", mutates_args={"state"})
def selective_state_update_triton(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool,
) -> Tensor:
    """`ssmops::selective_state_update` on the Triton kernel; same schema and conventions."""
    return selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


KERNELS = {"selective_state_update": selective_state_update}
TRITON_OPS = {"selective_state_update": selective_state_update_triton}
