"""Neural-network modules built on the ssmops operators."""

from .mamba import Mamba

__all__ = ["Mamba"]
