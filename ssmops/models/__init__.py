"""Models built on the ssmops operators."""

from .generation import InferenceParams, decode, sample
from .config_mamba import MambaConfig
from .convert_hf import convert_hf_config, convert_hf_state_dict
from .mixer_seq_simple import MambaLMHeadModel

__all__ = [
    "InferenceParams",
    "MambaConfig",
    "MambaLMHeadModel",
    "convert_hf_config",
    "convert_hf_state_dict",
    "decode",
    "sample",
]
