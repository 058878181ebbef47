"""`ssmops.compat.selective_scan_cuda` takes and returns what mamba_ssm's extension does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ssmops
from conftest import TOLERANCES, Case, assert_close, backend_params, make_inputs, run_scan_with_grads
from ssmops.compat import selective_scan_cuda

CHUNK = 2048


def _fwd_args(kw):
    return (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"], kw["delta_softplus"])


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize(
    "case",
    [
        Case(B="const", C="const"),
        Case(B="g2", C="g2", z=False, D=False, delta_bias=False),
        Case(batch=1, dim=2, dstate=4, seqlen=CHUNK + 9, B="g2", C="g2", dtype=torch.bfloat16),
        Case(B="g2", C="const", complex_A=True),  # x is then complex, as mamba_ssm's
    ],
    ids=str,
)
def test_fwd_and_bwd_match_reference(case, backend):
    if case.complex_A and backend == "triton":
        pytest.skip("the Triton kernels reject complex A")
    kw = make_inputs(case)
    y_ref, last_ref, _ = run_scan_with_grads(ssmops.selective_scan_ref, kw)
    with ssmops.use_backend(backend):
        res = selective_scan_cuda.fwd(*_fwd_args(kw))
        assert len(res) == (3 if case.z else 2)
        out, x = res[0], res[1]
        n_chunks = -(-case.seqlen // CHUNK)
        assert x.shape == (case.batch, case.dim, n_chunks, 2 * case.dstate) and x.dtype == kw["A"].dtype
        final = res[2] if case.z else out
        tol = TOLERANCES[case.dtype]
        assert_close(final, y_ref, tol, "out_z" if case.z else "out")
        assert_close(x[:, :, -1, 1::2], last_ref, TOLERANCES[torch.float32], "x[:, :, -1, 1::2]")

        # the same upstream gradient as run_scan_with_grads, without the last-state term
        gen = torch.Generator().manual_seed(1)
        dout = torch.randn(final.shape, generator=gen).to(final.dtype)
        dz_buffer = torch.empty_like(kw["u"]) if case.z else None
        grads = selective_scan_cuda.bwd(
            kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"], dout, x, out,
            dz_buffer, kw["delta_softplus"], True,
        )
    _, _, g_expected = run_scan_with_grads(
        lambda **a: (ssmops.selective_scan_ref(**{**a, "return_last_state": False}), torch.zeros(())), kw
    )
    names = ["u", "delta", "A", "B", "C", "D", "delta_bias"]
    assert len(grads) == 7 + (2 if case.z else 0)
    for name, g in zip(names, grads):
        if kw[name] is None:
            assert g is None, f"d{name} must be None when {name} is absent"
        else:
            assert_close(g, g_expected[name], tol, f"d{name}")
            assert g.dtype == kw[name].dtype
    if case.z:
        dz, out_z = grads[7], grads[8]
        assert dz is dz_buffer, "dz must be written into the dz argument"
        assert_close(dz, g_expected["z"], tol, "dz")
        assert_close(out_z, (out.float() * F.silu(kw["z"].float())).to(out.dtype), tol, "out_z")


def test_bwd_without_recompute_returns_only_gradients():
    kw = make_inputs(Case())
    out, x, out_z = selective_scan_cuda.fwd(*_fwd_args(kw))
    grads = selective_scan_cuda.bwd(
        kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
        torch.ones_like(out_z), x, out, None, True, False,
    )
    assert len(grads) == 8 and grads[7].shape == kw["u"].shape
