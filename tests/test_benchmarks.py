"""The benchmarks' baselines compute the same scan as the reference, and the scripts run."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ssmops
from conftest import REPO, assert_close

sys.path.insert(0, str(REPO / "benchmarks"))
from _common import scan_inputs  # noqa: E402
from baselines import pscan_scan, ref_loop_scan  # noqa: E402


@pytest.mark.parametrize("baseline", [ref_loop_scan, pscan_scan], ids=["ref-loop", "pscan"])
@pytest.mark.parametrize("seqlen", [1, 37, 64])
def test_baseline_matches_reference(baseline, seqlen):
    kw = scan_inputs(2, 8, seqlen, 4, requires_grad=True)
    y = baseline(**kw)
    y_ref = ssmops.selective_scan_ref(**kw, delta_softplus=True)
    assert_close(y, y_ref, 1e-5, "out")
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
    grads = torch.autograd.grad((y * weights).sum(), list(kw.values()))
    grads_ref = torch.autograd.grad((y_ref * weights).sum(), list(kw.values()))
    for name, g, g_ref in zip(kw, grads, grads_ref):
        assert_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.slow
def test_default_benchmark_runs():
    out = subprocess.run([sys.executable, "benchmarks/default.py", "--quick"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "goals:" in out.stdout and "peak memory" in out.stdout
