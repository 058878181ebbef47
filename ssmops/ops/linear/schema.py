"""The weight-only linear operator: schema and fake kernel.

Inference only (no autograd: training uses `torch.nn.functional.linear` on float weights).
A decoding token multiplies every weight once with one row of activations per sequence, so its
speed is the weights' read bandwidth: the CPU kernel streams each weight row once for all rows
of x, widening bf16/f16/int8 to float32 in registers, and accumulates in float32. The output has
x's dtype. The C++ library declares the same schema.
"""

from __future__ import annotations

from .checks import check_linear_inputs

SCHEMA = "weight_only_linear(Tensor x, Tensor weight, Tensor? weight_scale, Tensor? bias) -> Tensor"


def fake(x, weight, weight_scale, bias):
    check_linear_inputs(x, weight, weight_scale, bias)
    return x.new_empty(*x.shape[:-1], weight.shape[0])
