"""Shared input builders and comparison helpers for the ssmops tests."""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Inductor's C++ (CPU kernels, AOTInductor's wrappers) without the line tables it adds by default for
# sampling profilers: the same machine code, compiled faster (a package's wrapper: 9.7 s -> 6.7 s); and
# AOTInductor's wrapper (the code around the kernels that allocates and calls, run once a call) at -O0
# instead of -O1: a tiny package's wrapper compiles in ~5.5 s instead of ~9.5, the kernels are as
# users get them. Set before torch's inductor reads them, and inherited by the processes the tests start.
os.environ.setdefault("AOT_INDUCTOR_ENABLE_LINE_TABLES", "0")
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
# Inductor's CPU kernels (the aten ops it fuses around ssmops' operators) without SIMD code: a tiny model's
# compiled training step then generates and compiles in less than half the time (70 s -> 30 s on 2 cores),
# and what the tests check, ssmops' operators inside compiled graphs and packages, is the same (`make demo`
# compiles as shipped; TORCHINDUCTOR_VEC_ISA_OK=1 in the environment runs the tests so). One setting for
# the whole process: Inductor keeps the ISA list of its first compile (`valid_vec_isa_list`), and a
# vectorized graph from its on-disk cache would then be compiled without the ISA's flags.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import ssmops
from ssmops._registry import interpreting
from ssmops.ops.selective_scan.checks import CHUNK_LEN

REPO = Path(__file__).resolve().parents[1]
# the launchers' knobs as the code sets them: no autotuning, no choices read from the user's file (ops/_tuning.py)
os.environ.pop("SSMOPS_AUTOTUNE", None)
os.environ["SSMOPS_TUNING_CACHE"] = os.devnull


def pytest_configure(config):
    """Under pytest-xdist, each of N workers gets cores / N threads: torch's intra-op threads, inductor's
    compile workers, and (through the environment) those of the processes it starts. N workers of all
    the cores each would oversubscribe them, OpenMP's threads spinning while they wait for a core
    another worker holds. The checks that depend on the thread count set it themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import torch._inductor.config as inductor_config  # may be imported already, before the variable was set

        inductor_config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


def pytest_collection_modifyitems(config, items):
    """The checks marked slow run first (longest first is how two workers finish together; with
    `--maxschedchunk 2`, as `make test` runs them, pytest-xdist hands them out one or two at a time),
    except those sharing a module-scoped fixture, which stay with their module so that it is built once."""

    def shares_a_fixture(item) -> bool:
        fixtures = getattr(item, "_fixtureinfo", None)
        return fixtures is not None and any(defs[-1].scope == "module" for defs in fixtures.name2fixturedefs.values())

    items.sort(key=lambda item: item.get_closest_marker("slow") is None or shares_a_fixture(item))


def _interpreter_patches_the_language_once_a_launch() -> None:
    """Triton's interpreter patches triton.language's modules (every member, looked up by inspect) when a
    launch starts and again on every call of a @triton.jit function inside it, ~0.3 ms a call: a third of
    the interpreted suites' time, for modules the launch has patched already. Within a launch this lets
    a call through only for a module not yet patched in it (triton.language.core, for the standard
    library's functions), as Triton would patch it; outside the interpreter, or where Triton's
    interpreter has other names, nothing changes."""
    import types

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or launch is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched_in_launch: set | None = None  # the ids of the language modules patched in the running launch

    def patch_lang_once(fn):
        if patched_in_launch is not None:  # (the launch's own call finds the set empty and patches)
            modules = {id(v) for v in fn.__globals__.values()
                       if isinstance(v, types.ModuleType) and (v is tl or v is tl.core)}
            if patched_in_launch and modules <= patched_in_launch:
                return interpreter._LangPatchScope()
            patched_in_launch.update(modules)
        return patch_lang(fn)

    def run_launch(self, *args, run=launch.__call__, **kwargs):
        nonlocal patched_in_launch
        patched_in_launch = set()
        try:
            return run(self, *args, **kwargs)
        finally:
            patched_in_launch = None

    interpreter._patch_lang = patch_lang_once
    launch.__call__ = run_launch


if interpreting() and importlib.util.find_spec("triton") is not None:
    _interpreter_patches_the_language_once_a_launch()


# Where packages run in the C++ runner (examples/cpp): it loads the native library and CMake builds it.
CPP_RUNNER_USABLE = ssmops.available_backends()["cpu"] == "available" and shutil.which("cmake") is not None

# tests/test_deploy.py runs the scans' AOTInductor package in the C++ runner and loads it in Python:
# where it can, the Python-only check of the same package (tests/test_compile_export.py) leaves that to
# it; it runs where test_deploy cannot, and in the process where `default` is registered (both load the
# package `scan_and_ssd_package` compiles once per run).
PACKAGES_CHECKED_IN_TEST_DEPLOY = pytest.mark.skipif(
    CPP_RUNNER_USABLE, reason="tests/test_deploy.py packages this model and runs it in Python and in C++"
)


@pytest.fixture(scope="session")
def scan_and_ssd_package(tmp_path_factory) -> tuple:
    """tests/models.ScanAndSsdModels and its AOTInductor package (exported at (2, 37, 8), batch and seqlen
    dynamic), compiled once per test run: pytest-xdist's workers and the processes they start (the
    `default` rerun) share it, under a file lock, in a folder named after the run
    (PYTEST_XDIST_TESTRUNUID, which those processes inherit). The package is the same whichever backend
    the compiling process registered for CPU: its calls name the operators, and the process that runs it
    picks the kernels."""
    import ssmops.export as sx
    from models import ScanAndSsdModels

    model = ScanAndSsdModels().eval()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    folder = Path(tempfile.gettempdir()) / f"ssmops-tests-{run}" if run else tmp_path_factory.mktemp("package")
    folder.mkdir(exist_ok=True)
    package = folder / "scan_and_ssd.pt2"
    with open(folder / "package.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not package.exists():
            ep = sx.export_program(model, (torch.randn(2, 37, 8),), seq_dim=1)
            sx.aoti_package(ep, folder / "scan_and_ssd.partial.pt2").rename(package)
    return model, package


@pytest.fixture(scope="session")
def cpp_runner() -> Path:
    """examples/cpp built with the demo's CMake commands into its folder (so that the demo's own build
    finds it done): once for all pytest-xdist workers and runs, under a file lock, and not again while
    the runner is newer than its sources and torch (so that no second CMake runs there beside the demo's)."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))
    import demo

    runner = demo.CPP_BUILD / "ssmops_run"
    inputs = [p for p in (REPO / "examples" / "cpp").rglob("*") if p.is_file()]
    inputs.append(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")
    demo.CPP_BUILD.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    with open(demo.CPP_BUILD.parent / "cpp.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not runner.exists() or runner.stat().st_mtime < max(p.stat().st_mtime for p in inputs if p.exists()):
            for command in demo.cpp_build_commands():
                subprocess.run(command, check=True, capture_output=True, env=env)
    return runner


TOLERANCES = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One selective-scan configuration. B/C layout: 'const' | 'var' | 'g<groups>'. complex_A: mamba_ssm's
    complex mode (complex A, state and constant B/C; variable B/C real with re/im interleaved in time)."""

    batch: int = 2
    dim: int = 4
    seqlen: int = 7
    dstate: int = 3
    B: str = "var"
    C: str = "var"
    D: bool = True
    z: bool = True
    delta_bias: bool = True
    softplus: bool = True
    initial_state: bool = False
    dtype: torch.dtype = torch.float32
    complex_A: bool = False

    def __str__(self):
        flags = "".join(k[0] for k in ("D", "z", "delta_bias", "softplus", "initial_state") if getattr(self, k))
        return (
            f"b{self.batch}d{self.dim}l{self.seqlen}n{self.dstate}-B{self.B}-C{self.C}-{flags}-"
            f"{str(self.dtype).replace('torch.', '')}{'-complexA' if self.complex_A else ''}"
        )


def _bc(layout: str, case: Case, gen: torch.Generator, dtype) -> torch.Tensor:
    b, d, n = case.batch, case.dim, case.dstate
    L = 2 * case.seqlen if case.complex_A else case.seqlen  # complex A: re/im pairs along time
    shape = {"const": (d, n), "var": (b, n, L)}.get(layout) or (b, int(layout[1:]), n, L)
    if layout == "const":
        return torch.randn(shape, generator=gen, dtype=torch.complex64 if case.complex_A else torch.float32)
    return torch.randn(shape, generator=gen).to(dtype)


def _A(case: Case, gen: torch.Generator) -> torch.Tensor:
    """Decaying A; for complex A also rotating, with S4D-Lin-like frequencies (pi * n)."""
    d, n = case.dim, case.dstate
    decay = -torch.rand(d, n, generator=gen) * 2 - 0.1
    if not case.complex_A:
        return decay
    return torch.complex(decay * 0.5, torch.randn(d, n, generator=gen) * math.pi)


def make_inputs(case: Case, seed: int = 0, device="cpu") -> dict:
    """Inputs of `selective_scan_fn` as keyword arguments, with mamba-like magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    b, d, L, n, dt = case.batch, case.dim, case.seqlen, case.dstate, case.dtype
    kw = dict(
        u=torch.randn(b, d, L, generator=gen).to(dt),
        # dt in mamba's range: softplus(delta) ~ 0.1..0.6, or delta itself positive
        delta=(torch.randn(b, d, L, generator=gen) * 0.5 - 1.0).to(dt)
        if case.softplus
        else (torch.rand(b, d, L, generator=gen) * 0.3 + 0.01).to(dt),
        A=_A(case, gen),
        B=_bc(case.B, case, gen, dt),
        C=_bc(case.C, case, gen, dt),
        D=torch.randn(d, generator=gen) if case.D else None,
        z=torch.randn(b, d, L, generator=gen).to(dt) if case.z else None,
        delta_bias=torch.randn(d, generator=gen) * 0.1 if case.delta_bias else None,
        delta_softplus=case.softplus,
        initial_state=torch.randn(b, d, n, generator=gen, dtype=torch.complex64 if case.complex_A else torch.float32)
        if case.initial_state
        else None,
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def tensor_args(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error relative to the reference's magnitude (fla's measure)."""
    actual, expected = (x.to(torch.complex128 if x.is_complex() else torch.float64) for x in (actual, expected))
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()


def assert_close(actual, expected, tol, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def assert_within_int16_rounding(y, expected, x, w, scale):
    """The CPU kernel's int8 path rounds each row of x to 16-bit integers scaled to its largest |x|
    (docs/design.md): each x moves by at most max|x row| / 65534, so y[m, n] by at most that times
    sum_k |w[n, k]| * scale[n], plus float32 rounding."""
    x_step = x.double().abs().amax(dim=1, keepdim=True) / (2 * 32767)
    bound = x_step * (w.double().abs() * scale.double()[:, None]).sum(dim=1) + 1e-6 * expected.abs().max()
    err = (y.double() - expected.double()).abs()
    assert bool((err <= bound).all()), f"y: error {(err - bound).max():.3g} past the int16 rounding bound"


def run_scan_with_grads(fn, kw: dict, seed: int = 1):
    """Runs fn(**kw, return_last_state=True); returns (y, last_state, grads by name)."""
    kw = {k: v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    y, last = fn(**kw, return_last_state=True)
    gen = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=gen).to(y.device, y.dtype)
    gl = torch.randn(last.shape, generator=gen, dtype=last.dtype).to(last.device)
    # <last, gl> as a real inner product (the real one when the state is real)
    loss = (y.float() * gy.float()).sum() + (last.conj() * gl).real.sum()
    tensors = tensor_args(kw)
    grads = torch.autograd.grad(loss, list(tensors.values()))
    return y.detach(), last.detach(), dict(zip(tensors, grads))


def run_in_threads(fn, count: int, repeats: int = 3, timeout: float = 300) -> list:
    """fn(i) for i < count, each in a thread of its own and all at once, `repeats` times; returns
    each one's last result (a thread's error fails the test)."""
    results, errors = [None] * count, []

    def work(i):
        try:
            for _ in range(repeats):
                results[i] = fn(i)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=timeout)
    assert not any(w.is_alive() for w in workers), f"a thread was still running after {timeout} s"
    assert not errors, errors
    return results


# The devices a family's grid runs on: the CPU always, and a GPU where one is present (its Triton kernels
# natively, and the default backend there).
GRID_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class Backend(str):
    """A backend's name, as `ssmops.use_backend` takes it, and the device its test builds inputs on."""

    device: str

    def __new__(cls, name: str, device: str = "cpu"):
        backend = super().__new__(cls, name)
        backend.device = device
        return backend


def on_device(values: dict, device) -> dict:
    """values with every tensor moved to device."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}


# The interpreter walks a Mamba-1 scan a step at a time (~15 ms a step forward and backward at the grid's
# sizes): a case longer than this is slow there (30 s at CHUNK_LEN - 1 steps), so it runs under the
# interpreter only with `-m slow` (make test-triton-interpreter) and natively in make gpu-check.
INTERPRETED_QUICK_SEQLEN = CHUNK_LEN // 2


def backend_params(cases=None, names=None, devices=("cpu",)):
    """Every backend (or those `names`), times every case, on each of `devices` (a family's grids pass
    GRID_DEVICES), each a `Backend`, skipped with its reason where it cannot run here. The CPU's
    Triton cases run only under the interpreter (tests/test_triton.py runs them so), where its
    multi-chunk cases are slow; on a GPU, `triton` and `default` run on CUDA tensors natively."""
    params = []
    for device in devices:
        for case in cases or [None]:
            for name, status in ssmops.available_backends().items():
                if (names is not None and name not in names) or (device != "cpu" and name == "cpu"):
                    continue
                marks = []
                if status != "available":
                    marks.append(pytest.mark.skip(reason=f"{name}: {status}"))
                elif device == "cpu" and name == "triton" and not interpreting():
                    marks.append(pytest.mark.skip(reason="triton: CPU tensors need TRITON_INTERPRET=1"))
                elif device != "cpu" and interpreting():
                    marks.append(pytest.mark.skip(reason=f"{device} tensors do not run under TRITON_INTERPRET=1"))
                if device == "cpu" and name == "triton" and case is not None and case.seqlen > INTERPRETED_QUICK_SEQLEN:
                    marks.append(pytest.mark.slow)
                backend = Backend(name, device)
                label = name if device == "cpu" else f"{name}-{device}"
                values = (backend,) if case is None else (backend, case)
                params.append(pytest.param(*values, marks=marks, id=label if case is None else f"{case}-{label}"))
    return params


# --- selective_state_update inputs --------------------------------------------------


def state_update_inputs(batch=2, dim=6, dstate=5, groups=None, dtype=torch.float32, full=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    bc_shape = (batch, dstate) if groups is None else (batch, groups, dstate)
    return dict(
        state=randn(batch, dim, dstate),
        x=randn(batch, dim).to(dtype),
        dt=(randn(batch, dim) * 0.5 - 1).to(dtype),
        A=-torch.rand(dim, dstate, generator=gen) - 0.1,
        B=randn(*bc_shape).to(dtype),
        C=randn(*bc_shape).to(dtype),
        D=randn(dim) if full else None,
        z=randn(batch, dim).to(dtype) if full else None,
        dt_bias=randn(dim) * 0.1 if full else None,
        dt_softplus=full,
    )


def state_update_case_id(case: dict) -> str:
    return "-".join(f"{k}={str(v).replace('torch.', '')}" for k, v in case.items()) or "plain"


STATE_UPDATE_CASES = [
    dict(),
    dict(groups=3),
    dict(full=False),
    dict(groups=1, dtype=torch.bfloat16),
    dict(dtype=torch.float16, groups=2),
    dict(dstate=37, groups=1),  # the row kernel's vectors of 16 states, then a tail
]



def interpreter_examples(n: int):
    """Under Triton's interpreter (test_triton_interpreter_suite runs the property tests' Triton cases so) an
    SSD problem takes seconds, its gradients ten to thirty, and a scan's gradients several: n drawn problems
    there (derandomized, as everywhere in CI; natively on a GPU the profile's count)."""
    from hypothesis import settings

    return settings(max_examples=n) if interpreting() else (lambda test: test)


def benchmark_module(name: str):
    """A module of benchmarks/ that the tests share (triton_aot, triton_counts), imported by name with
    benchmarks/ on the path only meanwhile (its names, e.g. models, are the tests' own too)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def run_python(code: str, env: dict | None = None, timeout: float = 600, cwd=REPO,
               args: list[str] = ()) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (so a crash or a different import-time setting is
    isolated), importing the same ssmops as this process (e.g. `make sanitize`'s build)."""
    env = dict(env or {})
    package_root = str(Path(ssmops.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [env.pop("PYTHONPATH", None), package_root, os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
        env={**os.environ, **env, "PYTHONPATH": path},
    )


def run_pytest(args: list[str], env: dict) -> None:
    """pytest over `args` in a process of its own with `env` added to this one's (an import-time setting
    such as TRITON_INTERPRET or SSMOPS_BACKEND), asserting that its tests ran and passed."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout.splitlines()[-1]


try:  # hypothesis profiles: a short one for CI, `HYPOTHESIS_PROFILE=long` for local soaking
    from hypothesis import HealthCheck, settings

    # CI draws the same examples every run (a red CI is then a real regression); `long` draws anew.
    # Same only for the same modules imported before the test: Hypothesis mixes constants from the
    # project's own modules loaded so far into a few draws, so a worker's earlier tests change its
    # examples, and every test must hold for every valid draw.
    settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover - hypothesis is a test extra
    pass


class CountOps(TorchDispatchMode):
    """How many times each operator ran under it (by name: "ssmops.mamba_step", "aten.mm", ...)."""

    def __enter__(self):
        self.counts = collections.Counter()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[f"{func.namespace}.{func._opname}"] += 1
        return func(*args, **(kwargs or {}))
