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
    GRID_DEVICES, STATE_UPDATE_CASES, TOLERANCES, assert_close, backend_params, on_device, state_update_case_id,
    state_update_inputs,
)
from ssmops._registry import interpreting
from ssmops.ops.state_update.reference import selective_state_update_ref

needs_native = pytest.mark.skipif(ssmops.available_backends()["cpu"] != "available",
                                  reason="needs the native operator library")


@pytest.mark.parametrize("backend", backend_params(devices=GRID_DEVICES))
@pytest.mark.parametrize("case", STATE_UPDATE_CASES, ids=state_update_case_id)
def test_backend_matches_reference(backend, case):
    kw = on_device(state_update_inputs(**case), backend.device)
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
    ref_state = kw["state"].clone()
    y_ref = selective_state_update_ref(**{**kw, "state": ref_state})
    assert y.dtype == kw["x"].dtype and state.dtype == torch.float32
    for got_state, got_y in ((state, y), (ref_state, y_ref)):
        assert_close(got_state, last, TOLERANCES[torch.float32], "state")
        assert_close(got_y, y_scan[..., 0], TOLERANCES[kw["x"].dtype], "y")


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
        (dict(state=torch.zeros(2, 6, 5, dtype=torch.float64)), TypeError, "state must have dtype float32"),
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


@pytest.mark.parametrize("backend", backend_params(devices=GRID_DEVICES))
def test_state_update_under_every_backend(backend):
    kw = on_device(state_update_inputs(groups=2), backend.device)
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


# --- the multi-head form: Mamba-2's layout, tied decay, a cache, low-precision states -----


def multihead_inputs(batch=3, nheads=4, headdim=5, dstate=6, ngroups=2, tied=True, D="head", full=True,
                     state_dtype=torch.float32, dtype=torch.float32, cache=None, seed=0):
    """Inputs of the 4-D layout, dt/A/dt_bias passed as mamba_ssm's Mamba2 passes them when tied
    (stride-0 expansions over headdim and dstate); `cache` rows with a padding row when given."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    dt = randn(batch, nheads) * 0.5 - 1 if tied else randn(batch, nheads, headdim) * 0.5 - 1
    A = -torch.rand(nheads, generator=g) - 0.1 if tied else -torch.rand(nheads, headdim, dstate, generator=g) - 0.1
    bias = randn(nheads) * 0.1 if tied else randn(nheads, headdim) * 0.1
    if tied:
        dt, A, bias = dt[..., None].expand(batch, nheads, headdim), A[:, None, None].expand(nheads, headdim, dstate), \
            bias[:, None].expand(nheads, headdim)
    rows = cache or batch
    kw = dict(
        state=randn(rows, nheads, headdim, dstate).to(state_dtype), x=randn(batch, nheads, headdim).to(dtype),
        dt=dt.to(dtype), A=A, B=randn(batch, ngroups, dstate).to(dtype), C=randn(batch, ngroups, dstate).to(dtype),
        D=(randn(nheads) if D == "head" else randn(nheads, headdim)) if full else None,
        z=randn(batch, nheads, headdim).to(dtype) if full else None, dt_bias=bias if full else None,
        dt_softplus=full,
    )
    if cache:  # rows in a shuffled order, the middle one padding
        kw["state_batch_indices"] = torch.tensor([cache - 1] + [-1] * (batch - 2) + [0], dtype=torch.int32)
    return kw


MULTIHEAD_CASES = [
    dict(),
    dict(tied=False, D="channel"),
    dict(full=False, ngroups=1),
    dict(state_dtype=torch.bfloat16, dtype=torch.bfloat16, ngroups=4),
    dict(state_dtype=torch.float16, cache=5),
    dict(tied=False, cache=4, state_dtype=torch.bfloat16),
    dict(dstate=35, headdim=3),  # the row kernel's vectors of 16 states, then a tail
    dict(dstate=35, tied=False, state_dtype=torch.bfloat16),
    dict(nheads=8, headdim=64, dstate=128, ngroups=2),  # 4 heads a task (the CPU kernel's grain), tasks on threads
]


@pytest.mark.parametrize("backend", backend_params(devices=GRID_DEVICES))
@pytest.mark.parametrize("case", MULTIHEAD_CASES, ids=state_update_case_id)
def test_multihead_backend_matches_reference(backend, case):
    kw = on_device(multihead_inputs(**case), backend.device)
    expected_state = kw["state"].clone()
    expected = selective_state_update_ref(**{**kw, "state": expected_state})
    with ssmops.use_backend(backend):
        y = ssmops.selective_state_update(**kw)
    assert y.dtype == kw["x"].dtype and kw["state"].dtype == case.get("state_dtype", torch.float32)
    # the state is rounded to its dtype once per step in both
    assert_close(kw["state"].float(), expected_state.float(), TOLERANCES[kw["state"].dtype], "state")
    assert_close(y, expected, TOLERANCES[kw["x"].dtype], "y")
    if "state_batch_indices" in kw:
        assert torch.equal(y[1], torch.zeros_like(y[1]))  # the padding row


def test_reference_multihead_is_the_flat_layout():
    """Mamba-2's layout is Mamba-1's with (head, channel) pairs as channels: the reference's two
    layouts agree with each other, tied forms included."""
    kw = multihead_inputs(D="channel")
    batch, nheads, headdim, dstate = kw["state"].shape
    dim = nheads * headdim
    flat = dict(state=kw["state"].reshape(batch, dim, dstate).clone(), x=kw["x"].reshape(batch, dim),
                dt=kw["dt"].reshape(batch, dim), A=kw["A"].reshape(dim, dstate), B=kw["B"], C=kw["C"],
                D=kw["D"].reshape(dim), z=kw["z"].reshape(batch, dim), dt_bias=kw["dt_bias"].reshape(dim),
                dt_softplus=True)
    y = selective_state_update_ref(**kw)
    y_flat = selective_state_update_ref(**flat)
    torch.testing.assert_close(y.reshape(batch, dim), y_flat)
    torch.testing.assert_close(kw["state"].reshape(batch, dim, dstate), flat["state"])


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_views_equal_per_head_forms(backend, dtype):
    """mamba_ssm's Mamba2 passes dt, A, dt_bias and a per-head D as stride-0 expansions over
    headdim (A also over dstate), and the front end hands them on as they are: every backend reads
    them in place (one decay per head) and agrees with their per-head forms and with contiguous
    per-channel copies."""
    kw = multihead_inputs()
    dt_h = kw["dt"][..., 0].to(dtype)
    heads = dict(dt=dt_h, A=kw["A"][:, 0, 0], D=kw["D"], dt_bias=kw["dt_bias"][:, 0])
    views = dict(dt=dt_h[..., None].expand(kw["x"].shape), A=kw["A"], D=kw["D"][:, None].expand(kw["x"].shape[1:]),
                 dt_bias=kw["dt_bias"])
    assert views["dt"].stride(2) == views["A"].stride(2) == views["D"].stride(1) == 0
    channels = {k: v.contiguous() for k, v in views.items()}
    states, ys = [], []
    with ssmops.use_backend(backend):
        for forms in (views, heads, channels):
            states.append(kw["state"].clone())
            ys.append(ssmops.selective_state_update(**{**kw, **forms, "state": states[-1]}))
    for state, y in zip(states[1:], ys[1:]):
        assert_close(y, ys[0], TOLERANCES[torch.float32], "y")
        assert_close(state, states[0], TOLERANCES[torch.float32], "state")


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16])
def test_mamba1_layout_takes_a_low_precision_state_and_a_cache(backend, state_dtype):
    """The front end passes Mamba-1's layout to the multi-head operator as it is (a channel a head of
    headdim 1): every backend's operator takes it."""
    kw = state_update_inputs(groups=2)
    cache = kw["state"].repeat(2, 1, 1).to(state_dtype)  # 4 rows; batch rows 0 and 1 use rows 3 and 1
    indices = torch.tensor([3, 1])
    expected_cache = cache.clone()
    expected = selective_state_update_ref(**{**kw, "state": expected_cache}, state_batch_indices=indices)
    with ssmops.use_backend(backend):
        y = ssmops.selective_state_update(**{**kw, "state": cache}, state_batch_indices=indices)
    assert cache.dtype == state_dtype and y.dtype == kw["x"].dtype
    assert_close(y, expected, TOLERANCES[state_dtype], "y")
    assert_close(cache.float(), expected_cache.float(), TOLERANCES[state_dtype], "state")
    assert torch.equal(cache[[0, 2]], expected_cache[[0, 2]])  # rows no batch row points at: untouched


@pytest.mark.parametrize("groups", [None, 2], ids=["flat", "grouped"])
def test_multihead_opcheck_in_mamba1_layout(groups):
    """Mamba-1's layout straight into the multi-head operator: fake, schema and (native) kernel agree,
    with B/C flat (batch, dstate) or grouped, a bfloat16 cache and its indices."""
    kw = state_update_inputs(groups=groups)
    cache = kw["state"].repeat(2, 1, 1).bfloat16()
    args = [kw[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")]
    torch.library.opcheck(torch.ops.ssmops.multihead_state_update.default,
                          (cache, *args, torch.tensor([3, 1]), kw["dt_softplus"]))
    with pytest.raises((ValueError, RuntimeError), match="state"):
        torch.ops.ssmops.multihead_state_update.default(cache[:, :-1], *args, torch.tensor([3, 1]), True)


@pytest.mark.parametrize("case", MULTIHEAD_CASES, ids=state_update_case_id)
def test_multihead_opcheck(case):
    kw = multihead_inputs(**case)
    args = [kw.get(k) for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices")]
    torch.library.opcheck(torch.ops.ssmops.multihead_state_update.default, (*args, kw["dt_softplus"]))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(state=torch.zeros(3, 4, 5, 6, dtype=torch.float64)), TypeError, "state must have dtype"),
        (dict(state=torch.zeros(3, 4, 2, 6)), ValueError, r"state must have shape \(cache_size, nheads"),
        (dict(B=torch.zeros(3, 3, 6)), ValueError, "B has ngroups=3, which does not divide nheads=4"),
        (dict(A=torch.zeros(4, 5)), ValueError, "A must have shape"),
        (dict(dt=torch.zeros(3, 4, 2)), ValueError, "dt must have shape"),
        (dict(D=torch.zeros(4, 2)), ValueError, "D must have shape"),
        (dict(state_batch_indices=torch.tensor([0, 1, 9])), ValueError, "state_batch_indices must be <"),
        (dict(state_batch_indices=torch.tensor([0.0, 1.0, 2.0])), TypeError, "state_batch_indices must have dtype"),
    ],
)
def test_multihead_errors_name_the_argument(change, error, match):
    kw = {**multihead_inputs(), **change}
    with pytest.raises(error, match=match):
        ssmops.selective_state_update(**kw)
    # the operator checks too (the C++ library raises RuntimeError with the argument's name)
    (name,) = change
    args = [kw.get(k) for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices")]
    with pytest.raises((error, RuntimeError), match=rf"\b{name}\b"):
        torch.ops.ssmops.multihead_state_update(*args, True)


@pytest.mark.parametrize("backend", backend_params(names=("default", "triton")))
def test_index_past_the_cache_is_padding_while_a_cuda_graph_is_captured(backend, monkeypatch):
    """While a CUDA graph is captured the indices cannot be read back to check them (a server capturing its
    decoding step): an index past the cache is then padding, nothing written outside it and y = 0, on the
    backends a GPU runs. The capture is simulated: `_checks.capturing` answers yes for the CPU tensors here."""
    from ssmops.ops import _checks

    kw = multihead_inputs(cache=5)  # indices [4, -1, 0]
    padded = {**kw, "state": kw["state"].clone(), "state_batch_indices": torch.tensor([4, -1, -1], dtype=torch.int32)}
    past = {**kw, "state": kw["state"].clone(), "state_batch_indices": torch.tensor([4, -1, 5], dtype=torch.int32)}
    monkeypatch.setattr(_checks, "capturing", lambda device: True)
    with ssmops.use_backend(backend):
        expected = ssmops.selective_state_update(**padded)
        y = ssmops.selective_state_update(**past)
    assert torch.equal(y, expected) and torch.equal(y[2], torch.zeros_like(y[2]))
    assert torch.equal(past["state"], padded["state"])


class _MultiheadStep(torch.nn.Module):
    def forward(self, state, x, dt, A, B, C, D, z, dt_bias, indices):
        return ssmops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True, indices) * 2


def test_multihead_step_compiles_and_exports():
    kw = multihead_inputs(cache=4, tied=False)
    args = [kw[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices")]
    expected_state = args[0].clone()
    expected = _MultiheadStep()(expected_state, *args[1:])
    state = args[0].clone()
    y = torch.compile(_MultiheadStep(), fullgraph=True, backend="aot_eager")(state, *args[1:])
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(state, expected_state)
    ep = torch.export.export(_MultiheadStep(), (args[0].clone(), *args[1:]))
    assert "multihead_state_update" in str(ep.graph)
    state = args[0].clone()
    torch.testing.assert_close(ep.module()(state, *args[1:]), expected)
    torch.testing.assert_close(state, expected_state)


# --- the eager step's direct route to the Triton launcher ----------------------------------


@pytest.mark.skipif(not (interpreting() and ssmops.available_backends()["triton"] == "available"),
                    reason="runs the Triton kernels under TRITON_INTERPRET=1 (see test_triton_interpreter_suite)")
@pytest.mark.parametrize("case", [dict(mamba1=dict(groups=2)), dict(mamba1=dict(full=False, dtype=torch.bfloat16)),
                                  dict(multihead=dict()), dict(multihead=dict(tied=False, cache=4,
                                                                              state_dtype=torch.bfloat16))],
                         ids=["mamba1", "mamba1-bare", "multihead-tied", "multihead-cache"])
def test_triton_direct_eager_step_matches_reference(case, monkeypatch):
    """In eager mode on a GPU the front end calls the Triton launcher itself, not the operator: here CPU tensors
    take the GPU route (the registry counts "cpu" among the GPU devices) and the operators are out of reach, so
    the interpreted kernels run through the direct route alone, with the plan of the first call reused by the
    second, and agree with the reference, in and outside inference mode. (Launch counts, copies and the state's
    version: tests/test_triton.py's test_triton_eager_step_is_one_direct_launch.)"""
    import ssmops._registry as registry
    import ssmops.state_update as front

    monkeypatch.setattr(registry, "GPU_DEVICES", (*registry.GPU_DEVICES, "cpu"))

    def unreachable(*args, **kwargs):
        raise AssertionError("the eager step went through an operator")

    monkeypatch.setattr(registry, "operator_for", unreachable)
    ((layout, options),) = case.items()
    kw = state_update_inputs(**options) if layout == "mamba1" else multihead_inputs(**options)
    for inference in (False, True):
        with torch.inference_mode(inference):
            state, expected_state = kw["state"].clone(), kw["state"].clone()
            expected = selective_state_update_ref(**{**kw, "state": expected_state})
            for _ in range(2):  # the second call reuses the first's launch plan: the same result from the same state
                got_state = state.clone()
                y = ssmops.selective_state_update(**{**kw, "state": got_state})
                assert_close(got_state.float(), expected_state.float(), TOLERANCES[state.dtype], "state")
                assert_close(y, expected, TOLERANCES[kw["x"].dtype], "y")
