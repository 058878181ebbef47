"""Every backend against the reference, and the reference against the formulas.

One grid, forward and every gradient (last state included): B/C layouts, optional
arguments, seqlens around the 2048-step chunk, dtypes.
"""

from __future__ import annotations

import dataclasses
import cmath
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
    GRID_DEVICES,
    backend_params,
    make_inputs,
    run_scan_with_grads,
    tensor_args,
)

# --- the reference against a scalar, per-timestep transcription of the contract (docs/design.md) ---------


def _formulas(kw: dict) -> tuple[np.ndarray, np.ndarray]:
    """the contract (docs/design.md)'s equations, one scalar at a time, in float64 (complex128 for complex A)."""
    f = {k: v.to(torch.complex128 if v.is_complex() else torch.float64).numpy() if isinstance(v, torch.Tensor)
         else v for k, v in kw.items()}
    u, delta, A = f["u"], f["delta"], f["A"]
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    complex_A = np.iscomplexobj(A)
    exp = cmath.exp if complex_A else math.exp

    def bc(M, b, d, n, t):
        if M.ndim == 2:
            return M[d, n]
        row = M[b, n] if M.ndim == 3 else M[b, d // (dim // M.shape[1]), n]
        return complex(row[2 * t], row[2 * t + 1]) if complex_A else row[t]

    y = np.zeros_like(u)
    last = np.zeros((batch, dim, dstate), dtype=A.dtype)
    for b in range(batch):
        for d in range(dim):
            h = [f["initial_state"][b, d, n] if f["initial_state"] is not None else 0.0 for n in range(dstate)]
            for t in range(seqlen):
                dt = delta[b, d, t] + (f["delta_bias"][d] if f["delta_bias"] is not None else 0.0)
                if f["delta_softplus"]:
                    dt = math.log1p(math.exp(dt))
                acc = 0.0
                for n in range(dstate):
                    h[n] = exp(dt * A[d, n]) * h[n] + dt * bc(f["B"], b, d, n, t) * u[b, d, t]
                    acc += h[n] * bc(f["C"], b, d, n, t)
                if complex_A:  # h's conjugate pair adds the conjugate term
                    acc = 2 * acc.real
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
# mamba_ssm's complex mode: complex A, state and constant B/C, variable B/C as interleaved re/im pairs
COMPLEX_FORMULA_CASES = [
    Case(B="var", C="var", complex_A=True),
    Case(B="const", C="g2", initial_state=True, complex_A=True),
    Case(B="g2", C="const", D=False, z=False, softplus=False, initial_state=True, complex_A=True),
]


def _wide(x):
    """float64, or complex128 for a complex tensor (the precision the formulas are checked in)."""
    return x.to(torch.complex128 if x.is_complex() else torch.float64) if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("case", FORMULA_CASES + COMPLEX_FORMULA_CASES, ids=str)
def test_reference_matches_formulas(case):
    kw = make_inputs(case)
    y, last = ssmops.selective_scan_ref(**{k: _wide(v) for k, v in kw.items()}, return_last_state=True)
    y_expected, last_expected = _formulas(kw)
    np.testing.assert_allclose(y.numpy(), y_expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(last.numpy(), last_expected, rtol=1e-10, atol=1e-12)


def test_reference_computes_in_float32_and_returns_input_dtype():
    kw = make_inputs(Case(dtype=torch.bfloat16))
    y, last = ssmops.selective_scan_ref(**kw, return_last_state=True)
    assert y.dtype == torch.bfloat16 and last.dtype == torch.float32
    y32 = ssmops.selective_scan_ref(**{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    assert torch.equal(y, y32.to(torch.bfloat16))


@pytest.mark.parametrize("case", FORMULA_CASES[1:4] + COMPLEX_FORMULA_CASES[:2], ids=str)
def test_reference_gradcheck(case):
    kw = make_inputs(dataclasses.replace(case, batch=1, dim=2, seqlen=4, dstate=2))
    names = list(tensor_args(kw))
    inputs = tuple(_wide(kw[k]).requires_grad_() for k in names)

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


# mamba_ssm's complex mode; the Triton kernels reject it (test_triton_rejects_complex_A)
COMPLEX_SWEEP = [
    *(Case(B=b, C=c, complex_A=True) for b, c in [("const", "const"), ("var", "var"), ("g2", "g2"), ("const", "g2"),
                                                  ("var", "const")]),
    Case(B="g2", C="const", D=False, z=False, delta_bias=False, softplus=False, initial_state=True, complex_A=True),
    Case(batch=1, dim=2, dstate=4, seqlen=CHUNK_LEN + 3, B="g2", C="g2", initial_state=True, complex_A=True),
    Case(batch=1, dim=3, dstate=17, seqlen=9, B="const", C="var", initial_state=True, complex_A=True),
    Case(dtype=torch.bfloat16, B="g2", C="const", initial_state=True, complex_A=True),
]
CPU_BACKENDS = ("default", "cpu")


@pytest.mark.parametrize("backend, case", backend_params(SWEEP, devices=GRID_DEVICES)
                         + backend_params(COMPLEX_SWEEP, names=CPU_BACKENDS))
def test_backend_matches_reference(backend, case):
    kw = make_inputs(case, device=backend.device)
    y_ref, last_ref, g_ref = run_scan_with_grads(ssmops.selective_scan_ref, kw)
    with ssmops.use_backend(backend):
        y, last, grads = run_scan_with_grads(ssmops.selective_scan_fn, kw)
    tol = TOLERANCES[case.dtype]
    assert_close(y, y_ref, tol, "out")
    assert_close(last, last_ref, TOLERANCES[torch.float32], "last_state")
    for name, g in grads.items():
        assert_close(g, g_ref[name], tol, f"d{name}")


@pytest.mark.parametrize("backend", backend_params(devices=GRID_DEVICES))
def test_strided_and_expanded_inputs_match_contiguous(backend):
    case = Case(batch=2, dim=4, seqlen=9, dstate=3, B="var", C="const")
    kw = make_inputs(case, device=backend.device)
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
    Case(B="var", C="const", initial_state=True, complex_A=True),
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


# --- complex A: what the other sections do not cover --------------------------------------


def _complex_kw(**changes) -> dict:
    return make_inputs(dataclasses.replace(Case(B="g2", C="const", initial_state=True, complex_A=True), **changes))


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda kw: {"B": kw["B"][..., : kw["u"].shape[-1]]}, ValueError,
         r"B must have shape .*\(batch, dstate, 2 \* seqlen\)=\(2, 3, 14\).* got \(2, 2, 3, 7\)"),
        (lambda kw: {"C": kw["C"].real}, TypeError, r"C must have dtype complex64 \(a constant B/C is complex"),
        (lambda kw: {"B": torch.complex(kw["B"], kw["B"])}, TypeError,
         r"B must have dtype float32 \(a variable B/C holds re/im pairs when A is complex\), got torch.complex64"),
        (lambda kw: {"initial_state": kw["initial_state"].real}, TypeError,
         "initial_state must have dtype complex64, got torch.float32"),
        (lambda kw: {"A": kw["A"].to(torch.complex128)}, TypeError,
         "A must have dtype float32 or complex64, got torch.complex128"),
        (lambda kw: {"A": kw["A"].real, "B": kw["B"][..., ::2], "C": kw["C"].real}, TypeError,
         "initial_state must have dtype float32, got torch.complex64"),
        (lambda kw: {"D": kw["A"][:, 0]}, TypeError, "D must have dtype float32, got torch.complex64"),
    ],
    ids=["B-time-not-doubled", "constant-C-real", "variable-B-complex", "initial-state-real", "A-complex128",
         "real-A-complex-state", "D-complex"],
)
def test_complex_A_argument_errors_name_argument_and_expectation(change, error, message):
    kw = _complex_kw()
    kw.update(change(kw))
    with pytest.raises(error, match=message):
        ssmops.selective_scan_fn(**kw)


def test_triton_rejects_complex_A():
    triton_backend = pytest.importorskip("ssmops.ops.selective_scan.triton", exc_type=ImportError)
    fwd_args, bwd_args = _op_args(Case(complex_A=True))
    with pytest.raises(NotImplementedError, match=r"triton backend: A must be float32, got torch.complex64"):
        triton_backend.selective_scan_fwd(*fwd_args)
    with pytest.raises(NotImplementedError, match=r"triton backend: A must be float32, got torch.complex64"):
        triton_backend.selective_scan_bwd(*bwd_args)


def test_complex_A_scan_intermediates_are_mamba_ssm_s_complex_x():
    kw = _complex_kw(batch=1, dim=2, seqlen=CHUNK_LEN + 5)
    _, x, _, last = torch.ops.ssmops.selective_scan_fwd(
        kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"], kw["initial_state"], True
    )
    assert x.dtype == torch.complex64 and x.shape == (1, 2, 2 * 2 * 3)
    x = x.view(1, 2, 2, 6)
    dt = F.softplus(kw["delta"] + kw["delta_bias"][:, None])
    torch.testing.assert_close(x[:, :, 0, 0::2], torch.exp(dt[..., :CHUNK_LEN].sum(-1, keepdim=True) * kw["A"]))
    torch.testing.assert_close(x[:, :, -1, 1::2], last, rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params(names=CPU_BACKENDS))
def test_mamba_inner_fn_complex_A_matches_a_reference_composition(backend):
    gen = torch.Generator().manual_seed(0)
    batch, d_inner, d_model, n, dt_rank, width, L = 2, 8, 6, 3, 2, 4, 9

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    params = dict(
        xz=randn(batch, 2 * d_inner, L), conv1d_weight=randn(d_inner, 1, width, scale=0.5),
        conv1d_bias=randn(d_inner), x_proj_weight=randn(dt_rank + 4 * n, d_inner, scale=0.3),
        delta_proj_weight=randn(d_inner, dt_rank, scale=0.5), out_proj_weight=randn(d_model, d_inner),
        out_proj_bias=randn(d_model),
        A=torch.complex(-torch.rand(d_inner, n, generator=gen) - 0.1, torch.randn(d_inner, n, generator=gen))
        .requires_grad_(),
        D=randn(d_inner), delta_bias=randn(d_inner, scale=0.1),
        B_proj_bias=randn(2 * n), C_proj_bias=randn(2 * n),  # d_state = 2 * n columns: n (re, im) pairs
    )

    def reference(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                  out_proj_bias, A, D, delta_bias, B_proj_bias, C_proj_bias):
        x, z = xz.chunk(2, dim=1)
        x = F.silu(F.conv1d(x, conv1d_weight, conv1d_bias, padding=width - 1, groups=d_inner)[..., :L])
        x_dbl = x.transpose(1, 2).reshape(batch * L, d_inner) @ x_proj_weight.t()  # rows (b, l)
        delta = (delta_proj_weight @ x_dbl[:, :dt_rank].t()).reshape(d_inner, batch, L).transpose(0, 1)

        def interleaved(cols):  # (b l, (dstate two)) -> (b, dstate, (l two)): mamba_ssm's layout
            return cols.reshape(batch, L, n, 2).permute(0, 2, 1, 3).reshape(batch, n, 2 * L)

        B = interleaved(x_dbl[:, dt_rank:dt_rank + 2 * n] + B_proj_bias)
        C = interleaved(x_dbl[:, -2 * n:] + C_proj_bias)
        y = ssmops.selective_scan_ref(x, delta, A, B, C, D, z, delta_bias, delta_softplus=True)
        return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)

    expected = reference(**params)
    with ssmops.use_backend(backend):
        out = ssmops.mamba_inner_fn(**params)
        g = torch.randn(out.shape, generator=gen)
        grads = torch.autograd.grad((out * g).sum(), list(params.values()))
    assert_close(out, expected, 2e-5, "out")
    grads_ref = torch.autograd.grad((expected * g).sum(), list(params.values()))
    for name, a, b in zip(params, grads, grads_ref):
        assert_close(a, b, 2e-4, f"d{name}")


_SCAN_ARGS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def _scan_with_last_state(u, delta, A, B, C, D, z, delta_bias, initial_state):
    return ssmops.selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True, return_last_state=True,
                                    initial_state=initial_state)


@pytest.mark.parametrize("complex_A", [False, True], ids=["real-A", "complex-A"])
def test_compiles_fullgraph_forward_and_backward(complex_A):
    """A small scan with every optional argument, compiled (a few seconds; the contract's check with a
    model around it, dynamic lengths and two chunks is tests/test_compile_export.py's)."""
    torch._dynamo.reset()
    kw = make_inputs(Case(B="var", C="const", seqlen=11, initial_state=True, complex_A=complex_A))
    args = [kw[k] for k in _SCAN_ARGS]
    compiled = torch.compile(_scan_with_last_state, fullgraph=True)
    eager_args = [a.clone().requires_grad_() for a in args]
    comp_args = [a.clone().requires_grad_() for a in args]
    y, last = _scan_with_last_state(*eager_args)
    y_c, last_c = compiled(*comp_args)
    torch.testing.assert_close(y_c, y)
    torch.testing.assert_close(last_c, last)
    g_last = torch.randn_like(last)

    def loss(y, last):
        return y.square().sum() + (last.conj() * g_last).real.sum()

    grads = torch.autograd.grad(loss(y_c, last_c), comp_args)
    for a, b in zip(grads, torch.autograd.grad(loss(y, last), eager_args)):
        assert_close(a, b, 1e-4, "grad")


class _ComplexScan(torch.nn.Module):
    def forward(self, u, delta, A, B, C, D, z, delta_bias, initial_state):
        return _scan_with_last_state(u, delta, A, B, C, D, z, delta_bias, initial_state)


def _export_complex_scan() -> torch.export.ExportedProgram:
    kw = _complex_kw(B="var", seqlen=11)
    seqlen = torch.export.Dim("seqlen", min=2, max=1 << 16)
    dynamic = {k: None for k in _SCAN_ARGS} | {"u": {2: seqlen}, "delta": {2: seqlen}, "z": {2: seqlen},
                                               "B": {2: 2 * seqlen}}  # B (batch, dstate, 2 * seqlen): (re, im) pairs
    return torch.export.export(_ComplexScan(), tuple(kw[k] for k in _SCAN_ARGS), dynamic_shapes=dynamic)


def _check_runs_like_eager(run) -> None:
    for L in (11, 40):
        kw = _complex_kw(B="var", seqlen=L)
        args = tuple(kw[k] for k in _SCAN_ARGS)
        for a, b in zip(run(*args), _ComplexScan()(*args)):
            torch.testing.assert_close(a, b)


def test_complex_A_exports_with_dynamic_seqlen(tmp_path):
    path = tmp_path / "complex_scan.pt2"
    torch.export.save(_export_complex_scan(), path)
    _check_runs_like_eager(torch.export.load(path).module())
