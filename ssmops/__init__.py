"""ssmops: the Mamba scans as PyTorch operators, on CPU, GPU and in deployment.

    import ssmops
    y = ssmops.selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)

The operators live in `torch.ops.ssmops`; docs/design.md states their contract.
"""

from ._registry import available_backends, use_backend  # first: registers every operator
from . import compat
from .causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from ._native import library_path
from .integrations.transformers import disable_transformers, enable_transformers
from .mamba_inner import mamba_inner_fn
from .modules.linear import weight_only_linear
from .ops.selective_scan.reference import selective_scan_ref
from .selective_scan import selective_scan_fn
from .ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
from .state_update import selective_state_update

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
