"""Models built on the ssmops operators."""

from .generation import InferenceParams, decode, sample
from .mixer_seq_simple import MambaConfig, MambaLMHeadModel, convert_hf_config, convert_hf_state_dict

__all__ = [
    "InferenceParams",
    "MambaConfig",
    "MambaLMHeadModel",
    "convert_hf_config",
    "convert_hf_state_dict",
    "decode",
    "sample",
]
