"""Property-based comparison of every backend with the reference (hypothesis).

Draws shapes, B/C layouts, optional arguments, dtypes, memory layouts (transposed,
sliced, expanded) and value ranges (large and tiny dt, A near 0 and very negative,
NaN/inf). `HYPOTHESIS_PROFILE=long` runs many more examples.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ssmops
from conftest import TOLERANCES, backend_params, rel_err


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in another memory layout (a slice of a NaN-padded buffer catches
    a kernel that reads past its strides)."""
    if how == "transposed":
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "sliced":
        return torch.stack([x, torch.full_like(x, float("nan"))], dim=-1)[..., 0]
    return x


@st.composite
def scan_problems(draw):
    batch = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    dim = groups * draw(st.integers(1, 3))
    seqlen = draw(st.integers(1, 40))
    dstate = draw(st.integers(1, 9))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dt_scale = draw(st.sampled_from([1e-4, 0.1, 1.0, 20.0]))
    a_scale = draw(st.sampled_from([1e-6, 1.0, 50.0]))
    softplus = draw(st.booleans())

    var_rank = draw(st.sampled_from([3, 4])) if groups == 1 else 4

    def bc():  # constant, or variable with the rank both variable ones share
        if draw(st.booleans()):
            return torch.randn(dim, dstate, generator=g)
        shape = (batch, dstate, seqlen) if var_rank == 3 else (batch, groups, dstate, seqlen)
        return torch.randn(shape, generator=g).to(dtype)

    B, C = bc(), bc()
    delta = torch.rand(batch, dim, seqlen, generator=g) * dt_scale
    if softplus:
        delta = torch.log(torch.expm1(delta.clamp_min(1e-6)))  # so that softplus(delta) is in range
    kw = dict(
        u=torch.randn(batch, dim, seqlen, generator=g).to(dtype),
        delta=delta.to(dtype),
        A=-torch.rand(dim, dstate, generator=g) * a_scale,
        B=B, C=C,
        D=torch.randn(dim, generator=g) if draw(st.booleans()) else None,
        z=torch.randn(batch, dim, seqlen, generator=g).to(dtype) if draw(st.booleans()) else None,
        delta_bias=torch.randn(dim, generator=g) * 0.01 if draw(st.booleans()) else None,
        delta_softplus=softplus,
        initial_state=torch.randn(batch, dim, dstate, generator=g) if draw(st.booleans()) else None,
    )
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    kw = {k: _layout(v, layout) if isinstance(v, torch.Tensor) and v.dim() >= 2 else v for k, v in kw.items()}
    return kw


def _compare(backend, kw, tol_scale=1.0):
    y_ref, last_ref = ssmops.selective_scan_ref(**kw, return_last_state=True)
    with ssmops.use_backend(backend):
        y, last = ssmops.selective_scan_fn(**kw, return_last_state=True)
    tol = TOLERANCES[kw["u"].dtype] * tol_scale
    for got, want in ((y, y_ref), (last, last_ref)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.isnan(), want.isnan()), "NaN positions differ"
        finite = want.isfinite() & got.isfinite()
        assert torch.equal(got.isinf(), want.isinf()), "inf positions differ"
        if finite.any():
            assert rel_err(got[finite], want[finite]) <= tol


@pytest.mark.parametrize("backend", backend_params())
@given(kw=scan_problems())
def test_backend_matches_reference_on_drawn_problems(backend, kw):
    _compare(backend, kw)


@pytest.mark.parametrize("backend", backend_params())
@given(kw=scan_problems(), data=st.data())
def test_backend_gradients_match_reference_on_drawn_problems(backend, kw, data):
    kw = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    tensors = [k for k, v in kw.items() if isinstance(v, torch.Tensor)]
    weights = torch.randn(kw["u"].shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))

    def grads(fn):
        leaves = {k: kw[k].detach().clone().requires_grad_() for k in tensors}
        y, last = fn(**{**kw, **leaves}, return_last_state=True)
        return torch.autograd.grad((y * weights).sum() + last.sum(), list(leaves.values()))

    expected = grads(ssmops.selective_scan_ref)
    with ssmops.use_backend(backend):
        got = grads(ssmops.selective_scan_fn)
    for name, g, e in zip(tensors, got, expected):
        finite = e.isfinite() & g.isfinite()
        assert torch.equal(e.isfinite(), g.isfinite()), f"d{name}: non-finite positions differ"
        if finite.any():
            assert rel_err(g[finite], e[finite]) <= 1e-3, f"d{name}"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["u", "delta", "B"])
def test_non_finite_inputs_propagate_like_the_reference(backend, bad, where):
    g = torch.Generator().manual_seed(0)
    kw = dict(u=torch.randn(1, 2, 6, generator=g), delta=torch.rand(1, 2, 6, generator=g),
              A=-torch.rand(2, 3, generator=g), B=torch.randn(1, 3, 6, generator=g),
              C=torch.randn(1, 3, 6, generator=g), D=torch.ones(2))
    kw[where][0, 0, 2] = bad
    _compare(backend, kw)
