"""The decoding step's operator: schema and fake kernel.

One timestep of the selective scan for every (batch, channel), `state` updated in place
(torch.compile and torch.export functionalise the mutation). Inference only: no autograd.
The C++ library declares the same schema.
"""

from __future__ import annotations

from .checks import check_state_update_inputs

SCHEMA = (
    "selective_state_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, "
    "Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus) -> Tensor"
)


def fake(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    batch, dim, _, _ = check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    return x.new_empty(batch, dim)
