"""Without the C++ library the package still imports, says so once, and runs on `default`."""

from __future__ import annotations

import os
import shutil

import pytest

import ssmops
from conftest import REPO, run_python

_SCRIPT = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import ssmops, ssmops.compat, ssmops._ops
import torch
print("WARNINGS", sum("native CPU library is not available" in str(w.message) for w in caught))
print("STATUS", ssmops.available_backends()["cpu"])
u = torch.randn(1, 4, 9)
y = ssmops.selective_scan_fn(u, u.sigmoid(), -torch.ones(4, 2), torch.randn(1, 2, 9), torch.randn(1, 2, 9))
print("SHAPE", tuple(y.shape))
try:
    ssmops.library_path()
except FileNotFoundError as err:
    print("PATH_ERROR", "not built" in str(err))
"""


def test_package_without_library_warns_once_and_runs_default(tmp_path):
    shutil.copytree(REPO / "ssmops", tmp_path / "ssmops", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    out = run_python(_SCRIPT, env={"PYTHONPATH": str(tmp_path), "SSMOPS_BACKEND": ""}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "WARNINGS 1" in out.stdout
    assert "STATUS the ssmops operator library was not built" in out.stdout
    assert "SHAPE (1, 4, 9)" in out.stdout and "PATH_ERROR True" in out.stdout


def test_env_var_default_leaves_library_unloaded():
    out = run_python("import ssmops; print(ssmops.available_backends()['cpu'])", env={"SSMOPS_BACKEND": "default"})
    assert out.returncode == 0, out.stderr
    assert "not loaded because SSMOPS_BACKEND=default" in out.stdout


def test_env_var_rejects_unknown_backend():
    out = run_python("import ssmops", env={"SSMOPS_BACKEND": "gpu"})
    assert out.returncode != 0 and "SSMOPS_BACKEND must be one of default, cpu, triton, got 'gpu'" in out.stderr


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI must build the native library; elsewhere it is optional")
def test_ci_has_the_native_library():
    assert ssmops.available_backends()["cpu"] == "available"
