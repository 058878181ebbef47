"""`MambaConfig`: mamba_ssm's model config (config.json), and the mixer it builds for each layer."""

from __future__ import annotations

import dataclasses

from torch import nn

from ..modules.mamba import Mamba
from ..modules.mamba2 import Mamba2
from ..modules.mha import MHA

_MIXERS = ("Mamba1", "Mamba2")


@dataclasses.dataclass
class MambaConfig:
    """mamba_ssm's config.json keys. `ssm_cfg` holds the Mamba block's arguments, with
    `layer` "Mamba1" (default) or "Mamba2"; `d_intermediate` > 0 adds a gated MLP after each
    mixer; the layers in `attn_layer_idx` are attention (`MHA` with `attn_cfg`) instead of
    Mamba. `fused_add_norm` is accepted and ignored (the norm is plain PyTorch here). The
    vocabulary is padded up to a multiple of `pad_vocab_size_multiple`."""

    d_model: int = 2560
    d_intermediate: int = 0
    n_layer: int = 64
    vocab_size: int = 50277
    ssm_cfg: dict = dataclasses.field(default_factory=dict)
    attn_layer_idx: list = dataclasses.field(default_factory=list)
    attn_cfg: dict = dataclasses.field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    norm_epsilon: float = 1e-5

    def __post_init__(self):
        layer = self.ssm_cfg.get("layer", "Mamba1")
        if layer not in _MIXERS:
            raise ValueError(f"ssm_cfg layer must be one of {_MIXERS}, got {layer!r}")
        bad = [i for i in self.attn_layer_idx if not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(f"attn_layer_idx {bad} out of range for n_layer={self.n_layer}")

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return self.vocab_size if self.vocab_size % m == 0 else self.vocab_size + m - self.vocab_size % m

    def mixer(self, layer_idx: int, device=None, dtype=None, context_parallel_group=None) -> nn.Module:
        """Layer `layer_idx`'s mixer: MHA for the attention layers, else the ssm_cfg block, which
        runs its shard of the sequence with a `context_parallel_group` (see ssmops.distributed)."""
        factory = {"device": device, "dtype": dtype}
        if layer_idx in self.attn_layer_idx:
            if context_parallel_group is not None:
                raise ValueError(f"layer {layer_idx} is attention (attn_layer_idx {list(self.attn_layer_idx)}), "
                                 "which has no context parallelism in ssmops: context_parallel_group needs a "
                                 "model of Mamba layers only")
            return MHA(self.d_model, layer_idx=layer_idx, **self.attn_cfg, **factory)
        kwargs = {k: v for k, v in self.ssm_cfg.items() if k != "layer"}
        mixer_cls = Mamba2 if self.ssm_cfg.get("layer", "Mamba1") == "Mamba2" else Mamba
        return mixer_cls(self.d_model, layer_idx=layer_idx, **kwargs, **factory,
                         context_parallel_group=context_parallel_group)

    @classmethod
    def from_dict(cls, d: dict) -> "MambaConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown mamba_ssm config keys {unknown}; known: {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
