"""Training beyond one device: context parallelism (the sequence split across the ranks of a
torch.distributed process group) for the SSD scan, the selective scan and the causal conv.
See docs/distributed.md."""

from .context_parallel import causal_conv1d, mamba_chunk_scan_combined, selective_scan_fn

__all__ = ["causal_conv1d", "mamba_chunk_scan_combined", "selective_scan_fn"]
