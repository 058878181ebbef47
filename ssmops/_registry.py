"""Backend registry and the explicit backend selector.

By default the dispatcher picks a backend by device: the native `cpu` library for
CPU tensors when it is loaded, `triton` for CUDA/ROCm/XPU when Triton is installed,
`default` (pure PyTorch) everywhere else. Two ways to choose explicitly:

* `SSMOPS_BACKEND=default|cpu|triton` in the environment, read once at import: it
  decides what is registered for CPU tensors, so it holds for eager, torch.compile
  and torch.export alike (`default` leaves the native library unloaded; `triton`
  routes CPU tensors to the Triton kernels, for `TRITON_INTERPRET=1` testing).
* `with ssmops.use_backend(name):` for the current thread, in eager mode: every
  ssmops operator called inside runs on that backend, and so does the backward of a
  forward run inside, wherever the backward is called.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

BACKEND_NAMES = ("default", "cpu", "triton")
ENV_VAR = "SSMOPS_BACKEND"


def env_backend() -> str | None:
    name = os.environ.get(ENV_VAR) or None
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    return name


# name -> None when usable, else the reason it is not; filled in by ssmops._ops at import.
unavailable: dict[str, str | None] = {}


def available_backends() -> dict[str, str]:
    """Each backend's status: 'available' or the reason it cannot run here."""
    return {name: unavailable.get(name) or "available" for name in BACKEND_NAMES}


def kernels(name: str) -> dict:
    reason = unavailable.get(name)
    if reason:
        raise RuntimeError(f"ssmops backend {name!r} is not available: {reason}")
    return importlib.import_module(f"{__name__}.{name}").KERNELS


class _BackendMode(TorchDispatchMode):
    """Sends ssmops operators to one backend's kernels; lets everything else through."""

    def __init__(self, name: str):
        super().__init__()
        self.kernels = {
            getattr(torch.ops.ssmops, op).default: fn for op, fn in kernels(name).items()
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.kernels.get(func, func)(*args, **(kwargs or {}))


_selected = threading.local()


def selected_backend() -> str | None:
    """The backend chosen by the innermost `use_backend` of this thread, if any."""
    stack = getattr(_selected, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Runs every ssmops operator called inside the block (eager mode) on backend `name`
    (None: no override)."""
    if name is None:
        yield
        return
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    stack = _selected.__dict__.setdefault("stack", [])
    with _BackendMode(name):
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()
