"""Argument checks shared by every family: the Python API, the fake kernels and the Python
backends all call them.

Each failure names the argument, what it got and what was expected: TypeError for a
wrong type or dtype, ValueError for a wrong rank, shape or device.
"""

from __future__ import annotations

import torch
from torch import Tensor

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_DSTATE = 256


def dtype_name(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, x, dtypes, shape, device, like: str = "u", sizes_from: str | None = None) -> None:
    """`sizes_from` names the argument(s) the expected shape comes from, in the message of a mismatch
    (either may be the wrong one)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {dtype_name(dtypes)}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        source = f" (its sizes follow {sizes_from})" if sizes_from else ""
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}{source}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like {like}, got {x.device}")


def check_leading(name: str, x, layout: str) -> None:
    """The argument whose rank and dtype set the others' shapes and dtypes (u, or x)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    if x.dim() != layout.count(",") + 1:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must have dtype {dtype_name(INPUT_DTYPES)}, got {x.dtype}")


def check_A(A, dim: int, device, like: str = "u", dtypes=(torch.float32,)) -> int:
    """Checks A (dim, dstate) of one of `dtypes` (float32 unless the family accepts complex A);
    returns dstate, which A sets for every other argument."""
    if not isinstance(A, Tensor):
        raise TypeError(f"A must be a Tensor, got {type(A).__name__}")
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must have shape (dim, dstate) with dim={dim}, got {tuple(A.shape)}")
    dstate = A.shape[1]
    if not 1 <= dstate <= MAX_DSTATE:
        raise ValueError(f"A must have 1 <= dstate <= {MAX_DSTATE}, got dstate={dstate}")
    check_tensor("A", A, dtypes, (dim, dstate), device, like=like)
    return dstate
