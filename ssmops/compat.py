"""mamba_ssm-shaped entry points, for code that calls the compiled extension directly.

    # before: import selective_scan_cuda
    from ssmops.compat import selective_scan_cuda

`fwd` and `bwd` take and return what mamba_ssm's `selective_scan_cuda` does, in the
same order, and run on every device ssmops serves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops.selective_scan.checks import check_scan_inputs


class _SelectiveScanExtension:
    """Stand-in for mamba_ssm's `selective_scan_cuda` module."""

    @staticmethod
    def fwd(
        u: Tensor,
        delta: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        D: Tensor | None,
        z: Tensor | None,
        delta_bias: Tensor | None,
        delta_softplus: bool,
    ) -> list[Tensor]:
        """Returns `[out, x]`, then `out_z` when z is given.

        x: (batch, dim, n_chunks, 2 * dstate) with 2048-step chunks, float32, or complex64
        when A is (as mamba_ssm's); the last state is `x[:, :, -1, 1::2]`.
        """
        check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, None)
        out, x, out_z, _ = torch.ops.ssmops.selective_scan_fwd(
            u, delta, A, B, C, D, z, delta_bias, None, delta_softplus
        )
        x = x.view(x.shape[0], x.shape[1], -1, 2 * A.shape[1])
        return [out, x] if z is None else [out, x, out_z]

    @staticmethod
    def bwd(
        u: Tensor,
        delta: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        D: Tensor | None,
        z: Tensor | None,
        delta_bias: Tensor | None,
        dout: Tensor,
        x: Tensor,
        out: Tensor | None,
        dz: Tensor | None,
        delta_softplus: bool,
        recompute_out_z: bool,
    ) -> list[Tensor | None]:
        """Returns `[du, ddelta, dA, dB, dC, dD, ddelta_bias]` (None for absent D/delta_bias),
        then `dz` when z is given (written into `dz` when one is passed), then `out_z`
        when `recompute_out_z`. `dout` is the gradient of `out_z` when z is given."""
        check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, None)
        du, ddelta, dA, dB, dC, dD, ddelta_bias, dz_new, _ = torch.ops.ssmops.selective_scan_bwd(
            u, delta, A, B, C, D, z, delta_bias, None, dout, x.flatten(2), None, delta_softplus
        )
        grads = [
            du, ddelta, dA, dB, dC,
            dD if D is not None else None,
            ddelta_bias if delta_bias is not None else None,
        ]
        if z is not None:
            grads.append(dz.copy_(dz_new) if dz is not None else dz_new)
            if recompute_out_z:
                if out is None:
                    raise ValueError("out must be given to recompute out_z, got None")
                grads.append((out.float() * F.silu(z.float())).to(out.dtype))
        return grads


selective_scan_cuda = _SelectiveScanExtension()
