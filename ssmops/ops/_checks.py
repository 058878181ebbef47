"""Argument checks shared by every family: the Python API, the fake kernels and the Python
backends all call them.

Each failure names the argument, what it got and what was expected: TypeError for a
wrong type or dtype, ValueError for a wrong rank, shape or device.

The checking policy (docs/design.md, "Checking arguments"): every kernel checks its own arguments,
since an operator is also called directly and from C++ programs with no Python; a front end calls the
operator first and runs its family's Python checks only where the call fails (`checked_call`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

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


def capturing(device: torch.device) -> bool:
    """Whether the device is capturing a CUDA graph (where nothing may be read back from it, and what runs is
    recorded to be replayed)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_cache_indices(name: str, indices: Tensor | None, cache_size: int, cache: str) -> None:
    """The check of a decoding step's cache indices that reads data (for the kernels, not the fake kernels): every
    one below cache_size (a negative one is padding). Not while a CUDA graph is being captured, where reading a
    device value is an error (a server capturing its decoding step with indices): the kernels then take an index
    past the cache as padding too, so that nothing is written outside it."""
    if indices is None or not indices.numel() or capturing(indices.device):
        return
    if int(indices.max()) >= cache_size:
        raise ValueError(f"{name} must be < the {cache}'s cache size {cache_size}, got {indices.tolist()}")


def checked_call(call: Callable[[], T], check: Callable[[], object]) -> T:
    """`call()`, a front end's operator call; where it raises, `check()` first, the family's Python checks,
    so that the error a user sees names the argument as a TypeError or ValueError whichever backend ran
    (the C++ kernels raise RuntimeError). The checks run once, and only for a call that fails: kernels
    check their arguments themselves, and a decoding step at batch 1 costs less than its checks in Python.
    While torch.compile or export traces, `check()` runs first instead: kernels do not run then, and a
    check at trace time costs nothing when the graph runs."""
    if torch.compiler.is_compiling():
        check()
        return call()
    try:
        return call()
    except Exception as failure:
        error = failure
    check()  # outside the `except`: its error is not chained to the kernel's
    raise error
