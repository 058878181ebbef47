"""Hardening: argument fuzzing (crash-isolated), determinism, concurrency, long sequences."""

from __future__ import annotations

import json

import pytest
import torch

import ssmops
from conftest import Case, backend_params, make_inputs, run_in_threads, run_python, run_scan_with_grads

# Each family's arguments and entry points for the fuzzer: good() builds valid arguments,
# api(kw) and op(kw) call the Python front end and the raw operator.
_SCAN_ENTRIES = r"""
ARGS = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]
def good():
    b, d, l, n = 2, 4, 5, 3
    return dict(u=torch.randn(b, d, l), delta=torch.rand(b, d, l), A=-torch.rand(d, n), B=torch.randn(b, 2, n, l),
                C=torch.randn(b, 2, n, l), D=torch.randn(d), z=torch.randn(b, d, l), delta_bias=torch.randn(d),
                initial_state=torch.randn(b, d, n))
def api(kw):
    ssmops.selective_scan_fn(**kw, delta_softplus=True)
def op(kw):
    torch.ops.ssmops.selective_scan_fwd(*[kw[a] for a in ARGS], True)
GROUPED = ("B", "C")
"""

_SSD_ENTRIES = r"""
ARGS = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx", "cu_seqlens"]
def good():
    b, l, h, p, g, n = 1, 9, 4, 2, 2, 3
    return dict(x=torch.randn(b, l, h, p), dt=torch.randn(b, l, h), A=-torch.rand(h), B=torch.randn(b, l, g, n),
                C=torch.randn(b, l, g, n), D=torch.randn(h, p), z=torch.randn(b, l, h, p), dt_bias=torch.randn(h),
                initial_states=torch.randn(b, h, p, n), seq_idx=torch.tensor([[0] * 4 + [1] * 5], dtype=torch.int32),
                cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32))
def api(kw):
    ssmops.mamba_chunk_scan_combined(**kw, chunk_size=4, dt_softplus=True, return_varlen_states=True)
def op(kw):
    torch.ops.ssmops.ssd_scan_fwd(*[kw[a] for a in ARGS], 4, True, [])
GROUPED = ("B", "C")
"""

_FUZZ_SCRIPT = r"""
import random, sys, torch, ssmops
{entries}
rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
def mutate(kw, name):
    x = kw[name]
    kind = rng.choice(["rank", "size", "dtype", "meta", "nontensor", "groups"])
    if kind == "rank":
        kw[name] = x.reshape(-1) if x.dim() > 1 else x.unsqueeze(0)
    elif kind == "size":
        shape = list(x.shape); i = rng.randrange(len(shape)); shape[i] += rng.choice([1, 2, 7])
        kw[name] = torch.randn(shape) if x.is_floating_point() else torch.randint(0, 3, shape, dtype=x.dtype)
    elif kind == "dtype":
        wrong = [d for d in (torch.float64, torch.int32, torch.complex64, torch.bool) if d != x.dtype]
        kw[name] = x.to(rng.choice(wrong))
    elif kind == "meta":
        kw[name] = x.to("meta")
    elif kind == "nontensor":
        kw[name] = rng.choice([1.5, "x", [1, 2], object()])
    else:
        kw[name] = torch.randn(2, 3, 3, 5) if name in GROUPED else x.to(torch.float64)
    return kind
for case in range(int(sys.argv[2]) if len(sys.argv) > 2 else 200):
    kw = good()
    name = rng.choice(ARGS)
    kind = mutate(kw, name)
    for entry, call in (("api", api), ("op", op)):
        print(f"START {{case}} {{name}} {{kind}} {{entry}}", flush=True)
        try:
            call(kw)
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as err:
            ok = name in str(err) or (name in GROUPED and "groups" in str(err))
            print(f"RAISED {{type(err).__name__}} {{'NAMED' if ok else 'UNNAMED'}} {{str(err)[:200]!r}}", flush=True)
        else:
            print("ACCEPTED", flush=True)
print("DONE", flush=True)
"""


@pytest.mark.parametrize("entries", [_SCAN_ENTRIES, _SSD_ENTRIES], ids=["selective_scan", "ssd"])
@pytest.mark.parametrize("backend", backend_params())
def test_fuzzed_arguments_raise_named_errors_and_never_crash(backend, entries):
    if entries is _SSD_ENTRIES and backend == "triton":
        pytest.skip("the SSD scan has no Triton kernel yet")
    out = run_python(_FUZZ_SCRIPT.format(entries=entries), env={"SSMOPS_BACKEND": backend}, timeout=300)
    lines = out.stdout.splitlines()
    last_case = next((line for line in reversed(lines) if line.startswith("START")), "?")
    assert out.returncode == 0 and lines[-1] == "DONE", (
        f"the process died (exit {out.returncode}) at: {last_case}\n{out.stderr[-2000:]}"
    )
    starts = [line for line in lines if line.startswith("START")]
    results = [line for line in lines if not line.startswith(("START", "DONE"))]
    assert len(starts) == len(results) == 400
    failures = [(s, r) for s, r in zip(starts, results) if "NAMED" not in r.split()[:3] or r == "ACCEPTED"]
    # the Python entry point must always name the argument; the raw operator is checked by
    # the backend's own checks (C++ for cpu), which must name it too
    assert not failures, "\n".join(f"{s} -> {r}" for s, r in failures[:10])


@pytest.mark.parametrize(
    "backend, case",
    backend_params([Case(B="var", C="var", initial_state=True), Case(B="const", C="g2", batch=3, dim=8)])
    # complex A: the Triton kernels reject it
    + backend_params([Case(B="g2", C="g2", batch=3, dim=8, initial_state=True, complex_A=True)],
                     names=("default", "cpu")),
)
def test_results_are_bitwise_identical_across_runs_and_thread_counts(backend, case):
    kw = make_inputs(case.__class__(**{**case.__dict__, "seqlen": 2100}))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 2):
            torch.set_num_threads(n)
            with ssmops.use_backend(backend):
                results.append(run_scan_with_grads(ssmops.selective_scan_fn, kw))
    finally:
        torch.set_num_threads(threads)
    (y0, l0, g0), *rest = results
    for y, last, grads in rest:
        assert torch.equal(y, y0) and torch.equal(last, l0)
        for name in g0:
            assert torch.equal(grads[name], g0[name]), f"d{name} differs"


@pytest.mark.parametrize("backend", backend_params())
def test_concurrent_calls_match_serial_ones(backend):
    cases = [make_inputs(Case(seqlen=300, B=b, C="var"), seed=i) for i, b in enumerate(["var", "const"] * 3)]
    with ssmops.use_backend(backend):
        serial = [run_scan_with_grads(ssmops.selective_scan_fn, kw) for kw in cases]

    def call(i):
        with ssmops.use_backend(backend):
            return run_scan_with_grads(ssmops.selective_scan_fn, cases[i])

    concurrent = run_in_threads(call, len(cases))
    for (y, last, grads), (y_s, last_s, grads_s) in zip(concurrent, serial):
        assert torch.equal(y, y_s) and torch.equal(last, last_s)
        assert all(torch.equal(grads[k], grads_s[k]) for k in grads)


@pytest.mark.parametrize("backend", backend_params())
def test_chaining_two_halves_through_the_state_equals_one_pass(backend):
    kw = make_inputs(Case(batch=2, dim=4, seqlen=5000, dstate=8, B="var", C="var", z=False))
    half = 2600
    first = {k: v[..., :half] if isinstance(v, torch.Tensor) and v.shape[-1:] == (5000,) else v for k, v in kw.items()}
    second = {k: v[..., half:] if isinstance(v, torch.Tensor) and v.shape[-1:] == (5000,) else v for k, v in kw.items()}
    with ssmops.use_backend(backend):
        y, last = ssmops.selective_scan_fn(**kw, return_last_state=True)
        y1, h1 = ssmops.selective_scan_fn(**first, return_last_state=True)
        y2, h2 = ssmops.selective_scan_fn(**{**second, "initial_state": h1}, return_last_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], dim=-1), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2, last, rtol=1e-5, atol=1e-5)


_LONG_SCRIPT = """
import json, resource, torch, ssmops
torch.manual_seed(0)
b, d, l, n = 1, 16, 1_000_000, 16
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kw = dict(u=torch.empty(b, d, l).normal_(), delta=torch.empty(b, d, l).uniform_(-3, -1),
          A=-torch.rand(d, n) - 0.5, B=torch.empty(b, n, l).normal_(), C=torch.empty(b, n, l).normal_(),
          D=torch.ones(d), delta_bias=torch.zeros(d))
for v in kw.values():
    v.requires_grad_()
torch.ops.ssmops.selective_scan_fwd(*[kw[k][..., :64] if kw[k].dim() == 3 else kw[k] for k in ("u", "delta")],
    kw["A"], kw["B"][..., :64], kw["C"][..., :64], None, None, None, None, True)  # load code paths
before = rss()
with ssmops.use_backend("{backend}"):
    y = ssmops.selective_scan_fn(**kw, delta_softplus=True)
    y.backward(torch.ones_like(y))
extra = rss() - before
# what the inputs' grads and the output themselves occupy, beyond the inputs already counted
own = sum(v.numel() * 4 for v in kw.values()) + y.numel() * 4
print(json.dumps(dict(extra=extra, own=own, finite=bool(torch.isfinite(kw["u"].grad).all()))))
"""


@pytest.mark.slow
def test_million_step_sequence_forward_backward_within_memory_bound():
    if ssmops.available_backends()["cpu"] != "available":
        pytest.skip("the native cpu backend is needed at this length")
    out = run_python(_LONG_SCRIPT.replace("{backend}", "cpu"), timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["finite"]
    # peak above the inputs: outputs + gradients (= `own`) plus at most as much again
    assert res["extra"] <= 2 * res["own"], f"{res['extra'] / 2**20:.0f} MiB > 2 x {res['own'] / 2**20:.0f} MiB"
