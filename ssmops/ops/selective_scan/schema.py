"""The `torch.ops.ssmops` operators: schemas, fake kernels, autograd and backend registrations.

This is the one place where operators are declared. The C++ library declares the
same schemas (so a Python-free process has them); when it is loaded they come from
it, otherwise from here, and `tests/test_ops.py` checks that the two agree.

Conventions that the schemas cannot express:
* an absent optional output (`out_z` without z, `dD` without D, ...) is an empty
  tensor (numel 0), because a custom operator cannot return `Tensor?`;
* `scan_intermediates` is float32 `(batch, dim, n_chunks * 2 * dstate)` with
  `n_chunks = ceil(seqlen / 2048)`: mamba_ssm's `x` of shape `(batch, dim, n_chunks,
  2 * dstate)`, flattened over its last two dims (so that no dimension of it can be
  1 for some seqlen and not others, which would stop export from keeping seqlen
  symbolic). At the end of each chunk: the cumulative decay `exp(A * sum dt)` since
  t=0 in even entries, the state in odd entries;
* `dout` of the backward is the gradient of the final output: `out_z` when z is
  given, else `out`.
"""

from __future__ import annotations

import warnings

import torch

from . import backends
from ._validation import check_scan_grad_inputs, check_scan_inputs, check_state_update_inputs, num_chunks
from .backends import cpu as _cpu_backend
from .backends import default as _default_backend
from .backends import triton as _triton_backend

SCHEMAS = {
    "selective_scan_fwd": (
        "selective_scan_fwd(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, "
        "Tensor? z, Tensor? delta_bias, Tensor? initial_state, bool delta_softplus) -> "
        "(Tensor out, Tensor scan_intermediates, Tensor out_z, Tensor last_state)"
    ),
    "selective_scan_bwd": (
        "selective_scan_bwd(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, "
        "Tensor? z, Tensor? delta_bias, Tensor? initial_state, Tensor dout, "
        "Tensor scan_intermediates, Tensor? dlast_state, bool delta_softplus) -> "
        "(Tensor du, Tensor ddelta, Tensor dA, Tensor dB, Tensor dC, Tensor dD, "
        "Tensor ddelta_bias, Tensor dz, Tensor dinitial_state)"
    ),
    # The single-token step of decoding: inference only (no autograd), `state` updated in
    # place, which torch.compile and torch.export functionalise.
    "selective_state_update": (
        "selective_state_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, "
        "Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus) -> Tensor"
    ),
}


class NativeLibraryWarning(UserWarning):
    """The C++ operator library could not be loaded; CPU tensors use the `default` backend."""


def _load_native() -> None:
    """Loads the C++ library unless SSMOPS_BACKEND asks for another CPU backend."""
    choice = backends.env_backend()
    if choice in ("default", "triton"):
        backends.unavailable["cpu"] = f"not loaded because {backends.ENV_VAR}={choice}"
        return
    reason = _cpu_backend.load()
    backends.unavailable["cpu"] = reason
    if reason is None:
        return
    if choice == "cpu":
        raise ImportError(f"{backends.ENV_VAR}=cpu but the native library failed to load: {reason}")
    warnings.warn(
        f"ssmops: the native CPU library is not available ({reason}); "
        "CPU tensors run on the pure-PyTorch 'default' backend.",
        NativeLibraryWarning,
        stacklevel=3,
    )


_load_native()
_lib = torch.library.Library("ssmops", "FRAGMENT")  # kept alive for the process
for _name, _schema in SCHEMAS.items():
    if not hasattr(torch.ops.ssmops, _name):  # the C++ library defines them when loaded
        _lib.define(_schema)

backends.unavailable["default"] = None
_OPS = {name: getattr(torch.ops.ssmops, name).default for name in SCHEMAS}


def _empty(like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)


# --- fake kernels: exact output shapes and dtypes, symbolic seqlen included ----------


@torch.library.register_fake("ssmops::selective_scan_fwd")
def _fwd_fake(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus):
    batch, dim, seqlen, dstate, _ = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    out = u.new_empty(u.shape)
    x = u.new_empty(batch, dim, num_chunks(seqlen) * 2 * dstate, dtype=torch.float32)
    out_z = u.new_empty(u.shape) if z is not None else _empty(u, u.dtype)
    return out, x, out_z, u.new_empty(batch, dim, dstate, dtype=torch.float32)


@torch.library.register_fake("ssmops::selective_scan_bwd")
def _bwd_fake(
    u, delta, A, B, C, D, z, delta_bias, initial_state, dout, scan_intermediates, dlast_state,
    delta_softplus,
):
    dims = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    check_scan_grad_inputs(dims, u, dout, scan_intermediates, dlast_state)

    def like(x, dtype=torch.float32):
        return x.new_empty(x.shape) if x is not None else _empty(u, dtype)

    return (
        like(u), like(delta), like(A), like(B), like(C), like(D), like(delta_bias),
        like(z, u.dtype), like(initial_state),
    )


@torch.library.register_fake("ssmops::selective_state_update")
def _state_update_fake(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    batch, dim, _, _ = check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    return x.new_empty(batch, dim)


# --- autograd: the backward is the backward operator --------------------------------


def autograd_for(bwd_op):
    """(backward, setup_context) for a forward operator with the schema of
    `selective_scan_fwd` whose backward is the operator `bwd_op`."""

    def setup_context(ctx, inputs, output):
        u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus = inputs
        out, scan_intermediates, out_z, _ = output
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, scan_intermediates)
        ctx.delta_softplus = delta_softplus
        ctx.backend = backends.selected_backend()  # the backward runs where the forward ran
        # The gradient flows through the final output (out_z when gated) and last_state only.
        ctx.mark_non_differentiable(scan_intermediates, out if z is not None else out_z)

    def backward(ctx, dout, _dx, dout_z, dlast_state):
        u, delta, A, B, C, D, z, delta_bias, initial_state, scan_intermediates = ctx.saved_tensors
        d_final = dout_z if z is not None else dout
        if d_final is None:
            d_final = torch.zeros_like(u)
        with backends.use_backend(ctx.backend):
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


_backward, _setup_context = autograd_for(_OPS["selective_scan_bwd"])
torch.library.register_autograd("ssmops::selective_scan_fwd", _backward, setup_context=_setup_context)

# --- backend registrations ------------------------------------------------------------
# `default` serves every device without a native kernel; the C++ library registered
# its own CPU kernels when it loaded.
for _name, _fn in _default_backend.KERNELS.items():
    torch.library.register_kernel(f"ssmops::{_name}", None, _fn)


# The Triton kernels: their own operators, which Inductor traces into, and the GPU kernels
# of the operators above. Imports Triton only where it can run (see backends/triton).
backends.unavailable["triton"] = _triton_backend.load()
if backends.env_backend() == "triton" and backends.unavailable["triton"]:
    raise ImportError(f"{backends.ENV_VAR}=triton but the Triton backend cannot run: {backends.unavailable['triton']}")
