"""The benchmarks' peers, behind the benchmarks' signature, compute the same scan as the reference,
and the scripts run. The peers are fetched from the package registry on first use (benchmarks/peers.py);
where that cannot be done here (no network, no einops for mamba_ssm's code), their checks are skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ssmops
from conftest import REPO, assert_close

sys.path.insert(0, str(REPO / "benchmarks"))
from _common import scan_inputs  # noqa: E402
from baselines import mamba_ssm_ref, mambapy_pscan  # noqa: E402


@pytest.fixture
def no_stand_ins_left():
    """Loading mamba_ssm's code puts empty stand-ins for its GPU modules (and packages) in sys.modules;
    later tests must not take them for an installed mamba_ssm."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("mamba_ssm", "selective_scan_cuda"):
            del sys.modules[name]


@pytest.mark.parametrize("peer", [mamba_ssm_ref, mambapy_pscan], ids=["mamba_ssm-ref", "mambapy-pscan"])
@pytest.mark.parametrize("seqlen", [1, 37, 64])
def test_peer_matches_reference(peer, seqlen, no_stand_ins_left):
    try:
        baseline = peer()
    except (subprocess.CalledProcessError, SystemExit) as err:  # pip could not fetch it; einops missing
        pytest.skip(f"the peer is not available here: {err}")
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
    pytest.importorskip("einops", reason="the benchmark's mamba_ssm peer needs einops (make bench-deps installs it)")
    out = subprocess.run([sys.executable, "benchmarks/default.py", "--quick"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "goals:" in out.stdout and "peak memory" in out.stdout
