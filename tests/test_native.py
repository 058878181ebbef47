"""The native CPU library (ssmops/csrc): its ABI, its schemas, its checks, determinism,
and its kernels on every instruction-set path against the reference.

The full grid against the reference is tests/ops/test_selective_scan.py, which picks up the `cpu`
backend by itself; this file covers what is particular to the C++ library.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

import ssmops
from ssmops.ops import SCHEMAS

from conftest import TOLERANCES, Case, assert_close, make_inputs, run_python, run_scan_with_grads

pytestmark = pytest.mark.skipif(
    ssmops.available_backends()["cpu"] != "available",
    reason=f"native cpu backend not available: {ssmops.available_backends()['cpu']}",
)

FWD = torch.ops.ssmops.selective_scan_fwd.default
BWD = torch.ops.ssmops.selective_scan_bwd.default


def _nm(*flags: str) -> list[str]:
    if shutil.which("nm") is None or shutil.which("c++filt") is None:
        pytest.skip("nm / c++filt (binutils) not installed")
    names = subprocess.run(["nm", "-D", *flags, ssmops.library_path()], capture_output=True, text=True, check=True)
    demangled = subprocess.run(["c++filt"], input=names.stdout, capture_output=True, text=True, check=True)
    return demangled.stdout.splitlines()


def native_isa() -> str:
    """The instruction-set path the library's dispatcher picks in this process."""
    fn = ctypes.CDLL(ssmops.library_path()).ssmops_cpu_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False


# --- the library itself ---------------------------------------------------------------


def test_library_uses_only_the_stable_c_abi():
    undefined = _nm("--undefined-only")
    leaked = [s for s in undefined if re.search(r"\b(c10|at|torch)::", s)]
    assert not leaked, f"C++ torch symbols needed by the library: {leaked[:10]}"
    assert any("aoti_torch_" in s or "torch_" in s for s in undefined)


def test_library_has_no_python_entry_point():
    defined = _nm("--defined-only")
    assert not [s for s in defined if "PyInit_" in s]
    assert not [s for s in _nm("--undefined-only") if re.search(r"\bPy[A-Z_]", s)]


def test_library_defines_the_declared_schemas():
    for name, schema in SCHEMAS.items():
        registered = str(getattr(torch.ops.ssmops, name).default._schema)
        assert registered.removeprefix("ssmops::") == schema


def test_isa_path_is_reported():
    assert native_isa() in ("avx512", "avx2", "generic")


# --- checks ---------------------------------------------------------------------------


def _raw_args(case: Case, seed=0):
    kw = make_inputs(case, seed)
    return [kw[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")], kw


def test_check_error_names_the_argument():
    args, kw = _raw_args(Case(dstate=4))
    args[3] = torch.randn(2, 5, 7)  # B with dstate 5 instead of 4
    with pytest.raises(RuntimeError, match=r"B has dstate 5 but A has dstate 4: .* B is \(2, 5, 7\)"):
        FWD(*args, True)
    args[3] = torch.randn(2, 4, 8)  # B with seqlen 8 instead of 7
    with pytest.raises(RuntimeError, match=r"B must have shape .*\(2, 4, 7\).*got \(2, 4, 8\)"):
        FWD(*args, True)
    args, _ = _raw_args(Case(dstate=4))
    args[2] = args[2].double()
    with pytest.raises(RuntimeError, match=r"A must have dtype float32 or complex64, got float64"):
        FWD(*args, True)
    args, _ = _raw_args(Case(dstate=4, B="g2", C="g2"))
    args[3] = torch.randn(2, 3, 4, 7)  # 3 groups do not divide dim=4
    with pytest.raises(RuntimeError, match=r"B has 3 groups, which does not divide dim=4"):
        FWD(*args, True)


def test_backward_check_error_names_the_argument():
    args, _ = _raw_args(Case())
    out, x, out_z, _ = FWD(*args, True)
    with pytest.raises(RuntimeError, match=r"scan_intermediates must have shape"):
        BWD(*args, out_z, x[:, :1], None, True)
    with pytest.raises(RuntimeError, match=r"dout must have dtype float32, got float16"):
        BWD(*args, out_z.half(), x, None, True)


def test_invalid_isa_override_is_an_error():
    code = (
        "import torch, ssmops\n"
        "u, delta, B, C = torch.randn(4, 1, 2, 3).unbind()\n"
        "try:\n"
        "    ssmops.selective_scan_fn(u, delta, -torch.rand(2, 2), B, C)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    res = run_python(code, env={"SSMOPS_CPU_ISA": "sse9"})
    assert "SSMOPS_CPU_ISA must be auto, avx512, avx2 or generic" in res.stdout, res.stdout + res.stderr


# --- determinism ----------------------------------------------------------------------


def _fwd_bwd(kw: dict, seed: int = 3):
    args = [kw[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")]
    out, x, out_z, last = FWD(*args, kw["delta_softplus"])
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype)
    dlast = torch.randn(last.shape, generator=gen)
    grads = BWD(*args, dout, x, dlast, kw["delta_softplus"])
    return (out, x, out_z, last, *grads)


@pytest.mark.parametrize(
    "case",
    [
        Case(batch=2, dim=40, seqlen=2500, dstate=16, B="var", C="var", initial_state=True),
        Case(batch=3, dim=36, seqlen=300, dstate=5, B="g4", C="g4"),
        Case(batch=2, dim=40, seqlen=600, dstate=16, B="const", C="const", initial_state=True),
        Case(batch=2, dim=24, seqlen=300, dstate=8, B="const", C="var", dtype=torch.bfloat16),
    ],
    ids=str,
)
def test_bitwise_deterministic_across_runs_and_thread_counts(case):
    kw = make_inputs(case)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first, second = _fwd_bwd(kw), _fwd_bwd(kw)
        torch.set_num_threads(1)
        single = _fwd_bwd(kw)
    finally:
        torch.set_num_threads(threads)
    for i, (a, b, c) in enumerate(zip(first, second, single)):
        assert torch.equal(a, b), f"output {i} differs between two runs"
        assert torch.equal(a, c), f"output {i} differs between 2 threads and 1"


# --- against the reference ------------------------------------------------------------

REF_CASES = [
    Case(seqlen=1, dstate=16, initial_state=True),
    Case(seqlen=7, dim=20, dstate=3, B="const", C="const", D=False, z=False, delta_bias=False, softplus=False),
    Case(seqlen=33, dim=18, dstate=17, B="g3", C="g3", initial_state=True),
    Case(seqlen=70, dim=8, dstate=16, B="const", C="g2", delta_bias=False),
    Case(batch=1, dim=3, seqlen=2049, dstate=4, B="var", C="const", initial_state=True),
    Case(batch=1, dim=2, seqlen=4100, dstate=2, B="g2", C="g2", softplus=False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", REF_CASES, ids=str)
def test_kernels_match_reference(case, dtype):
    if dtype != torch.float32 and case.seqlen > 2048:
        pytest.skip("long sequences are covered in float32")
    kw = make_inputs(dataclasses.replace(case, dtype=dtype))
    tol = TOLERANCES[dtype]
    y_ref, last_ref, g_ref = run_scan_with_grads(ssmops.selective_scan_ref, kw)
    with ssmops.use_backend("cpu"):
        y, last, g = run_scan_with_grads(ssmops.selective_scan_fn, kw)
    assert_close(y, y_ref, tol, "y")
    assert_close(last, last_ref, tol, "last_state")
    for name in g_ref:
        assert_close(g[name], g_ref[name], tol, f"d{name}")


def test_strided_transposed_and_expanded_inputs():
    case = Case(batch=2, dim=20, seqlen=50, dstate=6, B="var", C="const")
    kw = make_inputs(case)
    strided = dict(kw)
    strided["u"] = kw["u"].transpose(1, 2).contiguous().transpose(1, 2)
    strided["delta"] = torch.stack([kw["delta"], kw["delta"]], -1)[..., 0]  # stride 2 along seqlen
    strided["B"] = kw["B"][:1].expand_as(kw["B"])
    strided["C"] = kw["C"].t().contiguous().t()
    plain = dict(strided, B=strided["B"].contiguous())
    with ssmops.use_backend("cpu"):
        a = run_scan_with_grads(ssmops.selective_scan_fn, strided)
        b = run_scan_with_grads(ssmops.selective_scan_fn, plain)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for name in b[2]:
        assert torch.equal(a[2][name], b[2][name]), name


# The scan's cases on each ISA path: a grouped B/C with an initial state, a tail alone, and a sequence
# past the kernel's 2048-step chunk. The reference's 2100 Python steps dominate, so the parent computes
# it once (`isa_reference`) and each ISA's interpreter loads it.
ISA_CASES = [Case(seqlen=70, dim=20, dstate=17, B="g2", C="g2", initial_state=True),
             Case(seqlen=9, dim=5, dstate=3, B="const", C="var", softplus=False),
             Case(batch=1, dim=3, seqlen=2100, dstate=8, B="var", C="var")]


@pytest.fixture(scope="module")
def isa_reference(tmp_path_factory):
    """(inputs, reference results) of every ISA case in float32 and bfloat16, saved for the subprocesses."""
    problems = []
    for case in ISA_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            kw = make_inputs(dataclasses.replace(case, dtype=dtype))
            problems.append((kw, run_scan_with_grads(ssmops.selective_scan_ref, kw), TOLERANCES[dtype]))
    path = tmp_path_factory.mktemp("isa") / "reference.pt"
    torch.save(problems, path)
    return path


_ISA_CHECK = """
import ctypes, sys, torch, ssmops
from conftest import assert_close, run_scan_with_grads
fn = ctypes.CDLL(ssmops.library_path()).ssmops_cpu_isa
fn.restype = ctypes.c_char_p
print("ISA", fn().decode())
for kw, ref, tol in torch.load(sys.argv[1], weights_only=False):
    with ssmops.use_backend("cpu"):
        got = run_scan_with_grads(ssmops.selective_scan_fn, kw)
    assert_close(got[0], ref[0], tol, "y")
    assert_close(got[1], ref[1], tol, "last")
    for k in ref[2]:
        assert_close(got[2][k], ref[2][k], tol, k)
from ssmops.modules.linear import quantize_int8
from ssmops.ops.linear.reference import weight_only_linear_ref
from conftest import assert_within_int16_rounding
for rows in (1, 3, 5):  # the decoding GEMV's tiles of x rows, with a tail along in_features
    for in_features in (45, 1100):  # int8: within one block of integer sums and past it
        x, w, b = torch.randn(rows, in_features), torch.randn(10, in_features), torch.randn(10)
        for q, scale in ((w, None), (w.bfloat16(), None), (w.half(), None)):
            expected = weight_only_linear_ref(x, q, scale, b)
            assert_close(ssmops.weight_only_linear(x, q, scale, b), expected, 1e-5, "linear")
        q, scale = quantize_int8(w)
        y, expected = ssmops.weight_only_linear(x, q, scale, b), weight_only_linear_ref(x, q, scale, b)
        assert_within_int16_rounding(y, expected, x, q, scale)
from conftest import state_update_inputs
from ssmops.ops.state_update.reference import selective_state_update_ref
for dstate in (5, 37):  # the decoding step's row kernel: a tail alone, vectors of 16 and a tail
    kw = state_update_inputs(dstate=dstate, groups=1)
    expected_state = kw["state"].clone()
    expected = selective_state_update_ref(**{**kw, "state": expected_state})
    with ssmops.use_backend("cpu"):
        y = ssmops.selective_state_update(**kw)
    assert_close(kw["state"], expected_state, 1e-5, "state")
    assert_close(y, expected, 1e-5, "y")
print("OK")
"""


@pytest.mark.slow  # a fresh interpreter per ISA
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_every_isa_path_matches_reference(isa, isa_reference):
    if isa == "avx2" and not (_cpu_has("avx2") and _cpu_has("fma")):
        pytest.skip("this CPU has no AVX2+FMA")
    if isa == "avx512" and not all(_cpu_has(f) for f in ("avx512f", "avx512dq", "avx512bw", "avx512vl")):
        pytest.skip("this CPU has no AVX-512")
    res = run_python(_ISA_CHECK, env={"SSMOPS_CPU_ISA": isa, "PYTHONPATH": "tests"}, args=[str(isa_reference)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"ISA {isa}" in res.stdout and "OK" in res.stdout, res.stdout
