"""The `triton` backend: Triton kernels for CUDA, ROCm and XPU tensors.

Importing this package is cheap and never imports Triton; `load()` does, once, from
`ssmops._ops`. On a CPU-only machine the kernels run only under `TRITON_INTERPRET=1`
(Triton's interpreter, for testing), which must be set before ssmops is imported.

Files: `kernels.py` (the Triton kernels and how they divide the work), `ops.py` (the
launchers, the `ssmops::selective_scan_{fwd,bwd}_triton` operators and their
registrations).
"""

from __future__ import annotations

import importlib.util
import os

import torch

GPU_DEVICES = ("cuda", "xpu")  # "cuda" is also ROCm's device type
_registered = False  # set by load() once the Triton operators exist


def _gpu_present() -> bool:
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def load() -> str | None:
    """Imports Triton and registers the kernels; returns why the backend cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "No module named 'triton' (pip install 'ssmops[triton]')"
    if not (_gpu_present() or interpreting()):
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1"
    try:
        from . import ops
    except ImportError as err:
        return f"Triton failed to import: {err}"
    global _registered
    ops.register()
    _registered = True
    return None


def triton_op_for(name: str, t: torch.Tensor):
    """The Triton operator `ssmops::{name}_triton` when it serves t's device natively, else None.

    `selective_scan_fn` and `selective_state_update` call it instead of the device-dispatched
    main operator, so that torch.compile and AOTInductor trace into the Triton kernels.
    """
    if not _registered or t.device.type not in GPU_DEVICES:
        return None
    if not torch.compiler.is_compiling():
        from .. import selected_backend

        if selected_backend() not in (None, "triton"):  # an explicit `use_backend` wins in eager mode
            return None
    return getattr(torch.ops.ssmops, f"{name}_triton").default


def __getattr__(name: str):
    if name == "KERNELS":  # what `use_backend("triton")` routes to
        from .ops import KERNELS

        return KERNELS
    raise AttributeError(name)
