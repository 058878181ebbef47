"""What is specific to the Triton backend (the backend-vs-reference sweep is tests/ops/test_selective_scan.py).

On a CPU-only machine the kernels run under Triton's interpreter, which has to be switched
on (`TRITON_INTERPRET=1`) before Triton and ssmops are imported; `test_triton_interpreter_suite`
therefore runs the Triton tests of this file, tests/ops, test_properties.py and test_nonfinite.py in a fresh
interpreter with it set, so the rest of the suite is unaffected. Run
`TRITON_INTERPRET=1 pytest tests/ops tests/test_properties.py tests/test_nonfinite.py tests/test_triton.py -k triton`
for test-by-test results. The tests marked `gpu` need a CUDA device (on ROCm too).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

import ssmops
from ssmops.ops.selective_scan.checks import CHUNK_LEN
from ssmops._registry import interpreting

from conftest import (
    REPO, STATE_UPDATE_CASES, TOLERANCES, Case, assert_close, benchmark_module, make_inputs, rel_err, run_pytest,
    run_python, run_scan_with_grads, state_update_case_id, state_update_inputs,
)

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
TRITON_AVAILABLE = ssmops.available_backends()["triton"] == "available"
HAS_CUDA = torch.cuda.is_available()

def _triton_version() -> tuple:
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


needs_interpreter = pytest.mark.skipif(
    not (interpreting() and TRITON_AVAILABLE),
    reason="runs under TRITON_INTERPRET=1 (see test_triton_interpreter_suite)",
)
gpu = pytest.mark.skipif(not (HAS_CUDA and TRITON_AVAILABLE), reason="needs a CUDA device and Triton")
# the kernels run under Triton 3.9's interpreter; 3.6's (torch 2.11's) stops in them
needs_triton_39_interpreter = pytest.mark.skipif(
    TRITON_INSTALLED and _triton_version() < (3, 9),
    reason="the kernels run under Triton 3.9's interpreter; 3.6's stops in them (a TypeError converting an array "
           "to a scalar); test_triton_launchers_reject_cpu_tensors... holds")


# Two processes, each a few files: a process's start (torch, Triton, the test modules' collection) is ~5 s
# of the interpreter suite's ~3 minutes of CPU, and two keep both of make test's workers busy.
def _triton_family_folders() -> list[str]:
    """The folder names (`ssmops/ops/<folder>/`) of the families with Triton kernels, read from FAMILIES."""
    from ssmops.ops import FAMILIES

    return [family.triton.split(".")[-2] for family in FAMILIES if family.triton is not None]


# every family's test module (tests/ops/test_<folder>.py), found from FAMILIES, then the cross-cutting files
INTERPRETED_TEST_FILES = {
    "ops": [f"tests/ops/test_{folder}.py" for folder in _triton_family_folders()],
    "properties-and-triton": ["tests/test_properties.py", "tests/test_nonfinite.py", "tests/test_triton.py",
                              "tests/test_fake_strides.py", "tests/test_compat.py"],
}


@pytest.mark.slow  # minutes of interpreted kernels: not in `make test-quick`
@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="already under the interpreter: the tests run in this process")
@needs_triton_39_interpreter
@pytest.mark.parametrize("files", INTERPRETED_TEST_FILES.values(), ids=INTERPRETED_TEST_FILES.keys())
def test_triton_interpreter_suite(files, request):
    """The sweeps of tests/ops (the scans, the decoding steps), the drawn problems of test_properties.py and
    test_nonfinite.py and this file's interpreter tests, with TRITON_INTERPRET=1 (those not marked slow unless
    `-m` says otherwise), in two processes (so that pytest-xdist's workers share them)."""
    # The interpreter runs a kernel about 1e4 times slower than a GPU: the cases marked slow run here
    # only when asked for (`-m slow`, or `make test-triton-interpreter`), and natively in `make gpu-check`.
    markers = request.config.getoption("markexpr") or "not slow"
    run_pytest(["-k", "triton", "-m", markers, *files], {"TRITON_INTERPRET": "1", "SSMOPS_BACKEND": ""})


# --- under the interpreter -------------------------------------------------------------


def _on_kernel_device(args: tuple) -> tuple:
    """args with their tensors on the device the Triton kernels run on here: CUDA, or the CPU under the
    interpreter."""
    device = "cuda" if HAS_CUDA and not interpreting() else "cpu"
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _fwd_args(case: Case, device="cpu"):
    kw = make_inputs(case, device=device)
    return (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
            kw["initial_state"], kw["delta_softplus"])


# The backward operators (no autograd of their own) without opcheck's AOTAutograd run, which runs their
# kernel twice more (~a third of the interpreted file's opcheck time): their fake results are checked
# against the real ones here, and their tracing into kernel launches by the *_trace_into_kernel_launches tests.
BACKWARD_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")

OPCHECK_CASES = [
    Case(B="g2", C="g2", initial_state=True),
    Case(B="const", C="var", D=False, z=False, delta_bias=False, softplus=False),
    Case(dtype=torch.bfloat16, B="var", C="const", batch=1, dim=2, dstate=2, seqlen=5),
]


def _outside_buffers(accesses: list, args: tuple) -> int:
    """How many of (addresses, element size) `accesses` fall outside every tensor argument's storage."""
    spans = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in args
                   if isinstance(t, torch.Tensor))
    starts = np.array([start for start, _ in spans], dtype=np.uint64)
    ends = np.array([start + nbytes for start, nbytes in spans], dtype=np.uint64)
    outside = 0
    for addresses, size in accesses:
        owner = np.searchsorted(starts, addresses, side="right") - 1
        inside = (owner >= 0) & (addresses + np.uint64(size) <= ends[np.maximum(owner, 0)])
        outside += int((~inside).sum())
    return outside


@needs_interpreter
def test_triton_launches_touch_only_their_buffers():
    """Every unmasked load and store of every launch of the scan's and the SSD's forward and backward stays
    inside the launch's tensor arguments, at shapes that leave partial blocks everywhere: channels past dim
    in a block, B/C groups a block splits, sequences ending mid-tile and mid-chunk. (The Mamba-1 forward's
    unmasked B/C loads once read groups past the buffer for a block's channels past dim: a GPU may fault
    there, and the interpreter crashed now and then.)"""
    tc = benchmark_module("triton_counts")
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    batch, dim, seqlen, dstate = 2, 3, 13, 5
    bf16 = torch.bfloat16
    scan = (randn(batch, dim, seqlen, dtype=bf16), randn(batch, dim, seqlen, dtype=bf16), -torch.rand(dim, dstate),
            randn(batch, dim, dstate, seqlen, dtype=bf16), randn(batch, dim, dstate, seqlen, dtype=bf16), randn(dim),
            randn(batch, dim, seqlen, dtype=bf16), randn(dim), randn(batch, dim, dstate), True)
    ssd = tc.ssd_inputs(2, 45, 4, 16, 2, 8, 16, bf16)
    for family, fwd_args in (("scan", scan), ("ssd", ssd)):
        for kernel, grid, args, meta in tc.recorded(family, fwd_args):
            with tc._Counter() as counter:
                kernel[grid](*args, **meta)
            stray = _outside_buffers(counter.read + counter.written, args)
            assert stray == 0, f"{family}: {tc.launch_name(kernel, meta)} touched {stray} elements outside its buffers"


@needs_interpreter
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_triton_opcheck(case):
    fwd_args = _fwd_args(case)
    fwd = torch.ops.ssmops.selective_scan_fwd_triton.default
    bwd = torch.ops.ssmops.selective_scan_bwd_triton.default
    out, x, out_z, last = fwd(*fwd_args)
    bwd_args = fwd_args[:9] + (torch.randn_like(out), x, torch.randn_like(last), fwd_args[9])
    if case == OPCHECK_CASES[0]:  # with its autograd registration, whichever optionals are present
        fwd_args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in fwd_args)
    torch.library.opcheck(fwd, fwd_args)
    torch.library.opcheck(bwd, bwd_args, test_utils=BACKWARD_OPCHECKS)


@needs_interpreter
def test_triton_ops_match_main_ops_and_schemas():
    from ssmops.ops import SCHEMAS

    for name in ("selective_scan_fwd", "selective_scan_bwd", "ssd_scan_fwd", "ssd_scan_bwd", "causal_conv1d_fwd",
                 "causal_conv1d_bwd"):  # (decoding: opcheck)
        schema = SCHEMAS[name]
        # (triton_op infers its schema from type hints: an int argument becomes SymInt)
        triton_schema = str(getattr(torch.ops.ssmops, f"{name}_triton").default._schema).replace("SymInt ", "int ")
        # same arguments; only the (unnamed) returns differ in spelling
        assert triton_schema.split(") -> ")[0] == f"ssmops::{schema}".replace(name, f"{name}_triton").split(") -> ")[0]
    fwd_args = _fwd_args(Case(B="g2", C="const", initial_state=True))
    with ssmops.use_backend("default"):
        expected = torch.ops.ssmops.selective_scan_fwd(*fwd_args)
    got = torch.ops.ssmops.selective_scan_fwd_triton(*fwd_args)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_triton_is_the_gpu_kernel_of_the_main_ops():
    """Eager calls of the main ops on CUDA (ROCm) or XPU tensors dispatch to the Triton launchers."""
    for op in ("ssmops::selective_scan_fwd", "ssmops::selective_scan_bwd", "ssmops::selective_state_update",
               "ssmops::multihead_state_update", "ssmops::ssd_scan_fwd", "ssmops::ssd_scan_bwd"):
        for key in ("CUDA", "XPU"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, key), (op, key)
        # CPU keeps its own kernel (the C++ library or default), not Triton
    from ssmops._registry import operator_for

    for name in ("selective_scan_fwd", "selective_state_update", "ssd_scan_fwd"):
        for device in ("meta", "cpu"):
            assert operator_for(name, torch.empty(1, device=device)) is getattr(torch.ops.ssmops, name).default


@needs_interpreter
def test_triton_backward_through_autograd_matches_reference():
    """The Triton forward op's own autograd (the path selective_scan_fn takes on GPUs)."""
    case = Case(B="g2", C="g2", initial_state=True)
    kw = make_inputs(case)
    y_ref, last_ref, g_ref = run_scan_with_grads(ssmops.selective_scan_ref, kw)

    def scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False, initial_state=None):
        out, _, out_z, last = torch.ops.ssmops.selective_scan_fwd_triton(
            u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus)
        return out_z, last

    y, last, grads = run_scan_with_grads(scan, kw)
    assert_close(y, y_ref, TOLERANCES[torch.float32], "out")
    for name, g in grads.items():
        assert_close(g, g_ref[name], TOLERANCES[torch.float32], f"d{name}")


@pytest.mark.parametrize("atomic, reduce, warp_rows, deterministic", [
    (True, 1, True, False), (True, 4, True, False), (False, 1, True, False), (False, 1, False, False),
    (True, 1, True, True)], ids=["atomic", "atomic-after-4-channels", "rows", "rows-of-programs", "deterministic"])
@pytest.mark.parametrize("bc", ["var", "g4"])
@needs_interpreter
def test_triton_variable_dB_dC_summed_over_channels(bc, atomic, reduce, warp_rows, deterministic, monkeypatch):
    """Variable dB/dC are summed over a group's channels: with BACKWARD_ATOMIC, added atomically per channel or
    after a sum over 4 channels in the program (BACKWARD_REDUCE); without it (the default), and always under
    torch.use_deterministic_algorithms(True), summed over a warp's 32 channels (BACKWARD_WARP_ROWS) or a
    program's channels of a group into rows of their own, which are then summed in a fixed order: the same bits
    on every run. B and C shared by all 128 channels (two programs of 64: four rows, or two, a batch row to sum),
    or by groups of 32 (two groups a program)."""
    from ssmops.ops.selective_scan import triton as scan_triton

    monkeypatch.setattr(scan_triton, "BACKWARD_WARPS", 2)  # (blocks of 64 channels)
    monkeypatch.setattr(scan_triton, "BACKWARD_ATOMIC", atomic)
    monkeypatch.setattr(scan_triton, "BACKWARD_REDUCE", reduce)
    monkeypatch.setattr(scan_triton, "BACKWARD_WARP_ROWS", warp_rows)
    case = Case(batch=2, dim=128, seqlen=9, dstate=4, B=bc, C=bc, initial_state=True)
    kw = make_inputs(case)
    _, _, g_ref = run_scan_with_grads(ssmops.selective_scan_ref, kw)
    torch.use_deterministic_algorithms(deterministic)
    try:
        with ssmops.use_backend("triton"):
            first = run_scan_with_grads(ssmops.selective_scan_fn, kw)[2]
            fixed_order = deterministic or not atomic
            second = run_scan_with_grads(ssmops.selective_scan_fn, kw)[2] if fixed_order else None
    finally:
        torch.use_deterministic_algorithms(False)
    for name in first:
        assert_close(first[name], g_ref[name], TOLERANCES[torch.float32], f"d{name}")
        if fixed_order:
            assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("case, segment", [
    (Case(batch=1, dim=5, seqlen=300, dstate=20, B="g5", C="g5", initial_state=True), 256),
    pytest.param(Case(batch=1, dim=3, seqlen=600, dstate=4, B="const", C="var", z=False, dtype=torch.bfloat16), 512,
                 marks=pytest.mark.slow),
    pytest.param(Case(batch=1, dim=2, seqlen=2100, dstate=3), 256, marks=pytest.mark.slow),
], ids=["2-segments-2-state-tiles", "2-segments-bf16", "9-segments-2-chunks"])
@pytest.mark.skipif(not TRITON_AVAILABLE or not (interpreting() or HAS_CUDA),
                    reason="runs on CUDA, or under TRITON_INTERPRET=1")
def test_triton_forward_in_time_segments(case, segment):
    """FORWARD_SEGMENT: the sequence walked in segments side by side (a pass for the states where each ends from
    zero, then each from the states the earlier ones carry to it) gives what one walk gives: out, out_z,
    mamba_ssm's x at each 2048-step chunk's end (the third case has two), and the last state; with the initial
    state (which the second segment's start decays), grouped and shared B/C, 20 states (two tiles of 16,
    padded), and a last segment shorter than the others."""
    from ssmops.ops.selective_scan import triton as scan_triton

    args = _on_kernel_device(_fwd_args(case))
    whole = scan_triton.selective_scan_fwd(*args, scan_triton.TUNER.defaults() | {"FORWARD_SEGMENT": 0})
    cut = scan_triton.selective_scan_fwd(*args, scan_triton.TUNER.defaults() | {"FORWARD_SEGMENT": segment})
    tol = TOLERANCES[case.dtype]
    for name, got, want in zip(("out", "x", "out_z", "last"), cut, whole):
        if name != "out_z" or case.z:
            assert_close(got.float(), want.float(), tol, name)


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
def test_triton_forward_segment_must_divide_a_chunk():
    """A FORWARD_SEGMENT set outside the tuning space that would cut a 2048-step chunk of mamba_ssm's x across
    two programs is refused before any launch, naming the knob."""
    from ssmops.ops.selective_scan import triton as scan_triton

    with pytest.raises(ValueError, match="FORWARD_SEGMENT must divide 2048"):
        scan_triton.selective_scan_fwd(*_fwd_args(Case()), scan_triton.TUNER.defaults() | {"FORWARD_SEGMENT": 300})


@needs_interpreter
@pytest.mark.parametrize("dim, dtype", [(128, torch.float32), (66, torch.bfloat16)], ids=["shared", "split"])
def test_triton_blocks_of_channels(dim, dtype, monkeypatch):
    """The forward and the backward over several programs' blocks of channels (64 a program here): B/C
    groups of 64 channels that each block loads once a step for all its channels ("shared"), and groups
    of 33 that split blocks, the last block 2 channels of 64 ("split"); a sequence that ends inside a
    tile; the backward's walk over several checkpoints (BACKWARD_SEGMENT tiles apart)."""
    from ssmops.ops.selective_scan import triton as scan_triton

    monkeypatch.setattr(scan_triton, "FORWARD_WARPS", 2)
    monkeypatch.setattr(scan_triton, "BACKWARD_WARPS", 2)
    case = Case(batch=2, dim=dim, seqlen=37, dstate=4, dtype=dtype, B="g2", C="g2", initial_state=True)
    kw, args = make_inputs(case), _fwd_args(case)
    knobs = scan_triton.TUNER.defaults()
    assert scan_triton._forward_config(dim, 4, kw["u"].element_size(), knobs)["BLOCK_D"] == 64
    assert scan_triton._backward_config(dim, 4, kw["u"].element_size(), True, knobs)["BLOCK_D"] == 64
    out, x, out_z, last = scan_triton.selective_scan_fwd(*args)
    y_ref, last_ref, g_ref = run_scan_with_grads(ssmops.selective_scan_ref, kw)
    assert_close(out_z, y_ref, TOLERANCES[dtype], "out")
    assert_close(last, last_ref, TOLERANCES[torch.float32], "last_state")
    with ssmops.use_backend("default"):
        x_ref = torch.ops.ssmops.selective_scan_fwd(*args)[1]
    assert_close(x, x_ref, TOLERANCES[torch.float32], "scan_intermediates")
    with ssmops.use_backend("triton"):
        grads = run_scan_with_grads(ssmops.selective_scan_fn, kw)[2]
    for name in grads:
        assert_close(grads[name], g_ref[name], TOLERANCES[dtype], f"d{name}")


def _ssd_args(batch=2, seqlen=37, nheads=4, headdim=8, ngroups=2, dstate=16, chunk=16, dtype=torch.float32,
              seq_idx=False, varlen=False, seed=0) -> tuple:
    """Arguments of `ssmops::ssd_scan_fwd` with every optional input (D per channel, z, dt_bias,
    initial states, softplus, a dt_limit), and seq_idx / cu_seqlens when asked (varlen: batch 1)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    ids = cu = None
    if seq_idx or varlen:
        starts = torch.tensor([0, seqlen // 3, seqlen // 2])
        ids = (torch.searchsorted(starts, torch.arange(seqlen), right=True) - 1).to(torch.int32).expand(batch, -1)
        ids = ids.contiguous()
        cu = torch.cat([starts, torch.tensor([seqlen])]).to(torch.int32) if varlen else None
    return (randn(batch, seqlen, nheads, headdim), randn(batch, seqlen, nheads) - 1.0,
            -torch.rand(nheads, generator=g) - 0.1, randn(batch, seqlen, ngroups, dstate),
            randn(batch, seqlen, ngroups, dstate), randn(nheads, headdim),
            randn(batch, seqlen, nheads, headdim), randn(nheads, dt=torch.float32) * 0.1,
            randn(batch, nheads, headdim, dstate, dt=torch.float32), ids, cu, chunk, True, [0.01, 5.0])


def _ssd_bwd_args(fwd_args: tuple, fwd=None) -> tuple:
    """The backward's arguments as autograd passes them: the forward's outputs (the output before the gate kept)
    and cotangents of every output."""
    out, final, states, varlen, ungated = (fwd or torch.ops.ssmops.ssd_scan_fwd_triton)(*fwd_args, True)
    g = torch.Generator().manual_seed(1)

    def randn(like: torch.Tensor) -> torch.Tensor:  # (drawn on the CPU, for the same values on every device)
        return torch.randn(like.shape, generator=g).to(like.device, like.dtype)

    return (*fwd_args, randn(out), states, randn(final), randn(varlen) if fwd_args[10] is not None else None,
            ungated)


@needs_interpreter
def test_triton_ssd_opcheck():
    fwd_args = _ssd_args(batch=1, seqlen=20, nheads=2, headdim=4, ngroups=1, dstate=4, varlen=True)
    torch.library.opcheck(torch.ops.ssmops.ssd_scan_fwd_triton.default, (*fwd_args, True))
    torch.library.opcheck(torch.ops.ssmops.ssd_scan_bwd_triton.default, _ssd_bwd_args(fwd_args),
                          test_utils=BACKWARD_OPCHECKS)


@needs_interpreter
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "per-channel"])
def test_triton_multihead_state_update_opcheck_and_strided_state(tied):
    """The multi-head step writes through to the caller's (strided) cache rows, and is a well-formed operator."""
    from ops.test_state_update import multihead_inputs

    kw = multihead_inputs(tied=tied, cache=4, state_dtype=torch.bfloat16, D="head" if tied else "channel")
    expected_state = kw["state"].clone()
    with ssmops.use_backend("default"):
        expected = ssmops.selective_state_update(**{**kw, "state": expected_state})
    buffer = torch.zeros(*kw["state"].shape[:3], 2 * kw["state"].shape[3], dtype=kw["state"].dtype)
    state = buffer[..., ::2]
    state.copy_(kw["state"])
    with ssmops.use_backend("triton"):
        y = ssmops.selective_state_update(**{**kw, "state": state})
    assert_close(y, expected, TOLERANCES[torch.float32], "y")
    assert_close(state.float(), expected_state.float(), TOLERANCES[torch.bfloat16], "state")
    args = [kw[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices")]
    torch.library.opcheck(torch.ops.ssmops.multihead_state_update_triton.default, (*args, kw["dt_softplus"]))


@needs_interpreter
def test_triton_ssd_backward_is_deterministic():
    """No atomics: every output element is written by one program and partial sums (over a group's
    heads, over chunks) are added in a fixed order, so two runs give the same bits, in either mode."""
    bwd_args = _ssd_bwd_args(_ssd_args(batch=1, seqlen=20, seq_idx=True))  # 2 chunks, 2 heads a group
    bwd = torch.ops.ssmops.ssd_scan_bwd_triton
    first = bwd(*bwd_args)
    torch.use_deterministic_algorithms(True)
    try:
        second = bwd(*bwd_args)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _tuning_values():
    from ssmops.ops.selective_scan import triton as scan_triton
    from ssmops.ops.ssd import triton as ssd_triton

    for family, module in (("scan", scan_triton), ("ssd", ssd_triton)):
        defaults = module.TUNER.defaults()
        for knob, values in module.TUNING_SPACE.items():
            for value in values:
                # (the interpreter runs a program's block as one: warps, stages and registers change nothing there)
                if value != defaults[knob] and not (interpreting() and knob.endswith(("WARPS", "STAGES", "REGISTERS"))):
                    yield pytest.param(family, knob, value, id=f"{family}-{knob}-{value}")


@pytest.mark.skipif(not TRITON_AVAILABLE or not (interpreting() or HAS_CUDA),
                    reason="runs on CUDA, or under TRITON_INTERPRET=1")
@pytest.mark.parametrize("chunk", [64, 40])
def test_triton_ssd_processed_dt_carries_each_blocks_log_decay_sums(chunk):
    """ssd_dt_kernel writes each head's row of dt after dt_bias, softplus and the clamp, and behind it the sums
    of dt A over each block of the output kernel's tokens (a chunk's, the last block of a chunk of 40 tokens
    short) up to each token: what the SSD's loops load for the log decays they scanned before."""
    from ssmops.ops.ssd import triton as ssd_triton

    args = _on_kernel_device(_ssd_args(batch=2, seqlen=150, nheads=3, headdim=8, ngroups=1, chunk=chunk))
    dt, A, dt_bias, dt_limit = args[1], args[2], args[7], args[13]
    knobs = dict(ssd_triton.TUNER.defaults(), SCAN_BLOCK_T=16)
    run = ssd_triton._Launch(*args).use_knobs(knobs).dt_processed()
    block = run.block_sums
    assert block == 16
    rows = run.inputs["dt"].view(2, 3, 2, 150).cpu()
    expected_dt = torch.nn.functional.softplus(dt.float().cpu() + dt_bias.cpu()).clamp(*dt_limit).permute(0, 2, 1)
    torch.testing.assert_close(rows[:, :, 0], expected_dt)
    a = expected_dt * A.cpu()[None, :, None]
    t = torch.arange(150)
    block_of = t // chunk * chunk + t % chunk // block * block  # each token's block's first token
    expected_sums = torch.stack([torch.cat([torch.cumsum(a[b, h][block_of == first], 0) for first in block_of.unique()])
                                 for b in range(2) for h in range(3)]).view(2, 3, 150)
    torch.testing.assert_close(rows[:, :, 1], expected_sums)


_DEFAULTS_RESULTS = {}  # family -> its run with the default knobs (one per process)


@pytest.mark.slow  # ~70 s interpreted (make test-triton-interpreter), natively in make gpu-check
@pytest.mark.skipif(not TRITON_AVAILABLE or not (interpreting() or HAS_CUDA),
                    reason="runs on CUDA, or under TRITON_INTERPRET=1")
@pytest.mark.parametrize("family, knob, value", list(_tuning_values()) if TRITON_INSTALLED else [])
def test_triton_every_tuning_value_gives_the_defaults_results(family, knob, value):
    """Whatever SSMOPS_AUTOTUNE=1 may choose computes the same scan: each value of each knob of the scans'
    TUNING_SPACE, the others at their defaults, forward and backward, at sizes that leave partial tiles (a head
    size of 40, 48 states, 70 tokens in chunks of 64 with seq_idx, 8 heads a group; 64 channels in 2 groups of B
    and C, 44 steps: rows of 16-byte multiples, which the backward reads in vectors, in 11 read tiles of 4)."""
    from ssmops.ops.selective_scan import triton as scan_triton
    from ssmops.ops.ssd import triton as ssd_triton

    module = scan_triton if family == "scan" else ssd_triton
    knobs = module.TUNER.defaults()
    if family == "scan":
        fwd_args = _on_kernel_device(_fwd_args(Case(batch=1, dim=64, seqlen=44, dstate=16, B="g2", C="g2")))

        def run(knobs: dict) -> tuple:
            out, x, out_z, last = module.selective_scan_fwd(*fwd_args, knobs)
            grads = module.selective_scan_bwd(*fwd_args[:9], torch.ones_like(out), x, torch.ones_like(last),
                                              fwd_args[9], knobs)
            return (out, out_z, last, *grads)
    else:
        fwd_args = _on_kernel_device(_ssd_args(batch=1, seqlen=70, nheads=8, headdim=40, ngroups=1, dstate=48,
                                               chunk=64, seq_idx=True))
        bwd_args = _ssd_bwd_args(fwd_args)[14:]

        def run(knobs: dict) -> tuple:
            return (*module.ssd_fwd(*fwd_args, True, knobs), *module.ssd_bwd(*fwd_args, *bwd_args, knobs))

    if family not in _DEFAULTS_RESULTS:
        _DEFAULTS_RESULTS[family] = run(knobs)
    expected = _DEFAULTS_RESULTS[family]
    got = run(dict(knobs, **{knob: value}))
    for i, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"output {i}: {m}")


def _tuning_on_a_clock(tuner, values: dict, tmp_path, monkeypatch) -> list:
    """SSMOPS_AUTOTUNE=1 with choices kept in tmp_path, the tuner's space cut to `values` (a knob of each phase
    with one other value; the others' defaults alone, passed over), a clock on which each candidate is faster
    than the last, and every launch recorded as (kernel name, grid, meta) into the list returned."""
    from ssmops.ops import _tuning, _triton

    defaults = tuner.defaults()
    monkeypatch.setattr(tuner, "space", {name: (defaults[name],) for name in tuner.space} | values)
    monkeypatch.setenv(_tuning.AUTOTUNE_ENV, "1")
    monkeypatch.setenv(_tuning.CACHE_ENV, str(tmp_path / "tuning.json"))
    clock = itertools.count()
    monkeypatch.setattr(_tuning, "measure", lambda run, device: (run(), 0.5 ** next(clock))[1])
    launches, launch = [], _triton.launch
    monkeypatch.setattr(_triton, "launch", lambda kernel, grid, kernel_args, meta: (
        launches.append((kernel.fn.__name__, grid, meta)), launch(kernel, grid, kernel_args, meta)))
    return launches


@needs_interpreter
def test_triton_scan_tuned_knobs_are_what_the_launches_take(tmp_path, monkeypatch):
    """SSMOPS_AUTOTUNE=1 on the selective scan (ops/_tuning.py; the SSD's test below says more): each phase tunes
    its knobs in its own call and launches with the faster, with the defaults' results up to rounding."""
    from ssmops.ops import _tuning
    from ssmops.ops.selective_scan import triton as scan_triton

    fwd_args = _fwd_args(Case(batch=1, dim=8, seqlen=20, dstate=16, B="var", C="var"))
    fwd, bwd = torch.ops.ssmops.selective_scan_fwd_triton, torch.ops.ssmops.selective_scan_bwd_triton

    def both() -> tuple:
        out, x, out_z, last = fwd(*fwd_args)
        return (out, out_z, last, *bwd(*fwd_args[:9], torch.ones_like(out), x, torch.ones_like(last), fwd_args[9]))

    expected = both()
    launches = _tuning_on_a_clock(scan_triton.TUNER, {"FORWARD_TILE": (128, 32), "BACKWARD_SEGMENT": (1, 2)},
                                  tmp_path, monkeypatch)
    for _ in range(2):  # tuned in the first call, read in the second
        launches.clear()
        got = both()
        metas = {name: meta for name, _, meta in launches}  # (each kernel's last: the call's own, after the candidates)
        # 8 steps of 16 states a tile by default, 2 with FORWARD_TILE 32; 2 read tiles between checkpoints
        assert metas["selective_scan_fwd_kernel"]["BLOCK_T"] == 2
        assert metas["selective_scan_bwd_kernel"]["SEGMENT"] == 2
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    saved = json.loads((tmp_path / "tuning.json").read_text())[_tuning.device_name(fwd_args[0].device)]
    assert [entry["forward"]["FORWARD_TILE"] for entry in saved["selective_scan"].values()] == [32]
    assert [entry["backward"]["BACKWARD_SEGMENT"] for entry in saved["selective_scan"].values()] == [2]


@needs_interpreter
def test_triton_ssd_tuned_knobs_are_what_the_launches_take(tmp_path, monkeypatch):
    """SSMOPS_AUTOTUNE=1 (ops/_tuning.py): the forward and the backward each time their phase's knobs on the
    call's own inputs, then launch with the faster (here a patched clock finds each knob's other value faster),
    in the same call and the next, with the defaults' results up to rounding; the choice is in the file."""
    from ssmops.ops import _tuning
    from ssmops.ops.ssd import triton as ssd_triton

    args = _ssd_args(batch=1, seqlen=20)  # 2 heads a group
    bwd = torch.ops.ssmops.ssd_scan_bwd_triton
    expected = bwd(*_ssd_bwd_args(args))
    defaults = ssd_triton.TUNER.defaults()
    launches = _tuning_on_a_clock(ssd_triton.TUNER, {"SCAN_WARPS": (4, 8), "GROUP_HEADS": (16, 1)}, tmp_path,
                                  monkeypatch)
    for _ in range(2):  # tuned in the first call, read in the second
        launches.clear()
        grads = bwd(*_ssd_bwd_args(args))
        warps = {name: meta["num_warps"] for name, _, meta in launches if name == "ssd_chunk_scan_kernel"}
        assert warps == {"ssd_chunk_scan_kernel": 8}  # (the forward's, in _ssd_bwd_args: the backward reads its y)
        runs = [grid[1] for name, grid, _ in launches if name == "ssd_bwd_dcb_kernel"]
        assert runs[-1] == 1 * 2 * 2  # batch x groups x runs of GROUP_HEADS 1 in a group's 2 heads
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    saved = json.loads((tmp_path / "tuning.json").read_text())[_tuning.device_name(args[0].device)]["ssd"]
    assert list(saved.values()) == [{"forward": {name: (8 if name == "SCAN_WARPS" else defaults[name])
                                                 for name in ssd_triton.FORWARD_KNOBS},
                                     "backward": {name: (1 if name == "GROUP_HEADS" else defaults[name])
                                                  for name in ssd_triton.BACKWARD_KNOBS}}]


if TRITON_INSTALLED:  # (a JIT function's names are the module's globals)
    import triton
    import triton.language as tl

    from ssmops.ops.ssd.triton_kernels import _pair

    @triton.jit
    def _block_pairs_kernel(out_ptr):
        i, j = _pair(tl.program_id(0))
        tl.store(out_ptr + 2 * tl.program_id(0), i)
        tl.store(out_ptr + 2 * tl.program_id(0) + 1, j)

    from ssmops.ops._triton import exp, positive_reciprocal, sigmoid, softplus
    from ssmops.ops.selective_scan.triton_kernels import _group_sums

    @triton.jit
    def _math_kernel(x_ptr, out_ptr, N: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, N))
        rows = out_ptr + tl.arange(0, N)
        tl.store(rows, exp(x))
        tl.store(rows + N, sigmoid(x))
        tl.store(rows + 2 * N, softplus(x))
        tl.store(rows + 3 * N, positive_reciprocal(tl.abs(x)))

    @triton.jit
    def _group_sums_kernel(x_ptr, out_ptr, REDUCE: tl.constexpr, BLOCK_D: tl.constexpr, STATES: tl.constexpr,
                           WIDTH: tl.constexpr):
        d = tl.arange(0, BLOCK_D)
        sums = _group_sums(tl.load(x_ptr + d[:, None] * STATES + tl.arange(0, STATES)[None, :]), REDUCE, BLOCK_D,
                           STATES)
        tl.store(out_ptr + d[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :], sums)


@needs_interpreter
def test_triton_ssd_block_pairs_enumerate_the_lower_triangle():
    """ssd_bwd_dcb_kernel's program p takes the p-th block pair (i, j), j <= i, from a float square root with a
    correction either way: every pair once, in order, up to 32 blocks a chunk (528 pairs)."""
    expected = [(i, j) for i in range(32) for j in range(i + 1)]
    out = torch.full((len(expected), 2), -1, dtype=torch.int32)
    _block_pairs_kernel[(len(expected),)](out)
    assert [tuple(row) for row in out.tolist()] == expected


@needs_interpreter
def test_triton_math_helpers_match_torch():
    """The kernels' exp, sigmoid, softplus (torch's, threshold 20) and 1 / |x|, written for fewer instructions than
    Triton's own (ex2 and rsqrt, a series for log1p), against float64 over float32's range: within a few rounding
    errors of float32 (and the exponent's rounding, ~|x| 2^-24 relative), and exact at the ends (0, +-inf, NaN) and
    past softplus' threshold. (Triton's ex2 and rsqrt on a GPU add 2^-22 relative.)"""
    x = torch.cat([torch.linspace(-100.0, 100.0, 4093), torch.tensor([0.0, 20.0, float("inf"), -float("inf"),
                                                                     float("nan")])])
    n = triton.next_power_of_2(x.numel())
    padded = torch.zeros(n)
    padded[:x.numel()] = x
    out = torch.empty(4 * n)
    _math_kernel[(1,)](padded, out, n)
    exp_, sigmoid_, softplus_, reciprocal_ = out.view(4, n)[:, :x.numel()]
    x64 = x.double()
    for name, got, want in [("exp", exp_, x64.exp()), ("sigmoid", sigmoid_, torch.sigmoid(x64)),
                            ("softplus", softplus_, torch.nn.functional.softplus(x64)),
                            ("reciprocal", reciprocal_, 1 / x64.abs())]:
        want = want.float().double()  # (float32's range: what float64 gives beyond it, float32 cannot hold)
        normal = want.abs() >= torch.finfo(torch.float32).tiny
        checked = normal & want.isfinite()
        error = (got.double() - want).abs() / want.abs()
        assert (error <= 3e-7 + x64.abs() * 2**-23)[checked].all(), (name, error[checked].max())
        ends = ~want.isfinite() | (want == 0)
        assert torch.equal(got[ends].isnan(), want[ends].isnan()), name
        assert torch.equal(got[ends & ~want.isnan()], want[ends & ~want.isnan()].float()), name
    assert torch.equal(softplus_[x > 20], x[x > 20])
    assert sigmoid_[x == 0].item() == pytest.approx(0.5, rel=2**-22)


@needs_interpreter
@pytest.mark.parametrize("reduce", [2, 4, 8, 16, 32])
@pytest.mark.parametrize("states", [1, 2, 4, 8, 16])
def test_triton_scan_group_sums_leave_each_sum_in_its_channel(reduce, states):
    """The Mamba-1 backward's sums of dB and dC over groups of `reduce` consecutive channels (_group_sums): channel
    c holds max(states / reduce, 1) of its group's sums, those of the states from (c % reduce) // max(reduce /
    states, 1) times that, where _add_bc_grad stores them."""
    block_d, width, share = 64, max(states // reduce, 1), max(reduce // states, 1)
    x = torch.randn(block_d, states, generator=torch.Generator().manual_seed(reduce * states))
    out = torch.full((block_d, width), float("nan"))
    _group_sums_kernel[(1,)](x, out, reduce, block_d, states, width)
    sums = x.view(block_d // reduce, reduce, states).sum(1)
    first = torch.arange(block_d) % reduce // share * width
    expected = torch.stack([sums[c // reduce, first[c]:first[c] + width] for c in range(block_d)])
    torch.testing.assert_close(out, expected)


def _check_state_update_against_default(kw: dict, state, step) -> None:
    """step(**kw) with `state` (holding kw["state"]'s values) updated in place, against the
    default backend (tests/test_models.py checks that against one step of the scan)."""
    expected_state = kw["state"].clone()
    with ssmops.use_backend("default"):
        expected = ssmops.selective_state_update(**{**kw, "state": expected_state})
    y = step(**{**kw, "state": state})
    assert_close(y, expected, TOLERANCES[kw["x"].dtype], "y")
    assert_close(state, expected_state, TOLERANCES[torch.float32], "state")


@needs_interpreter
@pytest.mark.parametrize("case", STATE_UPDATE_CASES, ids=state_update_case_id)
def test_triton_state_update_matches_default(case):
    kw = state_update_inputs(batch=3, dim=192, **case)  # two 128-channel tiles at dstate 5, the second half full
    buffer = torch.zeros(*kw["state"].shape[:2], 2 * kw["state"].shape[2])
    state = buffer[..., ::2]  # strided: the kernel writes through to the caller's memory
    state.copy_(kw["state"])
    _check_state_update_against_default(kw, state, torch.ops.ssmops.selective_state_update_triton)
    torch.library.opcheck(torch.ops.ssmops.selective_state_update_triton.default,
                          tuple({**kw, "state": kw["state"].clone()}.values()))


@pytest.mark.slow  # interpreted kernels in a fresh interpreter
@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@needs_triton_39_interpreter
def test_triton_env_selector_routes_cpu_tensors_to_triton():
    """SSMOPS_BACKEND=triton registers the Triton launchers as the CPU kernels, for the process."""
    code = (
        "import torch, ssmops, sys; sys.path.insert(0, 'tests')\n"
        "from conftest import Case, make_inputs\n"
        "assert torch._C._dispatch_has_kernel_for_dispatch_key('ssmops::selective_scan_fwd', 'CPU')\n"
        "kw = make_inputs(Case(B='g2', C='g2'))\n"
        "y = ssmops.selective_scan_fn(**kw)\n"
        "y_ref = ssmops.selective_scan_ref(**kw)\n"
        "torch.testing.assert_close(y, y_ref, rtol=2e-4, atol=2e-4)\n"
        "print(ssmops.available_backends())\n"
    )
    env = {**os.environ, "SSMOPS_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'cpu': 'not loaded because SSMOPS_BACKEND=triton'" in proc.stdout
    env.pop("TRITON_INTERPRET")
    # without the interpreter CPU tensors cannot run: on a machine without a GPU ssmops says so at import, on
    # one with a GPU at the call, naming the device
    proc = subprocess.run([sys.executable, "-c", code if HAS_CUDA else "import ssmops"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-3000:]
    if HAS_CUDA:
        assert "ValueError" in proc.stderr and "u is on cpu" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="the interpreter runs CPU tensors")
def test_triton_launchers_reject_cpu_tensors_with_the_device_and_the_ways_out():
    """What a GPU machine does with CPU tensors sent to the Triton kernels (use_backend("triton"), or
    SSMOPS_BACKEND=triton): a clear error before any launch, not one from inside wrap_triton."""
    from ssmops.ops.selective_scan.triton import selective_scan_fwd

    with pytest.raises(ValueError, match=r"u is on cpu.*cpu or default backend.*TRITON_INTERPRET=1"):
        selective_scan_fwd(*_fwd_args(Case()))


# --- compiled for GPUs ahead of time (no GPU needed) ------------------------------------
#
# The interpreter runs the kernels' Python, not Triton's compiler: a construct the compiler
# rejects, or tiles that spill registers, would first show on a GPU. Triton compiles for a
# GPU target without one, so these tests compile the exact launches the launchers make
# (their arguments' dtypes, the tile sizes and warps `_config` picks) for NVIDIA H100 and
# A100 and AMD MI300, and read the register use and spills off the compiled kernels.

COMPILE_TARGETS = ("sm90", "sm80", "gfx942")  # H100, A100, MI300
# (the length of the first case fills the 2048-step tile that Mamba-sized inputs use)
COMPILE_CASES = [
    Case(batch=1, dim=64, seqlen=4096, dstate=16, dtype=torch.bfloat16, B="var", C="var", initial_state=True),
    Case(batch=1, dim=64, seqlen=4096, dstate=64, dtype=torch.float16, B="g2", C="g2"),
    Case(batch=1, dim=64, seqlen=3001, dstate=16, dtype=torch.bfloat16, B="var", C="var"),
    Case(batch=1, dim=8, seqlen=40, dstate=5, B="const", C="const", D=False, z=False, delta_bias=False,
         softplus=False),
]


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
def test_triton_scan_forward_asks_ptxas_for_its_registers_unless_segmented():
    """FORWARD_REGISTERS reaches the one-walk forward's launch over tiles of 16 states as maxnreg: left to choose,
    ptxas put the B/C rows' loads less than a step ahead of their use (docs/limits.md). The segmented forward's
    passes and smaller state tiles keep ptxas's choice, which holds four to six of their programs an SM; 0 leaves
    every launch to it."""
    aot = benchmark_module("triton_aot")
    args = _fwd_args(COMPILE_CASES[0])
    assert [meta.get("maxnreg") for _, _, meta in aot.record_scan(args)] == [255, None]
    assert [meta.get("maxnreg") for _, _, meta in aot.record_scan(args, FORWARD_SEGMENT=512)] == [None, None, None]
    assert [meta.get("maxnreg") for _, _, meta in aot.record_scan(args, FORWARD_REGISTERS=0)] == [None, None]
    assert [meta.get("maxnreg") for _, _, meta in aot.record_scan(_fwd_args(COMPILE_CASES[-1]))] == [None, None]


# Every case and both ways of summing variable dB/dC (BACKWARD_ATOMIC) for sm_90, the target the kernels are tuned
# for; the other targets compile the default launches of the benchmark's case and of the one without optionals
# (the atomic backward differs in its sum over a block's channels only, the others in their sizes, proven on
# sm_90): each compile of a backward takes ptxas ~12 s of make test's CPU with a cold cache, as CI has.
def _compile_params():
    for target in COMPILE_TARGETS:
        for i, case in enumerate(COMPILE_CASES):
            if target != "sm90" and 0 < i < len(COMPILE_CASES) - 1:
                continue
            for atomic in (False, True) if case.B != "const" and target == "sm90" else (False,):
                quick = target == "sm90" and i == 0 and not atomic
                marks = () if quick else (pytest.mark.slow,)
                yield pytest.param(target, case, atomic, marks=marks,
                                   id=f"{target}-{case}-{'atomic' if atomic else 'rows'}")


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="compiles the JIT kernels, which the interpreter replaces")
@pytest.mark.parametrize("target, case, atomic", list(_compile_params()))
def test_triton_kernels_compile_for_gpus_without_spilling(target, case, atomic):
    aot = benchmark_module("triton_aot")
    from ssmops.ops.state_update import triton as state_update_triton

    launches = aot.record_scan(_fwd_args(case), BACKWARD_ATOMIC=atomic)
    assert [k.__name__ for k, _, _ in launches] == ["selective_scan_fwd_kernel", "selective_scan_bwd_kernel"]
    assert launches[1][2]["BC_ATOMIC"] == (atomic and case.B != "const")
    groups = int(case.B[1:]) if case.B.startswith("g") else None
    with aot.recorded_launches() as step:  # the decoding step, for the same dtype and dstate
        state_update_triton.selective_state_update(**state_update_inputs(dim=case.dim, dstate=case.dstate,
                                                                         groups=groups, dtype=case.dtype))
    launches += step
    for kernel, args, meta in launches:
        compiled = aot.compile_launch(kernel, args, meta, target)
        usage = aot.resource_usage(compiled)
        print(kernel.__name__, target, meta.get("BLOCK_T"), meta["num_warps"], usage)
        limit = 0
        if kernel.__name__ in ("selective_scan_fwd_kernel", "selective_scan_bwd_kernel"):
            # the scans' walks take every register ptxas allows (the forward's next tile's loads in flight
            # and a tile's decays computed ahead; the backward's tile of states and decays) and park a few
            # of their addresses in local memory around their loops; inside each loop over time (a tile's
            # work: an innermost loop, or one with more code of its own than the loops nested in it, as the
            # backward's walk back; not the loop over state tiles, whose own code runs once a walk) at most 1
            # instruction in 100 touches local memory (the forward: none on sm_90, one load and one store of
            # ~900 instructions on sm_80 with 4 state tiles), 1 in 50 in the backward's walk back (addresses
            # it reloads: ~20 of ~1,950 instructions a tile at the benchmark's shape; 1 in 40 on sm_80, where
            # Triton 3.6's compile parks 87 of 3,591)
            limit = 512
            share = 100 if kernel.__name__ == "selective_scan_fwd_kernel" else 50 if target != "sm80" else 40
            if target.startswith("sm"):
                loops = aot.loop_nest(compiled)

                def nested(i: int) -> int:  # the instructions of the loops inside loop i
                    return sum(sum(other["own"].values()) + nested(j) for j, other in enumerate(loops)
                               if other["inside"] == i)

                for i, loop in enumerate(loops):
                    size = sum(loop["own"].values())
                    if size > nested(i):
                        own = loop["own"]
                        assert own["LDL"] + own["STL"] <= size // share, (kernel.__name__, own)
        assert usage["spills"] <= limit, (kernel.__name__, usage)


# mamba2-2.7b's layer (the benchmark's shape, but for batch and seqlen, which change no compiled code: the
# strides keep their divisibility by 16), with what Mamba2 passes (D per head, z, dt_bias, softplus,
# initial states); then packed sequences with varlen states, fp16, D per channel and a dt_limit.
SSD_COMPILE_CASES = {
    "mamba2-2.7b": dict(batch=1, seqlen=512, nheads=80, headdim=64, ngroups=1, dstate=128, chunk=256,
                        dtype=torch.bfloat16),
    "varlen": dict(batch=1, seqlen=300, nheads=8, headdim=64, ngroups=2, dstate=64, chunk=128, dtype=torch.float16,
                   varlen=True),
}


def _ssd_compile_args(name: str) -> tuple:
    args = _ssd_args(**SSD_COMPILE_CASES[name])
    if name == "mamba2-2.7b":  # D per head, no dt_limit
        args = args[:5] + (args[5][:, 0].float().contiguous(),) + args[6:13] + ([],)
    return args


def _ssd_compile_params():  # the varlen case for sm_90 only (see _compile_params)
    for target in COMPILE_TARGETS:
        for name in SSD_COMPILE_CASES if target == "sm90" else ["mamba2-2.7b"]:
            marks = () if (target, name) == ("sm90", "mamba2-2.7b") else (pytest.mark.slow,)
            yield pytest.param(target, name, marks=marks, id=f"{target}-{name}")


SSD_KERNELS = ["ssd_dt_kernel", "ssd_chunk_states_kernel", "ssd_state_passing_kernel", "ssd_cb_kernel",
               "ssd_chunk_scan_kernel", "ssd_dt_kernel", "ssd_cb_kernel", "ssd_gate_grad_kernel",
               "ssd_state_grads_kernel", "ssd_bwd_dx_kernel", "ssd_bwd_dcb_kernel", "ssd_bwd_group_kernel",
               "ssd_bwd_group_kernel", "ssd_bwd_ddt_kernel"]


# the kernels that may spill up to 208 bytes off sm_90's benchmark shape: the group kernel's dC launch, and the dX
# pass on sm_80 (mma.sync's operands in registers), whose end loads its five tiles at once for sm_90's sake (184
# bytes under Triton 3.6, at most 96 under 3.9)
SPILLING_OFF_THE_BENCHMARK = ("ssd_bwd_group_kernel", "ssd_bwd_dx_kernel")


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="compiles the JIT kernels, which the interpreter replaces")
@pytest.mark.parametrize("target, name", list(_ssd_compile_params()))
def test_triton_ssd_kernels_compile_for_gpus_without_spilling(target, name):
    """The SSD scan's forward and backward launches, and the multi-head decoding step's at the same
    sizes, compiled for a GPU: no register spills at the benchmark's shape on sm_90, the target the knobs are
    measured on, but for the group kernel's launches, on the 4 warps an H200 ran 6% faster a forward+backward
    than 8 all the same (the dC launch: 16 bytes there, 0 under Triton 3.6; up to 184 in the varlen case and 208 on
    sm_80, unmeasured), and the chunk states held to two programs an SM (8 bytes under Triton 3.6);
    elsewhere, and in the varlen case (seq_idx, fp16, per-channel D), a few: 24 bytes in sm_80's state pass of 128
    states, 24 in sm_90's dX pass on the 4 warps an H200 ran fastest at mamba2-2.7b's layer (32 under Triton 3.6,
    torch 2.11's, which the GPU machines run), 24 in its output kernel (0 under 3.6). On NVIDIA's,
    the output kernel takes at most 1024 / warps registers as Mamba2 calls it, so
    that two of its programs share an SM. At the benchmark's shape on sm_90 every tensor-core loop of the kernels
    with a pipeline (the knobs' stages above 1) is pipelined, its operands loaded a trip ahead by asynchronous
    copies: Triton pipelines innermost loops only, and the backward's loops over a group's heads, each holding a
    loop over token blocks, waited for their loads at every head (docs/limits.md). The output kernel and the dX
    pass issue their loop's first copies before any GEMM, and all their end's loads before its GEMMs."""
    aot = benchmark_module("triton_aot")

    from ssmops.ops.state_update import triton as state_update_triton

    args = _ssd_compile_args(name)
    launches = aot.record_ssd(args)
    expected = SSD_KERNELS[:5] + (["ssd_varlen_states_kernel"] if args[10] is not None else []) + SSD_KERNELS[5:]
    assert [k.__name__ for k, _, _ in launches] == expected
    x, dt, A, B = args[:4]
    with aot.recorded_launches() as step:  # the decoding step: tied dt/A/dt_bias (Mamba2's), a cache in x's dtype
        state_update_triton.multihead_state_update(
            torch.zeros(3, *x.shape[2:], B.shape[-1], dtype=x.dtype), x[:, 0], dt[:, 0], A, B[:, 0], B[:, 0],
            args[5], x[:, 0], args[7], torch.tensor([2, 0], dtype=torch.int32)[: x.shape[0]], True)
    launches += step
    for kernel, kernel_args, meta in launches:
        compiled = aot.compile_launch(kernel, kernel_args, meta, target)
        usage = aot.resource_usage(compiled)
        print(kernel.__name__, target, meta["num_warps"], usage)
        if (target, name) == ("sm90", "mamba2-2.7b"):
            allowed = {"ssd_bwd_group_kernel": 208, "ssd_chunk_states_kernel": 8}.get(kernel.__name__, 0)
        else:
            allowed = 208 if kernel.__name__ in SPILLING_OFF_THE_BENCHMARK else 96
        assert usage["spills"] <= allowed, (kernel.__name__, usage)
        if (target, name) == ("sm90", "mamba2-2.7b") and meta.get("num_stages", 1) > 1:
            gemm_loops = [loop["own"] for loop in aot.loop_nest(compiled) if loop["own"]["HGMMA"]]
            assert gemm_loops and all(own["LDGSTS"] for own in gemm_loops), (kernel.__name__, gemm_loops)
        if kernel.__name__ == "ssd_chunk_scan_kernel" and target.startswith("sm") and name == "mamba2-2.7b":
            assert usage["regs"] * meta["num_warps"] <= 128 * 8, (meta, usage)
        if kernel.__name__ in ("ssd_chunk_scan_kernel", "ssd_bwd_dx_kernel") and (target, name) == ("sm90",
                                                                                                  "mamba2-2.7b"):
            # their loop's first copies wait for no GEMM, and what the end reads goes out in one latency, ahead
            # of its GEMMs (a GEMM before the loop, and loads after the end's GEMMs, were a latency each)
            ops = [aot.opcode(text) for _, text in aot.sass_instructions(compiled)]
            loop = aot.gemm_loop(compiled)
            end = ops[loop["end"] + 1:]
            assert "HGMMA" not in ops[:loop["start"]], kernel.__name__
            assert "LDG" not in end[end.index("HGMMA"):], kernel.__name__


def _recorded_launches_of_every_family() -> list:
    """(kernel, args, meta, input tensors) of the launches of every Triton operator, forward and backward,
    with every optional input and without (the decoding steps: with the state they update in place)."""
    aot = benchmark_module("triton_aot")
    from ssmops.ops.state_update import triton as state_update_triton
    from ops.test_causal_conv1d import COMPILE_CASES as CONV_CASES, _recorded_conv_launches
    from ops.test_state_update import multihead_inputs

    recorded = []
    for args, knobs in [(_fwd_args(Case(B="g2", C="g2", initial_state=True)), {}),
                        (_fwd_args(Case(B="var", C="const", D=False, z=False, delta_bias=False)),
                         dict(BACKWARD_ATOMIC=True)),
                        (_fwd_args(Case(seqlen=300, initial_state=True)), dict(FORWARD_SEGMENT=256))]:
        recorded += [(*launch, args) for launch in aot.record_scan(args, **knobs)]
    no_optionals = _ssd_args()[:5] + (None,) * 6 + (16, False, [])
    for args in [_ssd_args(seq_idx=True), _ssd_args(batch=1, varlen=True), no_optionals]:
        recorded += [(*launch, args) for launch in aot.record_ssd(args)]
    single, heads = state_update_inputs(groups=2), multihead_inputs(tied=False, D="channel", cache=4)
    with aot.recorded_launches() as launches:
        state_update_triton.selective_state_update(*single.values())
        state_update_triton.multihead_state_update(
            *(heads[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices")),
            heads["dt_softplus"])
    for launch, kw in zip(launches, (single, heads)):
        recorded.append((*launch, tuple(v for k, v in kw.items() if k != "state")))
    return recorded + [launch for case in CONV_CASES for launch in _recorded_conv_launches(case)]


def _kernels_of_every_family() -> set[str]:
    """The names of the Triton kernels (the public JIT functions of `ssmops/ops/<folder>/triton_kernels.py`)
    of every family in FAMILIES."""
    import importlib

    import triton

    names = set()
    for folder in _triton_family_folders():
        module = importlib.import_module(f"ssmops.ops.{folder}.triton_kernels")
        names |= {name for name, value in vars(module).items()
                  if isinstance(value, triton.runtime.jit.JITFunction) and not name.startswith("_")
                  and value.fn.__module__ == module.__name__}  # (not the shared helpers it imports)
    return names


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="compiles the JIT kernels, which the interpreter replaces")
def test_triton_decoding_steps_load_everything_before_they_store():
    """The decoding steps (Mamba-1's, the multi-head one, the conv's) are one memory latency when nothing else
    runs (batch 1): on sm_90 every global load of theirs comes before their first store, since the compiler
    keeps a load after a store it cannot tell apart from it, and the store waits for the arithmetic on the
    earlier loads (D and z were loaded after the state's store, the conv's update read its slots after the
    outputs' stores: two latencies)."""
    aot = benchmark_module("triton_aot")
    steps = [launch for launch in _recorded_launches_of_every_family() if "update" in launch[0].__name__]
    assert {kernel.__name__ for kernel, *_ in steps} == {
        "selective_state_update_kernel", "multihead_state_update_kernel", "causal_conv1d_update_kernel"}
    for kernel, args, meta, _ in steps:
        compiled = aot.compile_launch(kernel, args, meta, "sm90")
        opcodes = [aot.opcode(text) for _, text in aot.sass_instructions(compiled)]
        loads = [i for i, op in enumerate(opcodes) if op.startswith("LDG")]
        stores = [i for i, op in enumerate(opcodes) if op.startswith("STG")]
        assert loads and stores and max(loads) < min(stores), (kernel.__name__, meta)


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="analyses the JIT kernels, which the interpreter replaces")
def test_triton_kernels_write_only_flat_buffers_of_their_own():
    """torch.compile and AOTInductor copy every tensor that torch's analysis of a kernel (its TTIR, here for
    an H100) finds written, and AOTAutograd records such an input as mutated. Two ways this broke a
    training step's compile on CUDA, both decided before any GPU code runs: an input found written (an
    index of an output computed in a helper that also took the inputs made every input look written: SSD's
    x, a leaf that requires grad, was then "used in an in-place operation"), and a written buffer with a
    size-1 dimension ahead of a dynamic one, whose copy torch 2.10-2.11's inductor traces twice into graphs
    of different lengths (pytorch#181735, the Mamba-1 scan's backward at batch 1 or one B/C group). So
    every tensor a launch writes is a 1-D buffer its launcher allocated, or the state a decoding step
    updates in place."""
    aot = benchmark_module("triton_aot")

    seen = set()
    for kernel, args, meta, inputs in _recorded_launches_of_every_family():
        written = aot.written_arguments(kernel, args, meta)
        by_name = dict(zip(kernel.arg_names, args))
        assert written, kernel.__name__
        for name in written:
            t = by_name[name]
            assert not any(t is i for i in inputs if isinstance(i, torch.Tensor)), (kernel.__name__, name)
            if kernel.__name__.endswith("update_kernel") and name == "state_ptr":
                continue  # a decoding step's state, updated in place
            assert t.dim() == 1 and t._base is None, (kernel.__name__, name, tuple(t.shape))
        seen.add(kernel.__name__)
    # a family's kernels are all seen here, read from FAMILIES: a new family's launches must be recorded above
    assert seen == _kernels_of_every_family(), _kernels_of_every_family() ^ seen


@pytest.mark.slow  # compiles every launch for sm_90
@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="compiles the JIT kernels, which the interpreter replaces")
@pytest.mark.skipif(TRITON_INSTALLED and _triton_version() < (3, 9),
                    reason="the counts are Triton 3.9's lowering (3.6, torch 2.11's, lowered some ops across "
                           "lanes where 3.9 does not: issue 42)")
def test_triton_static_estimate_shows_time_inside_the_threads():
    """benchmarks/triton_static.py runs without a GPU. Its lane-shuffle counts guard the kernels'
    layout: the loops over time of the forward and the backward, a thread's channel with its states in
    registers, need no shuffle (the backward's, mamba_ssm's layout with time across lanes, needed 6.75
    per element, and 43 before that) but for the backward's sums of dB and dC over a warp's 32 channels: a
    halving exchange, 16 shuffles for a step's 16 states each, 2 an element (a butterfly's 10 before). The
    forward's loop loads each variable B/C row ahead of its step (FORWARD_PREFETCH): a median of over 120
    instructions between a load and its use (78 with the loads at their steps, which measured one L2 latency a
    step)."""
    proc = subprocess.run([sys.executable, "benchmarks/triton_static.py", "--no-bounds", "--family", "scan"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith(("forward",
                                                                                                     "backward"))}
    header = next(line.split() for line in proc.stdout.splitlines() if line.startswith("pass"))
    shuffles = header.index("shfl/elt")
    assert float(rows["forward"][shuffles]) == 0 and float(rows["backward"][shuffles]) == 2, proc.stdout
    assert int(rows["forward"][header.index("ld>use")].split("/")[1]) > 120, proc.stdout
    # (both park a few addresses outside their loops over time: test_triton_kernels_compile_for_gpus...)


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
def test_triton_static_prices_a_tuning_choice_of_the_space_only(monkeypatch):
    """`triton_static.py --knob NAME=VALUE` (and triton_counts.py's) price a value SSMOPS_AUTOTUNE=1 may choose:
    a knob of a family's TUNING_SPACE, set as the launchers' default, with its counts kept out of the committed
    file (the defaults' counts)."""
    from ssmops.ops.selective_scan import triton as scan_triton
    from ssmops.ops.ssd import triton as ssd_triton

    tc = benchmark_module("triton_counts")
    with pytest.raises(SystemExit, match="not a tuned knob"):
        tc.set_knobs(["CB_IN_OPERAND_DTYPE=False"])
    with pytest.raises(SystemExit, match=r"STATE_BLOCK_N takes one of \(32, 64, 128\)"):
        tc.set_knobs(["STATE_BLOCK_N=96"])
    monkeypatch.setattr(ssd_triton, "STATE_BLOCK_N", ssd_triton.STATE_BLOCK_N)
    monkeypatch.setattr(scan_triton, "BACKWARD_READ", scan_triton.BACKWARD_READ)
    assert tc.set_knobs(["STATE_BLOCK_N=128", "BACKWARD_READ=16"]) == {"ssd": {"STATE_BLOCK_N": 128},
                                                                        "scan": {"BACKWARD_READ": 16}}
    assert ssd_triton.TUNER.defaults()["STATE_BLOCK_N"] == 128 and scan_triton.BACKWARD_READ == 16
    with pytest.raises(SystemExit):
        tc.main(["--knob", "STATE_BLOCK_N=128"])  # (no --out: the committed file is the defaults')


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
def test_triton_counts_match_the_launchers():
    """benchmarks/triton_counts.json (what triton_static.py prices) holds one entry per launch the
    launchers make, in their order, with its traffic; the launchers run on meta tensors at the full
    shapes, as the estimate records them (no GPU, no compile: cheap)."""
    import json

    tc = benchmark_module("triton_counts")
    counts = json.loads(tc.COUNTS.read_text())
    full = {"scan": tc.scan_inputs(2, 64, 4096, 16, torch.bfloat16, device="meta"),
            "ssd": tc.ssd_inputs(2, 1024, 8, 64, 1, 128, 256, torch.bfloat16, device="meta")}
    for family, fwd_args in full.items():
        names = [tc.launch_name(kernel, meta) for kernel, _, _, meta in tc.recorded(family, fwd_args)]
        assert names == [row["name"] for row in counts[family]["launches"]], family
        assert all(row["load"] > 0 and row["sectors"] >= row["load"] for row in counts[family]["launches"])


# a fresh interpreter (it registers the Triton launchers for CUDA) that traces each family's forward and
# backward on fake CUDA tensors and prints, under the family's name, the launches and copies in the graph
_TRACE_ON_FAKE_CUDA = """
import torch
import ssmops._registry as registry
from torch._functorch.aot_autograd import aot_export_module
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode

registry._gpu_present = lambda: True  # fake CUDA tensors stand in for a GPU
assert registry.load_triton() is None
ops = torch.ops.ssmops


class ScanFwdBwd(torch.nn.Module):
    def forward(self, u, delta, A, B, C, D, zt, dout):
        z = zt.transpose(1, 2)  # as mamba_inner_fn slices z: strides a compiler may not keep
        out, x, out_z, last = ops.selective_scan_fwd_triton(u, delta, A, B, C, D, z, None, None, True)
        grads = ops.selective_scan_bwd_triton(u, delta, A, B, C, D, z, None, None, dout, x, None, True)
        return (out_z, *grads)


class SsdFwdBwd(torch.nn.Module):
    def forward(self, x, dt, A, B, C, D, z, bias, init, dout, dfinal):
        args = (x, dt, A, B, C, D, z, bias, init, None, None, 64, True, [])
        out, final, states, _, ungated = ops.ssd_scan_fwd_triton(*args, True)
        grads = ops.ssd_scan_bwd_triton(*args, dout, states, dfinal, None, ungated)
        return (out, final, *grads)


class Steps(torch.nn.Module):  # both decoding steps through the front end, as the blocks call it
    def forward(self, state, x, dt, A, B, C, D, z, bias, heads_state, hx, hdt, hA, hB, hC, hD, hbias):
        import ssmops

        y = ssmops.selective_state_update(state, x, dt, A, B, C, D, z, bias, True)
        # dt, A, D and dt_bias per head, as Mamba2.step passes them
        return y, ssmops.selective_state_update(heads_state, hx, hdt, hA, hB, hC, hD, None, hbias, True)


class ConvFwdBwd(torch.nn.Module):
    def forward(self, xbc, weight, bias, dout):
        # channel-last: dense when xbc has 64 features, a slice of a wider one else (narrow: CPU-only torch's
        # indexing and `contiguous` refuse fake CUDA tensors)
        x = xbc.narrow(2, 0, 64).transpose(1, 2)
        out, final = ops.causal_conv1d_fwd_triton(x, weight, bias, None, None, True)
        grads = ops.causal_conv1d_bwd_triton(x, weight, bias, None, None, dout, None, True)
        return (out, final, *grads)


def print_launches(family, module, args):
    print("family", family)
    graph, _ = aot_export_module(module, args, trace_joint=False)
    for node in graph.graph.nodes:
        if node.op == "call_function":
            assert not str(node.target).startswith("ssmops"), node.target
            if "triton_kernel_wrapper" in str(node.target):
                kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
                print("launch", kernel.fn.__name__, [c.num_warps for c in kernel.configs], node.kwargs["grid"])
            elif node.target is torch.ops.aten.clone.default:
                print("copy", tuple(node.args[0].meta["val"].stride()), "->", tuple(node.meta["val"].stride()))


with FakeTensorMode():
    b, d, l, n = 2, 64, 100, 16
    print_launches("scan", ScanFwdBwd(), [torch.empty(*shape, device="cuda") for shape in
                                          [(b, d, l), (b, d, l), (d, n), (b, n, l), (b, n, l), (d,), (b, l, d),
                                           (b, d, l)]])
    b, l, h, p, g, n = 2, 200, 8, 32, 2, 16
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    print_launches("ssd", SsdFwdBwd(), [
        torch.empty(b, l, h, p, **cuda), torch.empty(b, l, h, **cuda), torch.empty(h, device="cuda"),
        torch.empty(b, l, g, n, **cuda), torch.empty(b, l, g, n, **cuda), torch.empty(h, device="cuda"),
        torch.empty(b, l, h, p, **cuda), torch.empty(h, device="cuda"), torch.empty(b, h, p, n, device="cuda"),
        torch.empty(b, l, h, p, **cuda), torch.empty(b, h, p, n, device="cuda")])
    b, d, n, h, p, hn = 2, 192, 16, 8, 32, 64
    print_launches("step", Steps(), [
        torch.empty(b, d, n, device="cuda"), torch.empty(b, d, **cuda), torch.empty(b, d, **cuda),
        torch.empty(d, n, device="cuda"), torch.empty(b, n, **cuda), torch.empty(b, n, **cuda),
        torch.empty(d, device="cuda"), torch.empty(b, d, **cuda), torch.empty(d, device="cuda"),
        torch.empty(b, h, p, hn, device="cuda"), torch.empty(b, h, p, **cuda), torch.empty(b, h, **cuda),
        torch.empty(h, device="cuda"), torch.empty(b, 1, hn, **cuda), torch.empty(b, 1, hn, **cuda),
        torch.empty(h, device="cuda"), torch.empty(h, device="cuda")])
    b, l, d = 2, 100, 64
    for features in (d, d + 40):
        print_launches(f"conv{features}", ConvFwdBwd(), [
            torch.empty(b, l, features, device="cuda"), torch.empty(d, 4, device="cuda"), torch.empty(d, device="cuda"),
            torch.empty(b, l, d, device="cuda").transpose(1, 2)])
"""


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="traces the JIT kernels, which the interpreter replaces")
def test_triton_ops_trace_into_kernel_launches_on_cuda_tensors():
    """What torch.compile and AOTInductor see on a GPU, traced on fake CUDA tensors: AOTAutograd's
    functionalization turns the Triton operators into launches of the kernels themselves (with
    their tile sizes and warps), and no ssmops operator is left in the graph.

    The selective scan: a non-contiguous input (z, transposed) reaches each launch as a contiguous copy:
    the launch's stride numbers are the traced ones, which Inductor does not always keep for a view
    (_triton.contiguous_when_traced); the forward's and the backward's programs take 64 channels (2 warps)
    and read a time-major copy of B and C. The SSD: grids from the sizes (one (headdim, dstate) state tile, 4
    chunks of 64, batch x nheads = 16, batch x ngroups = 4 for C . B^T, one 64-token block a chunk in the
    backward's passes (one block pair in its dB and dC passes, over batch x ngroups x runs of heads = 4), dt
    processed once a pass in the output kernel's blocks of 64 tokens). The decoding steps, called through the public
    front end: a launch each, over blocks of 64 channels (Mamba-1's tile of 1024 at dstate 16) and per (head,
    batch). The conv: a dense channel-last x reaches its launches as it is (no transposing copy); a slice of a wider
    projection (Mamba-2's xBC) as a dense channel-last copy."""
    proc = run_python(_TRACE_ON_FAKE_CUDA, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {}
    for line in proc.stdout.splitlines():
        if line.startswith("family "):
            family = lines.setdefault(line.split()[1], [])
        elif line.startswith(("launch ", "copy ")):
            family.append(line)
    dim, seqlen, dstate = 64, 100, 16  # z: (batch, dim, seqlen), the transpose of a contiguous (batch, seqlen, dim)
    z_copy = f"copy {(seqlen * dim, 1, dim)} -> {(dim * seqlen, seqlen, 1)}"
    # the forward reads B and C time-major: (batch, dstate, seqlen) copied to (batch, seqlen, dstate)
    bc_copy = f"copy {(dstate * seqlen, 1, seqlen)} -> {(seqlen * dstate, dstate, 1)}"
    # and the backward's dB and dC back from time-major: (batch, groups, seqlen, dstate) to (..., dstate, seqlen)
    row = dstate * seqlen
    grad_copy = f"copy {(row, row, 1, dstate)} -> {(row, row, seqlen, 1)}"
    assert lines["scan"] == [z_copy, bc_copy, bc_copy, "launch selective_scan_fwd_kernel [2] [(1, 2, 1)]",
                             z_copy, bc_copy, bc_copy, "launch selective_scan_bwd_kernel [2] [(1, 2, 1)]",
                             grad_copy, grad_copy], proc.stdout
    conv = ["launch causal_conv1d_fwd_kernel [4] [(1, 4, 2)]", "launch causal_conv1d_dpre_kernel [4] [(1, 4, 2)]",
            "launch causal_conv1d_dstream_kernel [4] [(1, 4, 2)]"]
    assert lines["conv64"] == conv, proc.stdout
    compaction = f"copy {(seqlen * 104, 104, 1)} -> {(seqlen * dim, dim, 1)}"  # (batch, seqlen, dim), no transpose
    assert lines["conv104"] == [compaction, conv[0], compaction, *conv[1:]], proc.stdout
    assert lines["ssd"] == [
        "launch ssd_dt_kernel [4] [(4, 16, 1)]", "launch ssd_chunk_states_kernel [8] [(4, 16, 1)]",
        "launch ssd_state_passing_kernel [4] [(2, 16, 1)]",
        "launch ssd_cb_kernel [4] [(4, 4, 1)]",
        "launch ssd_chunk_scan_kernel [4] [(4, 16, 1)]", "launch ssd_dt_kernel [4] [(4, 16, 1)]",
        "launch ssd_cb_kernel [4] [(4, 4, 1)]", "launch ssd_gate_grad_kernel [4] [(7, 16, 1)]",
        "launch ssd_state_grads_kernel [8] [(1, 16, 1)]", "launch ssd_bwd_dx_kernel [4] [(4, 16, 1)]",
        "launch ssd_bwd_dcb_kernel [4] [(4, 4, 1)]",
        "launch ssd_bwd_group_kernel [4] [(4, 4, 1)]", "launch ssd_bwd_group_kernel [4] [(4, 4, 1)]",
        "launch ssd_bwd_ddt_kernel [4] [(4, 16, 1)]",
    ], proc.stdout
    # the decoding steps through the front end: one launch each, nothing copied (eager calls skip the operator;
    # a traced one keeps it, so the graph holds the launch)
    assert lines["step"] == ["launch selective_state_update_kernel [4] [(3, 2, 1)]",
                             "launch multihead_state_update_kernel [4] [(1, 8, 2)]"], proc.stdout


# a fresh interpreter in which CPU tensors take the GPU route (the registry is told a GPU is present and counts
# "cpu" among the GPU devices) and a launch is recorded, not made; prints one JSON line per call of the step
_EAGER_STEP_ON_FAKE_GPU = """
import json, sys
import torch
import ssmops._registry as registry

registry._gpu_present = lambda: True
assert registry.load_triton() is None
registry.GPU_DEVICES = (*registry.GPU_DEVICES, "cpu")
import ssmops
from ssmops.ops import _triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "tests")
from conftest import state_update_inputs
from ops.test_causal_conv1d import Update, update_inputs
from ops.test_state_update import multihead_inputs

launches = []
_triton.launch = lambda kernel, grid, args, meta: launches.append((kernel, args))
STATE_STEP = ("state", ("state", "x", "dt", "A", "B", "C"), ssmops.selective_state_update)
CONV_STEP = ("conv_state", ("x", "conv_state", "weight", "bias"),
             lambda **kw: ssmops.causal_conv1d_update(**kw, activation="silu"))
CASES = {"mamba1": (state_update_inputs(dtype=torch.bfloat16), STATE_STEP),
         "multihead-tied": (multihead_inputs(), STATE_STEP),
         "mamba1-cache": ({**state_update_inputs(groups=2), "state": torch.zeros(4, 6, 5, dtype=torch.bfloat16),
                           "state_batch_indices": torch.tensor([3, 1])}, STATE_STEP),
         "conv": (update_inputs(Update(4, 4, 1)), CONV_STEP),
         "conv-circular-cache": (update_inputs(Update(4, 3, 1, circular=True, indices=True)), CONV_STEP)}
for name, (kw, (updated, given, step)) in CASES.items():
    for mode in ("inference", "grad", "requires_grad", "use_backend"):
        grad_input = "A" if "A" in kw else "weight"
        call = dict(kw, **{grad_input: kw[grad_input].clone().requires_grad_()}) if mode == "requires_grad" else kw
        launches.clear()
        version = call[updated]._version
        with torch.inference_mode(mode == "inference"), ssmops.use_backend("triton" if mode == "use_backend" else None):
            step(**call)  # the launch plan is worked out at the first call
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(**call)
        events = {e.key: e.count for e in prof.key_averages()}
        kernel, args = launches[-1]
        print(json.dumps(dict(
            case=name, mode=mode, launches=len(launches), kernel=kernel.fn.__name__,
            operators=sorted(k for k in events if k.startswith("ssmops::")),
            made={k: v for k, v in events.items() if k in ("aten::empty", "aten::empty_strided", "aten::copy_",
                                                           "aten::clone", "aten::contiguous", "aten::to")},
            tensors_as_given=all(args[i] is call[k] for i, k in enumerate(given)),
            version_bumps=call[updated]._version - version)))
for step, kw, bad in [(ssmops.selective_state_update, CASES["mamba1"][0], "dt"), (CONV_STEP[2], CASES["conv"][0], "x")]:
    try:  # checked once per signature: a bad argument after good calls still names itself
        step(**{**kw, bad: kw[bad].double()})
    except TypeError as err:
        print(json.dumps(dict(error=str(err))))
"""


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="counts the launches of the JIT kernels, which the interpreter replaces")
def test_triton_eager_step_is_one_direct_launch():
    """An eager decoding step on a GPU (the state's and the conv's; CPU tensors standing in for CUDA ones, the
    launch recorded): one launch of its kernel with the caller's tensors as they are, one allocation (the
    output) and no copy, and no operator on the way (the dispatcher's route cost ~100 us of Python a step on an
    H200: issue 57), in and outside inference mode; outside it, the state's version is bumped once, as the
    operator would. A tensor requiring grad in grad mode, or use_backend, takes the operator's route, which
    launches the same kernel."""
    import json

    proc = run_python(_EAGER_STEP_ON_FAKE_GPU, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *rows, state_error, conv_error = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kernels = {"mamba1": "selective_state_update_kernel", "multihead-tied": "multihead_state_update_kernel",
               "mamba1-cache": "multihead_state_update_kernel", "conv": "causal_conv1d_update_kernel",
               "conv-circular-cache": "causal_conv1d_update_kernel"}
    assert len(rows) == 4 * len(kernels), proc.stdout
    for row in rows:
        direct = row["mode"] in ("inference", "grad")
        assert row["launches"] == 2 and row["kernel"] == kernels[row["case"]], row
        # (with a cache, the indices' check reads their largest: a reduction and its 0-d result, and on a GPU a sync)
        allocations = 2 if row["case"].endswith("cache") else 1
        assert row["tensors_as_given"] and row["made"] == {"aten::empty": allocations}, row
        assert (row["operators"] == []) == direct, row
        assert row["version_bumps"] == (0 if row["mode"] == "inference" else 2), row
    assert "dt must have dtype" in state_error["error"], state_error
    assert "x must have dtype" in conv_error["error"], conv_error


# --- on a GPU ----------------------------------------------------------------------------

GPU_SWEEP = [
    *(Case(batch=2, dim=64, seqlen=s, dstate=16, B=b, C=c, initial_state=True)
      for s in (1, 127, CHUNK_LEN + 1, 2 * CHUNK_LEN + 100) for b, c in [("var", "var"), ("const", "g4")]),
    Case(batch=2, dim=48, seqlen=300, dstate=5, B="g2", C="const", D=False, delta_bias=False, softplus=False),
    Case(batch=1, dim=6, seqlen=999, dstate=33, B="var", C="const", z=False),
    *(Case(batch=2, dim=64, seqlen=1000, dstate=16, dtype=dt, B="var", C="var")
      for dt in (torch.float16, torch.bfloat16)),
]


@gpu
@pytest.mark.parametrize("case", GPU_SWEEP, ids=str)
def test_triton_cuda_matches_reference(case):
    kw = make_inputs(case, device="cuda")
    y_ref, last_ref, g_ref = run_scan_with_grads(ssmops.selective_scan_ref, kw)
    y, last, grads = run_scan_with_grads(ssmops.selective_scan_fn, kw)  # CUDA: the Triton op
    tol = TOLERANCES[case.dtype]
    assert_close(y, y_ref, tol, "out")
    assert_close(last, last_ref, TOLERANCES[torch.float32] * 5, "last_state")
    for name, g in grads.items():
        assert_close(g, g_ref[name], tol * 2, f"d{name}")


@gpu
@pytest.mark.parametrize("case", STATE_UPDATE_CASES, ids=state_update_case_id)
def test_triton_cuda_state_update_matches_default(case):
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v
          for k, v in state_update_inputs(**{"batch": 4, "dim": 192, "dstate": 16, **case}).items()}
    # on CUDA, selective_state_update calls the Triton op
    _check_state_update_against_default(kw, kw["state"].clone(), ssmops.selective_state_update)


@gpu
def test_triton_cuda_main_op_dispatches_to_triton():
    args = _fwd_args(Case(batch=2, dim=16, seqlen=50, dstate=8), device="cuda")
    got = torch.ops.ssmops.selective_scan_fwd(*args)
    expected = torch.ops.ssmops.selective_scan_fwd_triton(*args)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@gpu
@pytest.mark.slow
def test_triton_compile_fullgraph_forward_backward():
    case = Case(batch=2, dim=64, seqlen=300, dstate=16, B="var", C="var", initial_state=True)
    kw = make_inputs(case, device="cuda")
    compiled = torch.compile(ssmops.selective_scan_fn, fullgraph=True, dynamic=True)
    y_ref, _, g_ref = run_scan_with_grads(ssmops.selective_scan_ref, kw)
    y, _, grads = run_scan_with_grads(compiled, kw)
    assert_close(y, y_ref, TOLERANCES[torch.float32], "out")
    for name, g in grads.items():
        assert_close(g, g_ref[name], TOLERANCES[torch.float32] * 2, f"d{name}")
    # another seqlen reuses the graph (seqlen stays symbolic)
    kw2 = make_inputs(Case(batch=2, dim=64, seqlen=CHUNK_LEN + 7, dstate=16, B="var", C="var"), device="cuda")
    torch.testing.assert_close(compiled(**kw2), ssmops.selective_scan_ref(**kw2), rtol=2e-4, atol=2e-4)


SSD_GPU_SWEEP = [
    dict(), dict(seq_idx=True), dict(batch=1, varlen=True, seqlen=300, chunk=64),
    dict(dtype=torch.bfloat16, seqlen=1000, chunk=256, nheads=8, headdim=64, dstate=128, ngroups=1),
    dict(dtype=torch.float16, seqlen=129, chunk=32, ngroups=4),
]


@gpu
@pytest.mark.parametrize("case", SSD_GPU_SWEEP, ids=state_update_case_id)
def test_triton_cuda_ssd_matches_default(case):
    """The SSD scan on CUDA (its Triton kernels) against the default backend on the same GPU, forward and
    backward (tests/ops/test_ssd.py holds both to the float64 oracle on CPU)."""
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in _ssd_args(**case))
    bwd_args = _ssd_bwd_args(args, torch.ops.ssmops.ssd_scan_fwd)
    got = (*torch.ops.ssmops.ssd_scan_fwd(*args), *torch.ops.ssmops.ssd_scan_bwd(*bwd_args))
    with ssmops.use_backend("default"):
        expected = (*torch.ops.ssmops.ssd_scan_fwd(*args), *torch.ops.ssmops.ssd_scan_bwd(*bwd_args))
    tol = 3e-2 if case.get("dtype", torch.float32) != torch.float32 else 1e-4
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert g.numel() == 0 or rel_err(g, e) <= tol


@gpu
@pytest.mark.slow
def test_triton_ssd_compile_fullgraph_forward_backward():
    """torch.compile(fullgraph=True) of mamba_chunk_scan_combined, forward and backward, on CUDA."""
    x, dt, A, B, C, D, z, dt_bias, init, _, _, chunk, _, _ = (
        a.cuda() if isinstance(a, torch.Tensor) else a for a in _ssd_args(seqlen=200, chunk=64))
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, z, dt_bias, init)]

    def scan(x, dt, A, B, C, D, z, dt_bias, init):
        out, final = ssmops.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D, z, dt_bias, init, dt_softplus=True,
                                                      return_final_states=True)
        return out.square().sum() + final.sum()

    compiled = torch.compile(scan, fullgraph=True)
    grads = torch.autograd.grad(compiled(*leaves), leaves)
    with ssmops.use_backend("default"):
        expected = torch.autograd.grad(scan(*leaves), leaves)
    for g, e in zip(grads, expected):
        assert rel_err(g, e) <= 1e-4


class _Scan(torch.nn.Module):
    def forward(self, u, delta, A, B, C, D, z, delta_bias):
        return ssmops.selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)


_AOTI_CONTROL = """
import sys, torch
class Plain(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w + 1)
args = (torch.randn(8, 16, device="cuda"), torch.randn(16, 4, device="cuda"))
ep = torch.export.export(Plain(), args)
path = torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[1])
torch.testing.assert_close(torch._inductor.aoti_load_package(path)(*args), Plain()(*args))
print("control ok")
"""


@gpu
@pytest.mark.slow
def test_triton_aoti_package_embeds_the_kernels(tmp_path):
    """The AOTInductor package launches the Triton kernels itself: no proxy-executor call for the scan.
    A package of a plain model (no ssmops) is built and loaded first, in its own process: where that
    crashes, this torch build's AOTInductor cannot load packages here at all (torch 2.11+cu130 on one H100
    segfaulted so) and the test skips, saying so; where only ssmops' package fails, it fails."""
    control = run_python(_AOTI_CONTROL, args=[str(tmp_path / "plain.pt2")], timeout=600)
    if control.returncode != 0:
        reason = f"signal {-control.returncode}" if control.returncode < 0 else control.stderr.strip()[-300:]
        pytest.skip(f"AOTInductor fails for a plain model without ssmops on this torch build ({reason})")
    kw = make_inputs(Case(batch=2, dim=64, seqlen=500, dstate=16, B="var", C="var"), device="cuda")
    args = tuple(kw[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias"))
    seqlen = torch.export.Dim("seqlen", min=2, max=1 << 16)
    dyn = {"u": {2: seqlen}, "delta": {2: seqlen}, "B": {2: seqlen}, "C": {2: seqlen}, "z": {2: seqlen},
           "A": None, "D": None, "delta_bias": None}
    with torch.no_grad():
        ep = torch.export.export(_Scan(), args, dynamic_shapes=dyn)
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "scan.pt2"))
    with zipfile.ZipFile(path) as pkg:
        names = pkg.namelist()
        sources = "\n".join(pkg.read(n).decode(errors="replace") for n in names if n.endswith((".cpp", ".h", ".py")))
    assert "selective_scan_fwd_kernel" in sources, names
    assert any(n.endswith((".cubin", ".hsaco", ".spv")) for n in names), names
    assert "proxy_executor" not in sources or "ssmops" not in sources.split("proxy_executor", 1)[1][:2000]
    assert "ssmops::selective_scan" not in sources
    loaded = torch._inductor.aoti_load_package(path)
    torch.testing.assert_close(loaded(*args), ssmops.selective_scan_ref(**kw), rtol=2e-4, atol=2e-4)
    # the package runs without ssmops' operators: a fresh interpreter that never imports ssmops
    code = (
        "import torch\n"
        f"m = torch._inductor.aoti_load_package({str(path)!r})\n"
        "g = torch.Generator().manual_seed(0)\n"
        "b, d, l, n = 2, 64, 777, 16\n"
        "args = (torch.randn(b, d, l), torch.randn(b, d, l) * 0.5 - 1, -torch.rand(d, n) - 0.1,\n"
        "        torch.randn(b, n, l), torch.randn(b, n, l), torch.randn(d), torch.randn(b, d, l), torch.zeros(d))\n"
        "y = m(*[a.cuda() for a in args])\n"
        "import sys; assert 'ssmops' not in sys.modules; print(tuple(y.shape))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(2, 64, 777)" in proc.stdout


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: make gpu-check runs the benchmark itself")
def test_gpu_benchmark_parses_and_explains_without_a_gpu():
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--seqlen", "64", "--skip-baselines"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs a CUDA" in proc.stderr, proc.stderr
