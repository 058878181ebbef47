"""Every backend against the reference, and the reference against the formulas.

One grid, forward and every gradient (last state included): B/C layouts, optional
arguments, seqlens around the 2048-step chunk, dtypes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ssmops
from ssmops.ops import SCHEMAS
from ssmops.ops.selective_scan.checks import CHUNK_LEN

from conftest import (
    TOLERANCES,
    Case,
    assert_close,
    backend_params,
    make_inputs,
    run_scan_with_grads,
    tensor_args,
)

# --- the reference against a scalar, per-timestep transcription of the contract (docs/design.md) ---------


def _formulas(kw: dict) -> tuple[np.ndarray, np.ndarray]:
    """the contract (docs/design.md)'s equations, one scalar at a time, in float64."""
    f = {k: v.double().numpy() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    u, delta, A = f["u"], f["delta"], f["A"]
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]

    def bc(M, b, d, n, t):
        if M.ndim == 2:
            return M[d, n]
        if M.ndim == 3:
            return M[b, n, t]
        return M[b, d // (dim // M.shape[1]), n, t]

    y = np.zeros_like(u)
    last = np.zeros((batch, dim, dstate))
    for b in range(batch):
        for d in range(dim):
            h = [f["initial_state"][b, d, n] if f["initial_state"] is not None else 0.0 for n in range(dstate)]
            for t in range(seqlen):
                dt = delta[b, d, t] + (f["delta_bias"][d] if f["delta_bias"] is not None else 0.0)
                if f["delta_softplus"]:
                    dt = math.log1p(math.exp(dt))
                acc = 0.0
                for n in range(dstate):
                    h[n] = math.exp(dt * A[d, n]) * h[n] + dt * bc(f["B"], b, d, n, t) * u[b, d, t]
                    acc += h[n] * bc(f["C"], b, d, n, t)
                if f["D"] is not None:
                    acc += f["D"][d] * u[b, d, t]
                if f["z"] is not None:
                    zz = f["z"][b, d, t]
                    acc *= zz / (1.0 + math.exp(-zz))
                y[b, d, t] = acc
            last[b, d] = h
    return y, last


FORMULA_CASES = [
    Case(B="const", C="const", D=False, z=False, delta_bias=False, softplus=False),
    Case(B="var", C="var"),
    Case(B="g2", C="g2", initial_state=True),
    Case(B="const", C="g2", D=False, initial_state=True),
    Case(B="var", C="const", z=False, softplus=False),
]


@pytest.mark.parametrize("case", FORMULA_CASES, ids=str)
def test_reference_matches_formulas(case):
    kw = make_inputs(case)
    y, last = ssmops.selective_scan_ref(**{k: v.double() if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
                                        return_last_state=True)
    y_expected, last_expected = _formulas(kw)
    np.testing.assert_allclose(y.numpy(), y_expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(last.numpy(), last_expected, rtol=1e-10, atol=1e-12)


def test_reference_computes_in_float32_and_returns_input_dtype():
    kw = make_inputs(Case(dtype=torch.bfloat16))
    y, last = ssmops.selective_scan_ref(**kw, return_last_state=True)
    assert y.dtype == torch.bfloat16 and last.dtype == torch.float32
    y32 = ssmops.selective_scan_ref(**{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    assert torch.equal(y, y32.to(torch.bfloat16))


@pytest.mark.parametrize("case", FORMULA_CASES[1:4], ids=str)
def test_reference_gradcheck(case):
    kw = make_inputs(dataclasses.replace(case, batch=1, dim=2, seqlen=4, dstate=2))
    names = list(tensor_args(kw))
    inputs = tuple(kw[k].double().requires_grad_() for k in names)

    def fn(*tensors):
        args = {**kw, **dict(zip(names, tensors))}
        y, last = ssmops.selective_scan_ref(**args, return_last_state=True)
        return y, last

    assert torch.autograd.gradcheck(fn, inputs)


# --- every backend against the reference --------------------------------------------

SWEEP = [
    # layouts x optional arguments, a short odd seqlen
    *(Case(B=b, C=c) for b, c in [("const", "const"), ("var", "var"), ("g2", "g2"), ("const", "var"),
                                  ("var", "const"), ("g4", "const")]),
    Case(D=False, z=False, delta_bias=False, softplus=False),
    Case(z=False, initial_state=True),
    Case(B="g2", C="g2", D=False, delta_bias=False, initial_state=True),
    # seqlens around the chunk boundary and across several chunks
    *(Case(batch=1, dim=2, dstate=4, seqlen=s, B="var", C="var") for s in (1, CHUNK_LEN - 1, CHUNK_LEN + 1)),
    Case(batch=1, dim=2, dstate=4, seqlen=2 * CHUNK_LEN + 4, B="const", C="g2", initial_state=True),
    # dstate large and odd
    Case(batch=1, dim=3, dstate=33, seqlen=9, B="var", C="const"),
    # reduced precision
    *(Case(dtype=dt, B=b, C=c) for dt in (torch.float16, torch.bfloat16) for b, c in [("var", "var"), ("const", "g2")]),
    Case(dtype=torch.bfloat16, batch=1, dim=2, seqlen=CHUNK_LEN + 3, initial_state=True),
]


@pytest.mark.parametrize("backend, case", backend_params(SWEEP))
def test_backend_matches_reference(backend, case):
    kw = make_inputs(case)
    y_ref, last_ref, g_ref = run_scan_with_grads(ssmops.selective_scan_ref, kw)
    with ssmops.use_backend(backend):
        y, last, grads = run_scan_with_grads(ssmops.selective_scan_fn, kw)
    tol = TOLERANCES[case.dtype]
    assert_close(y, y_ref, tol, "out")
    assert_close(last, last_ref, TOLERANCES[torch.float32], "last_state")
    for name, g in grads.items():
        assert_close(g, g_ref[name], tol, f"d{name}")


@pytest.mark.parametrize("backend", backend_params())
def test_strided_and_expanded_inputs_match_contiguous(backend):
    case = Case(batch=2, dim=4, seqlen=9, dstate=3, B="var", C="const")
    kw = make_inputs(case)
    strided = dict(kw)
    strided["u"] = kw["u"].transpose(1, 2).contiguous().transpose(1, 2)  # seqlen-major storage
    strided["delta"] = torch.stack([kw["delta"], kw["delta"]], dim=-1)[..., 0]  # stride 2 in seqlen
    strided["B"] = kw["B"][:1].expand_as(kw["B"])  # stride 0 over batch
    strided["A"] = kw["A"].t().contiguous().t()
    expected_kw = dict(kw, B=strided["B"].contiguous())
    assert not strided["u"].is_contiguous() and strided["B"].stride(0) == 0
    with ssmops.use_backend(backend):
        y, last, grads = run_scan_with_grads(ssmops.selective_scan_fn, strided)
        y_c, last_c, grads_c = run_scan_with_grads(ssmops.selective_scan_fn, expected_kw)
    torch.testing.assert_close(y, y_c)
    torch.testing.assert_close(last, last_c)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_c[name], atol=1e-5, rtol=1e-5, msg=name)


# --- the operators: schemas, opcheck, conventions -----------------------------------


def test_registered_schemas_are_the_declared_ones():
    for name, schema in SCHEMAS.items():
        registered = str(getattr(torch.ops.ssmops, name).default._schema)
        assert registered == "ssmops::" + schema


def _op_args(case: Case, with_dlast: bool = True):
    kw = make_inputs(case)
    fwd_args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
                kw["initial_state"], kw["delta_softplus"])
    out, x, out_z, last = torch.ops.ssmops.selective_scan_fwd(*fwd_args)
    dout = torch.randn_like(out)
    dlast = torch.randn_like(last) if with_dlast else None
    bwd_args = fwd_args[:9] + (dout, x, dlast, kw["delta_softplus"])
    return fwd_args, bwd_args


OPCHECK_CASES = [
    Case(B="g2", C="g2", initial_state=True),
    Case(B="const", C="const", D=False, z=False, delta_bias=False, softplus=False),
    Case(dtype=torch.bfloat16, B="g2", C="g2", seqlen=CHUNK_LEN + 1, batch=1, dim=2, dstate=2),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck(case):
    fwd_args, bwd_args = _op_args(case)
    requires_grad = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in fwd_args)
    torch.library.opcheck(torch.ops.ssmops.selective_scan_fwd.default, fwd_args)
    torch.library.opcheck(torch.ops.ssmops.selective_scan_fwd.default, requires_grad)
    torch.library.opcheck(torch.ops.ssmops.selective_scan_bwd.default, bwd_args)


def test_scan_intermediates_layout_is_mamba_ssm_s():
    case = Case(batch=1, dim=2, dstate=3, seqlen=2 * CHUNK_LEN + 5, B="var", C="var", initial_state=True)
    kw = make_inputs(case)
    out, x, out_z, last = torch.ops.ssmops.selective_scan_fwd(
        kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
        kw["initial_state"], True,
    )
    assert x.shape == (1, 2, 3 * 6) and x.dtype == torch.float32
    x = x.view(1, 2, 3, 6)
    dt = F.softplus(kw["delta"] + kw["delta_bias"][:, None])
    for c, end in enumerate((CHUNK_LEN, 2 * CHUNK_LEN, case.seqlen)):
        cum = torch.exp(dt[:, :, :end].sum(-1, keepdim=True) * kw["A"])
        torch.testing.assert_close(x[:, :, c, 0::2], cum, rtol=1e-4, atol=1e-30)
        _, state = ssmops.selective_scan_ref(**{**kw, "u": kw["u"][..., :end], "delta": kw["delta"][..., :end],
                                                "z": kw["z"][..., :end], "B": kw["B"][..., :end],
                                                "C": kw["C"][..., :end]}, return_last_state=True)
        torch.testing.assert_close(x[:, :, c, 1::2], state, rtol=2e-4, atol=1e-5)
    torch.testing.assert_close(last, x[:, :, -1, 1::2], rtol=0, atol=0)
    assert out_z.shape == out.shape


def test_absent_optional_outputs_are_empty():
    fwd_args, bwd_args = _op_args(Case(D=False, z=False, delta_bias=False, initial_state=False), with_dlast=False)
    out, x, out_z, last = torch.ops.ssmops.selective_scan_fwd(*fwd_args)
    assert out_z.numel() == 0 and out_z.dtype == out.dtype
    grads = torch.ops.ssmops.selective_scan_bwd(*bwd_args)
    dD, ddelta_bias, dz, dinit = grads[5], grads[6], grads[7], grads[8]
    assert all(g.numel() == 0 for g in (dD, ddelta_bias, dz, dinit))


# --- the public API and the selector --------------------------------------------------


def test_selective_scan_fn_returns_like_mamba_ssm():
    kw = make_inputs(Case())
    y = ssmops.selective_scan_fn(**kw)
    assert isinstance(y, torch.Tensor) and y.shape == kw["u"].shape
    y2, last = ssmops.selective_scan_fn(**kw, return_last_state=True)
    assert torch.equal(y, y2) and last.shape == (2, 4, 3) and last.dtype == torch.float32
    positional = ssmops.selective_scan_fn(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"],
                                          kw["delta_bias"], True, False)
    assert torch.equal(y, positional)
