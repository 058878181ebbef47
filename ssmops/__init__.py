"""ssmops: the Mamba scans as PyTorch operators, on CPU, GPU and in deployment.

    import ssmops
    y = ssmops.selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)

The operators live in `torch.ops.ssmops`; docs/design.md states their contract.
"""

from ._registry import available_backends, use_backend  # first: registers every operator
from . import compat
from .causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from ._native import library_path
from .mamba_inner import mamba_inner_fn
from .linear import weight_only_linear
from .ops.selective_scan.reference import selective_scan_ref
from .selective_scan import selective_scan_fn
from .ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
from .state_update import selective_state_update


def __getattr__(name: str):
    """The transformers integration, loaded when first asked for (it reaches the model layer)."""
    if name in ("enable_transformers", "disable_transformers"):
        from .integrations import transformers

        return getattr(transformers, name)
    raise AttributeError(f"module 'ssmops' has no attribute {name!r}")


__all__ = [
    "available_backends",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "compat",
    "disable_transformers",
    "enable_transformers",
    "library_path",
    "mamba_chunk_scan_combined",
    "mamba_inner_fn",
    "mamba_split_conv1d_scan_combined",
    "selective_scan_fn",
    "selective_scan_ref",
    "selective_state_update",
    "use_backend",
    "weight_only_linear",
]
