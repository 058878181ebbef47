"""`Linear`: torch.nn.Linear (same parameters, same state_dict) whose inference runs ssmops'
`weight_only_linear` operator, and whose weight can be stored as bfloat16, float16 or int8 for
decoding.

A decoding token reads every weight once for one row of activations per sequence, so its time is
the weights' bytes over the memory's read bandwidth: the operator streams each weight row once
(torch's CPU GEMV reads fp32 weights at about a third of the bandwidth), and smaller weights
make the token faster in proportion. Training and anything that needs gradients go through
`torch.nn.functional.linear` as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..linear import weight_only_linear


# weights= format -> the weight's storage dtype
WEIGHT_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output feature: (q int8 (out, in), scale float32 (out,)) with
    weight ~= q * scale[:, None]; each row's largest |weight| maps to 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Linear(nn.Linear):
    """nn.Linear for ssmops' models: its weight can be converted to a weight format for inference."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.converted_from: torch.dtype | None = None  # the weight's dtype before convert_weight
        self.register_buffer("weight_scale", None)  # int8 weights only

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the layer's activations: its weight's, or what it was before conversion."""
        return self.converted_from or self.weight.dtype

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self)

    @torch.no_grad()
    def convert_weight(self, weights: str) -> None:
        """Stores the weight in `weights` format ("fp32", "bf16", "fp16", "int8"; the int8 one
        with a float32 scale per output feature, buffer `weight_scale`) for inference; the
        activations, the bias and the output keep the layer's dtype."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
        if self.weight.dtype == WEIGHT_FORMATS[weights]:
            return
        if self.weight_scale is not None:
            raise ValueError("the weight is int8 already; load the float checkpoint to convert it again")
        self.converted_from = self.compute_dtype
        if weights == "int8":
            q, self.weight_scale = quantize_int8(self.weight)
            self.weight = nn.Parameter(q, requires_grad=False)
        else:
            self.weight = nn.Parameter(self.weight.to(WEIGHT_FORMATS[weights]), requires_grad=False)


def linear(x: Tensor, layer: nn.Linear, bias: bool = True) -> Tensor:
    """`layer(x)` (without its bias when `bias=False`): `weight_only_linear` when no gradient is
    needed (inference, or a weight stored for inference), else F.linear."""
    b = layer.bias if bias else None
    weight = layer.weight
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    # a DTensor weight (tensor parallelism) takes F.linear, which DTensor shards
    if (needs_grad or hasattr(weight, "to_local")) and weight.dtype == x.dtype:
        return F.linear(x, weight, b)
    return weight_only_linear(x, weight, getattr(layer, "weight_scale", None), b)

