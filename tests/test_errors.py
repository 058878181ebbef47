"""Bad input gets a TypeError/ValueError that names the argument, what it got and what was expected."""

from __future__ import annotations

import pytest
import torch

import ssmops
from conftest import Case, make_inputs

GOOD = Case(batch=2, dim=4, seqlen=5, dstate=3, B="g2", C="g2", initial_state=True)


def _bad(**changes):
    kw = make_inputs(GOOD)
    kw.update(changes)
    return kw


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


BAD_INPUTS = [
    # (changes, exception, words the message must contain)
    (dict(u=_t(2, 4)), ValueError, ["u", "(batch, dim, seqlen)", "(2, 4)"]),
    (dict(u=[[1.0]]), TypeError, ["u", "Tensor", "list"]),
    (dict(u=_t(2, 4, 5, dtype=torch.float64)), TypeError, ["u", "float64", "float32"]),
    (dict(u=_t(2, 4, 0)), ValueError, ["u", "seqlen >= 1"]),
    (dict(delta=_t(2, 4, 6)), ValueError, ["delta", "(2, 4, 5)", "(2, 4, 6)"]),
    (dict(delta=_t(2, 4, 5, dtype=torch.bfloat16)), TypeError, ["delta", "bfloat16", "float32"]),
    (dict(A=_t(4, 3, dtype=torch.float16)), TypeError, ["A", "float16"]),
    (dict(A=_t(5, 3)), ValueError, ["A", "dim=4", "(5, 3)"]),
    (dict(A=_t(4, 257)), ValueError, ["A", "dstate", "257"]),
    (dict(B=_t(2, 3, 3, 5)), ValueError, ["B", "3 groups", "dim=4"]),
    (dict(B=_t(2, 2, 4, 5)), ValueError, ["B has dstate 4 but A has dstate 3", "(2, 2, 4, 5)"]),
    (dict(B=_t(2, 2, 3, 6)), ValueError, ["B", "(2, 2, 3, 6)", "(batch, groups, dstate, seqlen)"]),
    (dict(B=_t(2, 3)), ValueError, ["B", "(dim, dstate)=(4, 3)", "(2, 3)"]),
    (dict(B=_t(1, 2, 3, 4, 5)), ValueError, ["B", "(1, 2, 3, 4, 5)"]),
    (dict(C=_t(2, 2, 3, 5, dtype=torch.float16)), TypeError, ["C", "float16"]),
    (dict(C=_t(2, 4, 3, 5)), ValueError, ["B has 2 groups but C has 4"]),
    (dict(D=_t(5)), ValueError, ["D", "(4,)", "(5,)"]),
    (dict(D=_t(4, dtype=torch.bfloat16)), TypeError, ["D", "bfloat16"]),
    (dict(z=_t(2, 4, 4)), ValueError, ["z", "(2, 4, 5)", "(2, 4, 4)"]),
    (dict(delta_bias=_t(4, 1)), ValueError, ["delta_bias", "(4,)", "(4, 1)"]),
    (dict(initial_state=_t(2, 4, 4)), ValueError, ["initial_state", "(2, 4, 3)", "(2, 4, 4)"]),
    (dict(initial_state=_t(2, 4, 3, dtype=torch.float16)), TypeError, ["initial_state", "float16"]),
    (dict(D=_t(4, device="meta")), ValueError, ["D", "meta", "cpu"]),
    (dict(B=_t(2, 2, 3, 5, device="meta")), ValueError, ["B", "meta", "cpu"]),
]


@pytest.mark.parametrize("changes,exc,words", BAD_INPUTS, ids=lambda v: str(v)[:40] if isinstance(v, dict) else "")
@pytest.mark.parametrize("entry", ["selective_scan_fn", "selective_scan_cuda.fwd"])
def test_bad_input_raises_named_error(changes, exc, words, entry):
    kw = _bad(**changes)
    with pytest.raises(exc) as info:
        if entry == "selective_scan_fn":
            ssmops.selective_scan_fn(**kw)
        else:
            if "initial_state" in changes:
                pytest.skip("mamba_ssm's fwd has no initial_state")
            kw.pop("initial_state")
            ssmops.compat.selective_scan_cuda.fwd(*kw.values())
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value!r}"


def test_meta_tensors_give_shapes_without_computing():
    kw = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in make_inputs(GOOD).items()}
    y, last = ssmops.selective_scan_fn(**kw, return_last_state=True)
    assert y.device.type == "meta" and y.shape == (2, 4, 5) and last.shape == (2, 4, 3)
