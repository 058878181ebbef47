"""Property-based comparison of every backend with the reference (hypothesis).

Draws shapes, B/C layouts, optional arguments, dtypes, memory layouts (transposed,
sliced, expanded) and value ranges (large and tiny dt, A near 0 and very negative,
NaN/inf). `HYPOTHESIS_PROFILE=long` runs many more examples.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import ssmops
from conftest import GRID_DEVICES, TOLERANCES, backend_params, interpreter_examples, on_device, rel_err


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
    kw = on_device(kw, backend.device)
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


@pytest.mark.parametrize("backend", backend_params(devices=GRID_DEVICES))
@interpreter_examples(6)
@given(kw=scan_problems())
def test_backend_matches_reference_on_drawn_problems(backend, kw):
    _compare(backend, kw)


@pytest.mark.parametrize("backend", backend_params(devices=GRID_DEVICES))
@interpreter_examples(3)
@given(kw=scan_problems(), data=st.data())
def test_backend_gradients_match_reference_on_drawn_problems(backend, kw, data):
    kw = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in on_device(kw, backend.device).items()}
    tensors = [k for k, v in kw.items() if isinstance(v, torch.Tensor)]
    weights = torch.randn(kw["u"].shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    weights = weights.to(backend.device)

    def grads(fn, dtype=torch.float32):
        leaves = {k: kw[k].detach().to(dtype).requires_grad_() for k in tensors}
        y, last = fn(**{**kw, **leaves}, return_last_state=True)
        return torch.autograd.grad((y * weights.to(dtype)).sum() + last.sum(), list(leaves.values()))

    # float64 on the reference's side: a reduced gradient (d delta_bias, dD, dA) may sum terms that
    # cancel, where a float32 reference differs from the truth as much as the backend does
    expected = grads(ssmops.selective_scan_ref, torch.float64)
    with ssmops.use_backend(backend):
        got = grads(ssmops.selective_scan_fn)
    for name, g, e in zip(tensors, got, expected):
        finite = e.isfinite() & g.isfinite()
        assert torch.equal(e.isfinite(), g.isfinite()), f"d{name}: non-finite positions differ"
        if finite.any():
            assert rel_err(g[finite], e[finite]) <= 1e-3, f"d{name}"


@pytest.mark.parametrize("backend", backend_params(devices=GRID_DEVICES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["u", "delta", "B"])
def test_non_finite_inputs_propagate_like_the_reference(backend, bad, where):
    g = torch.Generator().manual_seed(0)
    kw = dict(u=torch.randn(1, 2, 6, generator=g), delta=torch.rand(1, 2, 6, generator=g),
              A=-torch.rand(2, 3, generator=g), B=torch.randn(1, 3, 6, generator=g),
              C=torch.randn(1, 3, 6, generator=g), D=torch.ones(2))
    kw[where][0, 0, 2] = bad
    _compare(backend, kw)


# --- the SSD scan (Mamba-2) ---------------------------------------------------------------------


@st.composite
def ssd_problems(draw):
    """Shapes, chunk sizes (dividing seqlen or not), groups, optional arguments, dtypes, dt ranges
    and limits, packed sequences (starting at id 0 or not), memory layouts."""
    batch = draw(st.integers(1, 2))
    ngroups = draw(st.sampled_from([1, 2]))
    nheads = ngroups * draw(st.integers(1, 2))
    headdim, dstate = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    seqlen = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    softplus = draw(st.booleans())
    dt_scale = draw(st.sampled_from([1e-3, 0.3, 3.0]))
    a_scale = draw(st.sampled_from([1e-4, 1.0, 8.0]))

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    dt = torch.rand(batch, seqlen, nheads, generator=g) * dt_scale
    if softplus:
        dt = torch.log(torch.expm1(dt.clamp_min(1e-4)))  # so that softplus(dt) is in range
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    kw = dict(
        x=_layout(randn(batch, seqlen, nheads, headdim).to(dtype), layout), dt=dt.to(dtype),
        A=-torch.rand(nheads, generator=g) * a_scale,
        B=_layout(randn(batch, seqlen, ngroups, dstate).to(dtype), layout),
        C=_layout(randn(batch, seqlen, ngroups, dstate).to(dtype), layout),
        chunk_size=draw(st.sampled_from([1, 3, 8, 16, 64])),
        D=draw(st.sampled_from([None, randn(nheads), randn(nheads, headdim)])),
        z=randn(batch, seqlen, nheads, headdim).to(dtype) if draw(st.booleans()) else None,
        dt_bias=randn(nheads) * 0.1 if draw(st.booleans()) else None,
        initial_states=randn(batch, nheads, headdim, dstate) if draw(st.booleans()) else None,
        dt_softplus=softplus,
        dt_limit=draw(st.sampled_from([(0.0, float("inf")), (0.01, 0.5)])),
    )
    if draw(st.booleans()):
        starts = sorted(set(draw(st.lists(st.integers(1, max(seqlen - 1, 1)), max_size=3))) - {seqlen})
        first = draw(st.sampled_from([0, 1]))
        ids = torch.zeros(seqlen, dtype=torch.int32)
        for s in starts:
            ids[s:] += 1
        kw["seq_idx"] = (ids + first).expand(batch, seqlen).contiguous()
    return kw


def _ssd_results(fn, kw, leaves=None):
    """out and final states of fn(**kw), and the gradients of a weighted sum of both for `leaves`."""
    args = {**kw, **(leaves or {})}
    out, final = fn(**args, return_final_states=True)
    if not leaves:
        return out, final
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    return torch.autograd.grad((out.float() * weights).sum() + final.sum(), list(leaves.values()))


def _assume_interpretable(backend, kw) -> None:
    """Under Triton's interpreter every program costs milliseconds an operation: drawn SSD problems of a
    few chunks a row only (a chunk of 1 at 40 tokens took 140 s for its gradients)."""
    if backend == "triton" and backend.device == "cpu":
        batch, seqlen = kw["x"].shape[:2]
        assume(batch * -(-seqlen // kw["chunk_size"]) <= 8)


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu", "triton"), devices=GRID_DEVICES))
@interpreter_examples(3)
@given(kw=ssd_problems())
def test_ssd_backend_matches_reference_on_drawn_problems(backend, kw):
    from ssmops.ops.ssd.reference import ssd_scan_ref

    _assume_interpretable(backend, kw)
    kw = on_device(kw, backend.device)
    ref_kw = {k: v for k, v in kw.items() if k != "chunk_size"}
    out_ref, final_ref = _ssd_results(ssd_scan_ref, ref_kw)
    with ssmops.use_backend(backend):
        out, final = _ssd_results(ssmops.mamba_chunk_scan_combined, kw)
    assert out.dtype == kw["x"].dtype and final.dtype == torch.float32
    assert rel_err(out, out_ref) <= TOLERANCES[kw["x"].dtype] * 4
    assert rel_err(final, final_ref) <= TOLERANCES[kw["x"].dtype] * 4


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu", "triton"), devices=GRID_DEVICES))
@interpreter_examples(2)
@given(kw=ssd_problems())
def test_ssd_backend_gradients_match_reference_on_drawn_problems(backend, kw):
    from ssmops.ops.ssd.reference import ssd_scan_ref

    _assume_interpretable(backend, kw)
    kw = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
          for k, v in on_device(kw, backend.device).items()}
    names = [k for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states") if kw[k] is not None]

    def leaves():
        return {k: kw[k].detach().clone().requires_grad_() for k in names}

    def leaves64():
        return {k: v.double() for k, v in leaves().items()}

    # float64 on the reference's side: dA sums terms that cancel, and a float32 reference would
    # differ from the float64 truth as much as the backend does
    expected = _ssd_results(ssd_scan_ref, {k: v for k, v in kw.items() if k != "chunk_size"}, leaves64())
    with ssmops.use_backend(backend):
        got = _ssd_results(ssmops.mamba_chunk_scan_combined, kw, leaves())
    for name, g, e in zip(names, got, expected):
        # dA sums seqlen * headdim * dstate float32 terms per head, which may cancel to a small result
        assert rel_err(g, e) <= (1e-2 if name == "A" else 1e-3), f"d{name}"
