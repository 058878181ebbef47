"""mamba_ssm- and causal-conv1d-shaped entry points, for code that calls their compiled extensions directly.

    # before: import selective_scan_cuda / import causal_conv1d_cuda
    from ssmops.compat import causal_conv1d_cuda, selective_scan_cuda

`selective_scan_cuda.fwd` and `.bwd`, and `causal_conv1d_cuda.causal_conv1d_fwd`, `_bwd` and `_update`,
take and return what the extensions do, in the same order, and run on every device ssmops serves.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ._registry import operator_for
from .causal_conv1d import causal_conv1d_update
from .ops._checks import checked_call
from .ops.causal_conv1d.checks import check_conv_inputs
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
        inputs = (u, delta, A, B, C, D, z, delta_bias, None)
        out, x, out_z, _ = checked_call(lambda: operator_for("selective_scan_fwd", u)(*inputs, delta_softplus),
                                        lambda: check_scan_inputs(*inputs))
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
        inputs = (u, delta, A, B, C, D, z, delta_bias, None)
        du, ddelta, dA, dB, dC, dD, ddelta_bias, dz_new, _ = checked_call(
            lambda: operator_for("selective_scan_bwd", u)(*inputs, dout, x.flatten(2), None, delta_softplus),
            lambda: check_scan_inputs(*inputs))
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


class _CausalConv1dExtension:
    """Stand-in for the causal-conv1d package's `causal_conv1d_cuda` module (what mamba_ssm's
    `mamba_inner_fn` calls): x (batch, dim, seqlen), weight (dim, width), `silu_activation` a bool."""

    @staticmethod
    def causal_conv1d_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None,
                          initial_states: Tensor | None, final_states_out: Tensor | None,
                          silu_activation: bool) -> Tensor:
        """Returns out; writes the final states (batch, dim, width - 1) into `final_states_out` when given."""
        inputs = (x, weight, bias, seq_idx, initial_states)
        out, final_states = checked_call(lambda: operator_for("causal_conv1d_fwd", x)(*inputs, silu_activation),
                                         lambda: check_conv_inputs(*inputs))
        if final_states_out is not None:
            final_states_out.copy_(final_states)
        return out

    @staticmethod
    def causal_conv1d_bwd(x: Tensor, weight: Tensor, bias: Tensor | None, dout: Tensor, seq_idx: Tensor | None,
                          initial_states: Tensor | None, dfinal_states: Tensor | None, dx: Tensor | None,
                          return_dinitial_states: bool, silu_activation: bool) -> list[Tensor | None]:
        """Returns `[dx, dweight, dbias, dinitial_states]` (dx written into `dx` when one is passed; dbias
        None without bias, dinitial_states None unless `return_dinitial_states`)."""
        inputs = (x, weight, bias, seq_idx, initial_states)
        dx_new, dweight, dbias, dinitial_states = checked_call(
            lambda: operator_for("causal_conv1d_bwd", x)(*inputs, dout, dfinal_states, silu_activation),
            lambda: check_conv_inputs(*inputs))
        return [dx.copy_(dx_new) if dx is not None else dx_new, dweight, dbias if bias is not None else None,
                dinitial_states if return_dinitial_states and initial_states is not None else None]

    @staticmethod
    def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                             silu_activation: bool, cache_seqlens: Tensor | None,
                             conv_state_indices: Tensor | None) -> Tensor:
        """x (batch, dim, seqlen); conv_state updated in place; returns out (batch, dim, seqlen)."""
        return causal_conv1d_update(x, conv_state, weight, bias, "silu" if silu_activation else None, cache_seqlens,
                                    conv_state_indices)


causal_conv1d_cuda = _CausalConv1dExtension()
