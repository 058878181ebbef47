"""`ssmops.compat.selective_scan_cuda` takes and returns what mamba_ssm's extension does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ssmops
from conftest import GRID_DEVICES, TOLERANCES, Case, assert_close, backend_params, make_inputs, run_scan_with_grads
from ssmops.compat import selective_scan_cuda

CHUNK = 2048


def _fwd_args(kw):
    return (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"], kw["delta_softplus"])


FWD_BWD_CASES = [
    Case(B="const", C="const"),
    Case(B="g2", C="g2", z=False, D=False, delta_bias=False),
    Case(batch=1, dim=2, dstate=4, seqlen=CHUNK + 9, B="g2", C="g2", dtype=torch.bfloat16),
    Case(B="g2", C="const", complex_A=True),  # x is then complex, as mamba_ssm's
]


@pytest.mark.parametrize("backend, case", backend_params(FWD_BWD_CASES))
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


@pytest.mark.parametrize("backend", backend_params(names=("cpu", "default", "triton"), devices=GRID_DEVICES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bwd_as_mamba_inner_calls_it(backend, dtype):
    """mamba_ssm's MambaInnerFn.backward: x and z halves of one xz buffer, dz a half of one dxz buffer
    written in place, out_z recomputed (`recompute_out_z=True`), the gradient of out_z's layout; on
    every backend and device, against the reference's gradients. (On CUDA this call mismatched
    mamba_ssm's reference in an earlier run where the CPU's passed: make gpu-check runs it there.)"""
    device = backend.device
    gen = torch.Generator().manual_seed(3)
    batch, dim, seqlen, dstate = 2, 6, 37, 4
    xz = torch.randn(batch, 2 * dim, seqlen, generator=gen).to(device, dtype)
    u, z = xz.chunk(2, dim=1)
    kw = dict(u=u, delta=(torch.randn(batch, dim, seqlen, generator=gen) * 0.5 - 1).to(device, dtype),
              A=-torch.rand(dim, dstate, generator=gen).to(device) - 0.1,
              B=torch.randn(batch, 1, dstate, seqlen, generator=gen).to(device, dtype),
              C=torch.randn(batch, 1, dstate, seqlen, generator=gen).to(device, dtype),
              D=torch.randn(dim, generator=gen).to(device), z=z,
              delta_bias=(torch.randn(dim, generator=gen) * 0.1).to(device), delta_softplus=True)
    dout = torch.randn(batch, dim, seqlen, generator=gen).to(device, dtype)
    with ssmops.use_backend(backend):
        out, x, out_z = selective_scan_cuda.fwd(*_fwd_args(kw))
        dxz = torch.empty_like(xz)
        du_buffer, dz_buffer = dxz.chunk(2, dim=1)
        grads = selective_scan_cuda.bwd(*_fwd_args(kw)[:8], dout, x, out, dz_buffer, True, True)
    leaves = {k: v.detach().float().requires_grad_() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    y_ref = ssmops.selective_scan_ref(**leaves, delta_softplus=True)
    expected = dict(zip(leaves, torch.autograd.grad(y_ref, list(leaves.values()), dout.float())))
    tol = TOLERANCES[dtype]
    assert_close(out_z.float(), y_ref, tol, "out_z")
    for name, g in zip(["u", "delta", "A", "B", "C", "D", "delta_bias", "z"], grads):
        assert_close(g.float(), expected[name], tol, f"d{name}")
    assert grads[7] is dz_buffer and torch.equal(dxz[:, dim:], grads[7]), "dz must be written into dxz's half"
    assert_close(grads[8].float(), y_ref, tol, "the recomputed out_z")  # (from out rounded to u's dtype)
