"""The `cpu` backend: the C++ operator library built from `ssmops/csrc` on the stable ABI.

The library defines the `ssmops` schemas and registers its CPU kernels itself, so
loading it is all Python has to do; a C++ program `dlopen`s the same file.
"""

from __future__ import annotations

from pathlib import Path

import torch

_PACKAGE_DIR = Path(__file__).resolve().parent


def library_path() -> str:
    """Absolute path of the compiled operator library; FileNotFoundError if it was not built."""
    found = sorted(_PACKAGE_DIR.glob("_C*.so"))
    if not found:
        raise FileNotFoundError(
            f"the ssmops operator library was not built: no _C*.so in {_PACKAGE_DIR}. "
            "Reinstall with a C++ compiler available (pip install --no-build-isolation .)"
        )
    return str(found[0])


def load() -> str | None:
    """Loads the library into this process; returns why it could not, or None on success."""
    try:
        torch.ops.load_library(library_path())
    except (FileNotFoundError, OSError, RuntimeError) as err:
        return str(err)
    return None


def kernel(op_name: str):
    """The library's CPU kernel of `ssmops::op_name`, as `use_backend("cpu")` calls it (with any
    backend override lifted, the operator reaches the kernel the library registered)."""

    def run(*args):
        if args[0].device.type != "cpu":
            raise ValueError(f"the cpu backend takes CPU tensors, got {args[0].device}")
        return getattr(torch.ops.ssmops, op_name).default(*args)

    return run
