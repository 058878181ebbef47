"""The decoding step's operators: schemas and fake kernels.

One timestep of the scan, `state` updated in place (torch.compile and torch.export functionalise
the mutation). Inference only: no autograd. The C++ library declares the same schemas.

* `selective_state_update`: Mamba-1's layout, a float32 state `(batch, dim, dstate)`;
* `multihead_state_update`: Mamba-2's layout `(cache_size, nheads, headdim, dstate)` in any
  float dtype, a cache row per batch row (`state_batch_indices`), and dt, A and dt_bias either
  per (head, channel) or tied per head, in which case one decay per head is computed. It also takes
  Mamba-1's layout (x (batch, dim), state (cache_size, dim, dstate)) as it is, a channel a head of
  headdim 1: the front end's route for a low-precision state or a cache, with no views per call.
"""

from __future__ import annotations

from .checks import check_multihead_inputs, check_state_update_inputs

SCHEMA = (
    "selective_state_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, "
    "Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus) -> Tensor"
)


def fake(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    batch, dim, _, _ = check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    return x.new_empty(batch, dim)


MULTIHEAD_SCHEMA = (
    "multihead_state_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
    "Tensor? D, Tensor? z, Tensor? dt_bias, Tensor? state_batch_indices, bool dt_softplus) -> Tensor"
)


def multihead_fake(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus):
    check_multihead_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    return x.new_empty(x.shape)


def as_multihead(state, x, dt, A, B, C, D, z, dt_bias) -> tuple:
    """Mamba-1's layout as `multihead_state_update`'s arguments (up to `state_batch_indices`): a
    channel is a head of headdim 1, B/C's groups are groups of those heads, and dt, D and dt_bias
    are already in their per-head forms. Views only, so the state is still updated in place (the
    default and Triton backends' route for that layout; the C++ kernel reads it in place)."""
    return (
        state.unsqueeze(2), x.unsqueeze(-1), dt, A.unsqueeze(1), B if B.dim() == 3 else B.unsqueeze(1),
        C if C.dim() == 3 else C.unsqueeze(1), D, None if z is None else z.unsqueeze(-1), dt_bias,
    )
