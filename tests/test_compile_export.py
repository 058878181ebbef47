"""The deployment paths of the contract (docs/design.md) on CPU: torch.compile, torch.export, AOTInductor."""

from __future__ import annotations

import pytest
import torch

from conftest import PACKAGES_CHECKED_IN_TEST_DEPLOY, assert_close
from models import TinyScanModel

SEQLENS = (37, 2048 + 11)


def _model(full: bool) -> TinyScanModel:
    torch.manual_seed(0)
    return TinyScanModel(full=full).eval()


def _input(seqlen: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 8, seqlen, generator=torch.Generator().manual_seed(seqlen))


@pytest.mark.parametrize("full", [True, False], ids=["all-optionals", "no-optionals"])
def test_compile_fullgraph_dynamic_seqlen_forward_and_backward(full):
    torch._dynamo.reset()
    model = _model(full)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seqlen in (37, 500, 1999, 2059, 3000):
        x = _input(seqlen)
        x_eager = x.clone().requires_grad_()
        x_comp = x.clone().requires_grad_()
        torch._dynamo.mark_dynamic(x_comp, 2)
        y_eager = model(x_eager)
        y_comp = compiled(x_comp)
        torch.testing.assert_close(y_comp, y_eager, rtol=1e-4, atol=1e-5)
        g_eager = torch.autograd.grad(y_eager.square().sum(), [x_eager, *model.parameters()], materialize_grads=True)
        g_comp = torch.autograd.grad(y_comp.square().sum(), [x_comp, *model.parameters()], materialize_grads=True)
        for a, b in zip(g_comp, g_eager):  # long float32 reductions, summed in another order
            assert_close(a, b, 1e-4, "grad")
    # seqlen stays symbolic: one graph up to 2048 steps (where scan_intermediates has a
    # single chunk, which the compiler specialises as size 1) and one beyond (up to 4096,
    # where Inductor's CPU reduction codegen adds a guard of its own)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 2


def _export(model):
    seqlen = torch.export.Dim("seqlen", min=2, max=1 << 20)
    return torch.export.export(model, (_input(SEQLENS[0]),), dynamic_shapes={"x": {2: seqlen}})


@pytest.mark.parametrize("full", [True, False], ids=["all-optionals", "no-optionals"])
def test_export_dynamic_seqlen_save_load(full, tmp_path):
    model = _model(full)
    ep = _export(model)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "ssmops.selective_scan_fwd.default" in ops
    path = tmp_path / "model.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path).module()
    with torch.no_grad():
        for seqlen in SEQLENS:
            x = _input(seqlen)
            torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@PACKAGES_CHECKED_IN_TEST_DEPLOY
def test_aoti_package_on_cpu(scan_and_ssd_package):
    """Mamba-1's and SSD's test models, with every optional argument and with none, and Mamba-1's complex
    mode, in one package (seqlen dynamic) loaded in Python: what each gives in eager mode, past the
    Mamba-1 kernels' chunk."""
    model, package = scan_and_ssd_package
    runner = torch._inductor.aoti_load_package(str(package))
    with torch.no_grad():
        for seqlen in SEQLENS:
            x = torch.randn(2, seqlen, 8, generator=torch.Generator().manual_seed(seqlen))
            for name, got, want in zip(model.OUTPUTS, runner(x), model(x), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
