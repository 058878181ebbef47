"""mamba_ssm's gated MLP (`GatedMLP`), the feed-forward layer of its Mamba-2 and hybrid models."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .linear import Linear


class GatedMLP(nn.Module):
    """fc2(y * activation(gate)) with y, gate = fc1(x).chunk(2); the hidden width is rounded
    up to a multiple of `multiple_of` (default 8/3 of in_features, as in mamba_ssm)."""

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 activation=F.silu, bias: bool = False, multiple_of: int = 128, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden = hidden_features if hidden_features is not None else int(8 * in_features / 3)
        hidden = (hidden + multiple_of - 1) // multiple_of * multiple_of
        self.fc1 = Linear(in_features, 2 * hidden, bias=bias, **factory)
        self.activation = activation
        self.fc2 = Linear(hidden, out_features, bias=bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        y, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(y * self.activation(gate))
