"""The decoding step (`selective_state_update`): every backend against the reference, the
operator's checks, and the deployment paths of one step.

The reference (`ssmops/ops/state_update/reference.py`) is itself checked against a length-1
scan from the same state, so the step is exactly one timestep of the scan.
"""

from __future__ import annotations

import pytest
import torch

import ssmops
from conftest import (
    STATE_UPDATE_CASES, TOLERANCES, assert_close, backend_params, state_update_case_id, state_update_inputs,
)
from ssmops.ops.state_update.reference import selective_state_update_ref

needs_native = pytest.mark.skipif(ssmops.available_backends()["cpu"] != "available",
                                  reason="needs the native operator library")


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", STATE_UPDATE_CASES, ids=state_update_case_id)
def test_backend_matches_reference(backend, case):
    kw = state_update_inputs(**case)
    expected_state = kw["state"].clone()
    expected = selective_state_update_ref(**{**kw, "state": expected_state})
    with ssmops.use_backend(backend):
        y = ssmops.selective_state_update(**kw)
    assert y.dtype == kw["x"].dtype
    assert_close(kw["state"], expected_state, TOLERANCES[torch.float32], "state")
    assert_close(y, expected, TOLERANCES[kw["x"].dtype], "y")


@pytest.mark.parametrize("case", STATE_UPDATE_CASES, ids=state_update_case_id)
def test_state_update_opcheck(case):
    kw = state_update_inputs(**case)
    torch.library.opcheck(torch.ops.ssmops.selective_state_update.default, tuple(kw.values()))


@pytest.mark.parametrize("case", STATE_UPDATE_CASES, ids=state_update_case_id)
def test_state_update_is_one_step_of_the_scan(case):
    kw = state_update_inputs(**case)
    state = kw["state"].clone()
    y = ssmops.selective_state_update(**{**kw, "state": state})
    # the same step as a length-1 scan from initial_state: B/C get a trailing seqlen of 1
    y_scan, last = ssmops.selective_scan_fn(
        kw["x"][..., None], kw["dt"][..., None], kw["A"], kw["B"][..., None], kw["C"][..., None],
        kw["D"], kw["z"][..., None] if kw["z"] is not None else None, kw["dt_bias"],
        delta_softplus=kw["dt_softplus"], return_last_state=True, initial_state=kw["state"],
    )
    assert y.dtype == kw["x"].dtype and state.dtype == torch.float32
    assert_close(state, last, TOLERANCES[torch.float32], "state")
    assert_close(y, y_scan[..., 0], TOLERANCES[kw["x"].dtype], "y")


def test_state_update_multihead_layout_matches_flat():
    batch, nheads, headdim, dstate = 2, 3, 4, 5
    kw = state_update_inputs(batch=batch, dim=nheads * headdim, dstate=dstate, groups=3)
    state4 = kw["state"].clone().view(batch, nheads, headdim, dstate)
    y4 = ssmops.selective_state_update(
        state4, kw["x"].view(batch, nheads, headdim), kw["dt"].view(batch, nheads, headdim),
        kw["A"].view(nheads, headdim, dstate), kw["B"], kw["C"], kw["D"].view(nheads, headdim),
        kw["z"].view(batch, nheads, headdim), kw["dt_bias"].view(nheads, headdim), True,
    )
    y = ssmops.selective_state_update(**kw)
    torch.testing.assert_close(y4.reshape(y.shape), y)
    torch.testing.assert_close(state4.reshape(kw["state"].shape), kw["state"])


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(state=torch.zeros(2, 6, 5, dtype=torch.float16)), TypeError, "state must have dtype float32"),
        (dict(state=torch.zeros(2, 6, 4)), ValueError, r"state must have shape \(2, 6, 5\)"),
        (dict(B=torch.zeros(2, 4, 5)), ValueError, "B has 4 groups, which does not divide dim=6"),
        (dict(C=torch.zeros(2, 3, 5)), ValueError, "B has 1 groups but C has 3"),
        (dict(dt=torch.zeros(2, 6, dtype=torch.bfloat16)), TypeError, "dt must have dtype float32"),
        (dict(A=torch.zeros(6, 5, dtype=torch.float64)), TypeError, "A must have dtype float32"),
        (dict(x=torch.zeros(2, 6, 1)), ValueError, r"x must have shape \(batch, dim\)"),
        (dict(D=torch.zeros(7)), ValueError, r"D must have shape \(6,\)"),
    ],
)
def test_state_update_errors_name_the_argument(change, error, match):
    kw = {**state_update_inputs(), **change}
    with pytest.raises(error, match=match):
        ssmops.selective_state_update(**kw)
    # the operator checks too, not only the wrapper; the C++ (cpu) checks raise RuntimeError
    (name,) = change
    with pytest.raises((error, RuntimeError), match=rf"\b{name}\b"):
        torch.ops.ssmops.selective_state_update(*kw.values())


@pytest.mark.parametrize("backend", backend_params())
def test_state_update_under_every_backend(backend):
    kw = state_update_inputs(groups=2)
    expected_state = kw["state"].clone()
    expected = ssmops.selective_state_update(**{**kw, "state": expected_state})
    with ssmops.use_backend(backend):
        y = ssmops.selective_state_update(**kw)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(kw["state"], expected_state)


class _Step(torch.nn.Module):
    def forward(self, state, x, dt, A, B, C, D, z, dt_bias):
        return ssmops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True) * 2


def test_state_update_compiles_and_exports():
    kw = state_update_inputs(groups=3)
    args = [kw[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")]
    expected_state = args[0].clone()
    expected = _Step()(expected_state, *args[1:])

    state = args[0].clone()
    y = torch.compile(_Step(), fullgraph=True, backend="aot_eager")(state, *args[1:])
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(state, expected_state)  # the in-place update survives functionalisation

    ep = torch.export.export(_Step(), (args[0].clone(), *args[1:]))
    assert "selective_state_update" in str(ep.graph)
    state = args[0].clone()
    y = ep.module()(state, *args[1:])
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(state, expected_state)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_update_matches_default_and_updates_a_strided_state(dtype):
    g = torch.Generator().manual_seed(0)
    batch, dim, dstate = 3, 8, 5
    buffer = torch.randn(batch, dim, 2 * dstate, generator=g)
    kw = dict(x=torch.randn(batch, dim, generator=g).to(dtype), dt=torch.randn(batch, dim, generator=g).to(dtype),
              A=-torch.rand(dim, dstate, generator=g), B=torch.randn(batch, 2, dstate, generator=g),
              C=torch.randn(batch, 2, dstate, generator=g), D=torch.randn(dim, generator=g),
              z=torch.randn(batch, dim, generator=g).to(dtype), dt_bias=torch.randn(dim, generator=g),
              dt_softplus=True)
    expected_state = buffer[..., ::2].clone()
    with ssmops.use_backend("default"):
        expected = ssmops.selective_state_update(expected_state, **kw)
    state = buffer[..., ::2]  # strided: the kernel must write through to the caller's memory
    y = torch.ops.ssmops.selective_state_update(state, *kw.values())
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buffer[..., ::2], expected_state, rtol=1e-5, atol=1e-6)
