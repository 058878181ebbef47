"""The selective scan's operators: schemas, fake kernels and autograd.

The C++ library declares the same schemas (so a Python-free process has them); when it
is loaded they come from it, otherwise the registry defines them from here, and
`tests/ops/test_selective_scan.py` checks that the two agree.

Conventions that the schemas cannot express:
* an absent optional output (`out_z` without z, `dD` without D, ...) is an empty
  tensor (numel 0), because a custom operator cannot return `Tensor?`;
* `scan_intermediates` has A's dtype (float32, or complex64 for complex A, as mamba_ssm's
  `x` does) and shape `(batch, dim, n_chunks * 2 * dstate)` with
  `n_chunks = ceil(seqlen / 2048)`: mamba_ssm's `x` of shape `(batch, dim, n_chunks,
  2 * dstate)`, flattened over its last two dims (so that no dimension of it can be
  1 for some seqlen and not others, which would stop export from keeping seqlen
  symbolic). At the end of each chunk: the cumulative decay `exp(A * sum dt)` since
  t=0 in even entries, the state in odd entries (both complex when A is);
* the states (`initial_state`, `last_state`, `dlast_state`) have A's dtype too;
* the gradient of a complex input (A, a constant B/C, initial_state) is PyTorch's for a
  real loss L: dL/d(re) + i dL/d(im), what autograd gives; that of a variable B/C (real,
  re/im interleaved along time) has its layout;
* `dout` of the backward is the gradient of the final output: `out_z` when z is
  given, else `out`.
"""

from __future__ import annotations

import torch

from .checks import check_scan_grad_inputs, check_scan_inputs, num_chunks

FWD_SCHEMA = (
    "selective_scan_fwd(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, "
    "Tensor? z, Tensor? delta_bias, Tensor? initial_state, bool delta_softplus) -> "
    "(Tensor out, Tensor scan_intermediates, Tensor out_z, Tensor last_state)"
)
BWD_SCHEMA = (
    "selective_scan_bwd(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, "
    "Tensor? z, Tensor? delta_bias, Tensor? initial_state, Tensor dout, "
    "Tensor scan_intermediates, Tensor? dlast_state, bool delta_softplus) -> "
    "(Tensor du, Tensor ddelta, Tensor dA, Tensor dB, Tensor dC, Tensor dD, "
    "Tensor ddelta_bias, Tensor dz, Tensor dinitial_state)"
)


def _empty(like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)


# --- fake kernels: exact output shapes and dtypes, symbolic seqlen included ----------


def fwd_fake(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus):
    batch, dim, seqlen, dstate, _ = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    out = u.new_empty(u.shape)
    x = u.new_empty(batch, dim, num_chunks(seqlen) * 2 * dstate, dtype=A.dtype)
    out_z = u.new_empty(u.shape) if z is not None else _empty(u, u.dtype)
    return out, x, out_z, u.new_empty(batch, dim, dstate, dtype=A.dtype)


def bwd_fake(
    u, delta, A, B, C, D, z, delta_bias, initial_state, dout, scan_intermediates, dlast_state,
    delta_softplus,
):
    dims = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    check_scan_grad_inputs(dims, u, A, dout, scan_intermediates, dlast_state)

    def like(x, dtype=torch.float32):
        return x.new_empty(x.shape) if x is not None else _empty(u, dtype)

    return (
        like(u), like(delta), like(A), like(B), like(C), like(D), like(delta_bias),
        like(z, u.dtype), like(initial_state),
    )


# --- autograd: the backward is the backward operator --------------------------------


def autograd_for(bwd_op):
    """(backward, setup_context) for a forward operator with the schema of
    `selective_scan_fwd` whose backward is the operator `bwd_op`."""

    def setup_context(ctx, inputs, output):
        u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus = inputs
        out, scan_intermediates, out_z, _ = output
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, scan_intermediates)
        ctx.delta_softplus = delta_softplus
        # The gradient flows through the final output (out_z when gated) and last_state only.
        ctx.mark_non_differentiable(scan_intermediates, out if z is not None else out_z)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for unused outputs (chunk states)

    def backward(ctx, dout, _dx, dout_z, dlast_state):
        u, delta, A, B, C, D, z, delta_bias, initial_state, scan_intermediates = ctx.saved_tensors
        d_final = dout_z if z is not None else dout
        if d_final is None:
            d_final = torch.zeros_like(u)
        du, ddelta, dA, dB, dC, dD, ddelta_bias, dz, dinit = bwd_op(
            u, delta, A, B, C, D, z, delta_bias, initial_state, d_final, scan_intermediates,
            dlast_state, ctx.delta_softplus,
        )
        present = (D, z, delta_bias, initial_state)
        dD, dz, ddelta_bias, dinit = (
            g if x is not None else None for g, x in zip((dD, dz, ddelta_bias, dinit), present)
        )
        return du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinit, None

    return backward, setup_context
