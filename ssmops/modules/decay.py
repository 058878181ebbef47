"""The mixers' decay rates A = -exp(A_log), kept between decoding steps while A_log is unchanged."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from ..ops._checks import capturing


def decay_rates(owner: nn.Module, A_log: Tensor) -> Tensor:
    """-exp(A_log) in float32. A mixer computes it every call, which in eager decoding is every layer every token:
    two elementwise launches a layer a token on a GPU, a step's largest cost after its GEMMs at batch 1. Where
    nothing records it (no autograd for A_log, no tracer, no CUDA graph being captured: a graph replays its
    kernels, not this cache) the result is kept on `owner` and reused while A_log is the same tensor at the same
    version (an optimizer step or load_state_dict changes it in place, which bumps the version)."""
    if (A_log.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling() or \
            capturing(A_log.device) or A_log.is_inference():
        # (an inference tensor, made under inference_mode, has no version counter to tell a change by)
        return -torch.exp(A_log.float())
    kept = owner.__dict__.get("_ssmops_decay_rates")
    if kept is None or kept[0]() is not A_log or kept[1] != A_log._version:
        kept = (weakref.ref(A_log), A_log._version, -torch.exp(A_log.detach().float()))
        owner.__dict__["_ssmops_decay_rates"] = kept
    return kept[2]
