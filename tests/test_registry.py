"""The registry: without the C++ library the package still imports, says so once, and runs on
`default`; the backend selectors; every module imports on its own (no import cycle)."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil

import pytest
import torch

import ssmops
from conftest import REPO, Case, make_inputs, run_pytest, run_python

_SCRIPT = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import ssmops, ssmops.compat, ssmops._registry
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


@pytest.mark.slow  # a fresh interpreter
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


def test_use_backend_rejects_unknown_and_unavailable():
    with pytest.raises(ValueError, match="backend must be one of"):
        with ssmops.use_backend("cuda"):
            pass
    for name, status in ssmops.available_backends().items():
        if status != "available":
            with pytest.raises(RuntimeError, match=name):
                with ssmops.use_backend(name):
                    pass


def test_use_backend_routes_forward_and_its_backward(monkeypatch):
    from ssmops._registry import kernels

    calls = []
    for op in ("selective_scan_fwd", "selective_scan_bwd"):
        kernel = kernels("default")[op]
        monkeypatch.setitem(kernels("default"), op, lambda *a, op=op, kernel=kernel: calls.append(op) or kernel(*a))
    kw = {k: v.requires_grad_() if isinstance(v, torch.Tensor) else v for k, v in make_inputs(Case()).items()}
    with ssmops.use_backend("default"):
        y = ssmops.selective_scan_fn(**kw)
    y.sum().backward()  # outside the block: still the forward's backend
    assert calls == ["selective_scan_fwd", "selective_scan_bwd"]


def test_use_backend_lets_higher_order_operators_through():
    """use_backend's routing mode passes higher-order operators on: torch.cond, and wrap_triton's launch, which
    the causal conv's Triton kernels took under the mode in a CUDA backward run inside the block (torch 2.11, an
    H200: "no rule registered for HigherOrderOperator triton_kernel_wrapper_mutation")."""
    x = torch.randn(3)
    with ssmops.use_backend("default"):
        assert torch.equal(torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,)),
                           x + 1 if x.sum() > 0 else x - 1)


def _package_modules() -> list[str]:
    root = REPO / "ssmops"
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


_IMPORT_EACH_ALONE = """
import os, sys
# the slow part, once: torch (and inductor's utilities, which the Triton launchers import, and Triton);
# each module of the package is then imported first and alone in a forked child
import torch, torch._inductor.utils
try:
    import triton
except ImportError:
    pass

failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            __import__(name)
        except BaseException as err:
            print("FAIL", name, type(err).__name__, err, flush=True)
            os._exit(1)
        os._exit(0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        failed.append(name)
print("FAILED", failed)
"""


def _imported_modules(module: str) -> set[str]:
    """The package's modules that `module` imports anywhere in its source (functions' lazy imports
    too): `from pkg import name` counts as pkg.name where that is a module, else as pkg."""
    known = set(_package_modules())
    parts = module.split(".")
    path = REPO.joinpath(*parts)
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in found if m in known and m != module}


def test_no_import_cycles():
    """No module of the package reaches itself through imports, lazy ones inside functions included (a
    lazy cycle is a module that cannot be understood, or moved, apart from its partner): e.g. export.py
    and onnx.py shared ExportError so, until it moved to _errors.py."""
    graph = {m: _imported_modules(m) for m in _package_modules()}
    assert graph["ssmops.onnx"] and graph["ssmops"], "the imports were not read"

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return False

    cycles = sorted(m for m in graph if reaches(m, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_import_leaves_the_integration_and_model_layer_unloaded():
    """`import ssmops` loads the operators and their front ends; the transformers integration and the
    model layer load when first used (ssmops.enable_transformers)."""
    out = run_python("import sys, ssmops\n"
                     "print(sorted(m for m in sys.modules if m.startswith(('ssmops.integrations', 'ssmops.models', "
                     "'ssmops.export', 'ssmops.onnx'))))\n"
                     "ssmops.enable_transformers\n"
                     "print('ssmops.integrations.transformers' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "True"], out.stdout


@pytest.mark.slow  # a fresh interpreter per module
def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each module of the package, imported first and alone (e.g. ssmops.ops.selective_scan.default),
    succeeds: no module reads a half-imported one through an import cycle. Triton's modules are
    skipped where Triton is not installed; `__main__` is the CLI."""
    modules = [m for m in _package_modules() if not m.endswith("__main__")]
    if importlib.util.find_spec("triton") is None:
        modules = [m for m in modules if "triton" not in m]
    assert "ssmops.ops.selective_scan.default" in modules and len(modules) > 20
    out = run_python(_IMPORT_EACH_ALONE, args=modules)
    assert out.returncode == 0, out.stderr
    assert "FAILED []" in out.stdout, out.stdout


@pytest.mark.slow  # 20 s of compiles: not in `make test-quick`
@pytest.mark.skipif(os.environ.get("SSMOPS_BACKEND") == "default", reason="this process runs on `default` already")
def test_operator_and_deployment_checks_with_default_registered_for_cpu():
    """tests/ops' opcheck, compile and export checks and tests/test_compile_export.py's again with
    SSMOPS_BACKEND=default (read at import: the native library is not loaded, and `default` is what the
    dispatcher registers for CPU), in a process of its own; compiles with every optional argument only (this run
    compiles both kinds; eager tests run `default` without them), and the selective scan in tests/ops' small
    graph (test_compile_export's model, at five lengths, takes 20 s). Not AOTInductor's packages: their runner
    is a C++ program, which needs the native library (and a package's build took 25 s of the run's 45)."""
    selection = ("(opcheck or compile or export) and not aoti and not (fullgraph and (no-optionals or "
                 "test_compile_export))")
    run_pytest(["-m", "slow or not slow", "-k", selection, "tests/ops", "tests/test_compile_export.py"],
               {"SSMOPS_BACKEND": "default"})
