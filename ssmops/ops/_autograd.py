"""What the front ends of the differentiable operators share."""

from __future__ import annotations

import torch
from torch import Tensor


def contiguous_when_compiling_backward(*tensors: Tensor | None) -> tuple:
    """The inputs of a differentiable operator as a front end passes them: while torch.compile (or export)
    traces a graph that will have a backward, every non-contiguous one as a contiguous copy; otherwise as
    they are.

    The operator's autograd saves its inputs. Inductor may lay a saved view out anew (a contiguous
    buffer of its own), and AOTAutograd then compiles the backward for that layout with the strides of
    the first call's sizes as numbers, so with a dynamic sequence length the next length fails the
    backward's stride check (a Mamba2 block compiled on the CPU, x a view of the conv's output: issue
    59). A contiguous input has one layout in the traced graph and in Inductor's, and Inductor writes
    the copy where it would otherwise have made its own. Inference graphs and eager calls copy nothing."""
    if not (torch.compiler.is_compiling() and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in tensors)):
        return tensors
    return tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in tensors)
