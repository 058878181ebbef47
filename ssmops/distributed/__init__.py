"""Training beyond one device: context parallelism (the sequence split across the ranks of a
torch.distributed process group) for the SSD scan, the selective scan and the causal conv, and
tensor parallelism (heads split over a device mesh) for the Mamba-2 block. See docs/distributed.md."""

from .context_parallel import causal_conv1d, mamba_chunk_scan_combined, selective_scan_fn
from .tensor_parallel import parallelize_mamba2

__all__ = ["causal_conv1d", "mamba_chunk_scan_combined", "parallelize_mamba2", "selective_scan_fn"]
