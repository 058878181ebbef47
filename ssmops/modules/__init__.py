"""Neural-network modules built on the ssmops operators."""

from ..layernorm_gated import RMSNorm as RMSNormGated
from .mamba import Mamba
from .mamba2 import Mamba2

__all__ = ["Mamba", "Mamba2", "RMSNormGated"]
