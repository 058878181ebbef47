"""The SSD chunked scan (Mamba-2): the per-timestep oracle against a scalar transcription of
the formulas, the chunked reference against the oracle, every backend against the oracle
(forward, final/chunk/varlen states, every gradient) over a grid, and the operator's checks,
opcheck and deployment paths. Errors are measured relative to the reference's magnitude.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import ssmops
from conftest import GRID_DEVICES, backend_params, on_device
from ssmops.ops.ssd import default, reference

INF = float("inf")
SSD_BACKENDS = ("default", "cpu", "triton")
# Triton runs CPU tensors only under its interpreter (tests/test_triton.py runs this file's Triton cases
# so), about ten seconds a case: these cases run there in the quick suite, the others are marked slow.
TRITON_QUICK = ("seq=(0, 16, 21, 40)", "batch=1,seq=(0, 10, 16, 33),varlen=True",
                "seqlen=24,D=head,softplus=False,dt_limit=(0.05, 0.6),dtypes=bf16",
                "seqlen=24,D=head,dtypes=bf16,cb_float32=True", "nheads=6,seq=(0, 16, 21, 40),group_heads=1")


def ssd_backend_params(cases=None, quick=TRITON_QUICK):
    """backend_params of SSD_BACKENDS on GRID_DEVICES, with the interpreted Triton cases outside `quick`
    marked slow (and none of `row_block`, the default backend's knob, but on the CPU; `cb_float32` and
    `group_heads`, Triton's, on Triton only)."""
    params = []
    for param in backend_params(cases, names=SSD_BACKENDS, devices=GRID_DEVICES):
        backend, *case = param.values
        if (backend == "triton" or backend.device != "cpu") and case and case[0].row_block is not None:
            continue
        if backend != "triton" and case and (case[0].cb_float32 or case[0].group_heads is not None):
            continue
        slow = backend == "triton" and backend.device == "cpu" and case and str(case[0]) not in quick
        params.append(pytest.param(*param.values, marks=[*param.marks, *([pytest.mark.slow] if slow else [])],
                                   id=param.id))
    return params


# Error of the float32 computation and of rounding the results to the inputs' dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest error relative to the largest magnitude of the expected tensor."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    expected = expected.double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return (actual.double() - expected).abs().max().item() / max(scale, 1e-30) if expected.numel() else 0.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration. seq: None, or the positions where each row's sequences start
    (row 1 starts with id 1, so its initial state is dropped); varlen needs batch 1."""

    batch: int = 2
    seqlen: int = 50
    nheads: int = 4
    headdim: int = 4
    ngroups: int = 2
    dstate: int = 3
    chunk: int = 16
    D: str | None = "channel"  # "channel": (nheads, headdim); "head": (nheads,)
    z: bool = True
    dt_bias: bool = True
    softplus: bool = True
    dt_limit: tuple[float, float] = (0.0, INF)
    initial: bool = True
    seq: tuple[int, ...] | None = None
    varlen: bool = False
    dtypes: str = "fp32"  # fp32 | fp16 | bf16 | mixed
    row_block: int | None = None  # override default._ROW_BLOCK, to exercise several row blocks per chunk
    cb_float32: bool = False  # Triton's C.B^T tiles in float32 for 16-bit inputs (CB_IN_OPERAND_DTYPE off)
    group_heads: int | None = None  # Triton's GROUP_HEADS: a group's heads in several runs, summed after

    def __str__(self):
        fields = (f"{k}={v}" for k, v in dataclasses.asdict(self).items() if v != getattr(Case, k))
        return ",".join(fields) or "base"


def _dtype_of(case: Case, name: str) -> torch.dtype:
    """Each float input's dtype; 'mixed' gives different inputs different dtypes."""
    if case.dtypes == "mixed":
        return {"x": torch.float16, "B": torch.bfloat16, "z": torch.bfloat16, "D": torch.float16}.get(
            name, torch.float32
        )
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[case.dtypes]


def make_inputs(case: Case, seed: int = 0) -> dict:
    """Keyword arguments of ssd_scan_ref (without the flags)."""
    g = torch.Generator().manual_seed(seed)
    b, L, h, p, n = case.batch, case.seqlen, case.nheads, case.headdim, case.dstate

    def randn(name: str, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(_dtype_of(case, name))

    inputs = dict(
        x=randn("x", b, L, h, p),
        # Without softplus dt is used as is: some steps are negative (decay > 1).
        dt=randn("dt", b, L, h, scale=0.5) - (1.0 if case.softplus else -0.3),
        A=-torch.rand(h, generator=g) * 2 - 0.1,
        B=randn("B", b, L, case.ngroups, n),
        C=randn("C", b, L, case.ngroups, n),
        D=None if case.D is None else randn("D", *((h, p) if case.D == "channel" else (h,))),
        z=randn("z", b, L, h, p) if case.z else None,
        dt_bias=randn("dt_bias", h, scale=0.5) if case.dt_bias else None,
        initial_states=torch.randn(b, h, p, n, generator=g) if case.initial else None,
        seq_idx=None,
        cu_seqlens=None,
    )
    if case.seq is not None:
        starts = torch.tensor([s for s in case.seq if s < L], dtype=torch.long)
        ids = torch.searchsorted(starts, torch.arange(L), right=True).to(torch.int32) - 1
        inputs["seq_idx"] = torch.stack([ids + row for row in range(b)])  # row r starts at id r
        if case.varlen:
            inputs["cu_seqlens"] = torch.cat([starts, torch.tensor([L])]).to(torch.int32)
    return inputs


def flags(case: Case) -> dict:
    return dict(dt_softplus=case.softplus, dt_limit=case.dt_limit)


def as_float64(inputs: dict) -> dict:
    return {k: v.double() if v is not None and v.is_floating_point() else v for k, v in inputs.items()}


def op_args(inputs: dict, case: Case) -> tuple:
    """The operators' positional arguments (dt_limit [] for the default (0, inf))."""
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx", "cu_seqlens")
    limit = [] if case.dt_limit == (0.0, INF) else list(case.dt_limit)
    return (*(inputs[k] for k in names), case.chunk, case.softplus, limit)


GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


# --- the oracle against a scalar transcription --------------------------------------------------


def scalar_scan(inputs: dict, dt_softplus: bool, dt_limit: tuple[float, float]):
    """The recurrence with Python floats, one multiply-add at a time. Returns out and the
    states after every token, as nested lists [b][t][h][p][n]."""
    x, dt, B, C = (inputs[k].double().tolist() for k in ("x", "dt", "B", "C"))
    A = inputs["A"].double().tolist()
    batch, seqlen, nheads, headdim = inputs["x"].shape
    ngroups, dstate = inputs["B"].shape[2:]
    D, z, bias, init, seq = (inputs[k] for k in ("D", "z", "dt_bias", "initial_states", "seq_idx"))
    out = [[[[0.0] * headdim for _ in range(nheads)] for _ in range(seqlen)] for _ in range(batch)]
    states = [[None] * seqlen for _ in range(batch)]
    for b in range(batch):
        h_state = [
            [[init[b, hd, p, n].item() if init is not None else 0.0 for n in range(dstate)] for p in range(headdim)]
            for hd in range(nheads)
        ]
        previous_seq = 0
        for t in range(seqlen):
            if seq is not None:
                if seq[b, t].item() != previous_seq:
                    h_state = [[[0.0] * dstate for _ in range(headdim)] for _ in range(nheads)]
                previous_seq = seq[b, t].item()
            for hd in range(nheads):
                g = hd // (nheads // ngroups)
                d = dt[b][t][hd] + (bias[hd].item() if bias is not None else 0.0)
                if dt_softplus:
                    d = d if d > 20 else math.log1p(math.exp(d))
                if tuple(dt_limit) != (0.0, INF):
                    d = min(max(d, dt_limit[0]), dt_limit[1])
                decay = math.exp(d * A[hd])
                for p in range(headdim):
                    y = 0.0
                    for n in range(dstate):
                        h_state[hd][p][n] = decay * h_state[hd][p][n] + d * x[b][t][hd][p] * B[b][t][g][n]
                        y += h_state[hd][p][n] * C[b][t][g][n]
                    if D is not None:
                        y += (D[hd, p] if D.dim() == 2 else D[hd]).item() * x[b][t][hd][p]
                    if z is not None:
                        zz = z[b, t, hd, p].item()
                        y *= zz / (1 + math.exp(-zz))
                    out[b][t][hd][p] = y
            states[b][t] = [[row[:] for row in head] for head in h_state]
    return torch.tensor(out, dtype=torch.float64), torch.tensor(states, dtype=torch.float64)


SCALAR_CASES = [
    Case(batch=2, seqlen=7, nheads=4, headdim=2, ngroups=2, dstate=3, seq=(0, 3, 4)),
    Case(
        batch=1,
        seqlen=7,
        nheads=2,
        headdim=2,
        ngroups=1,
        dstate=2,
        D="head",
        dt_limit=(0.2, 0.9),
        seq=(0, 2, 6),
        varlen=True,
    ),
    Case(
        batch=2,
        seqlen=6,
        nheads=2,
        headdim=3,
        ngroups=1,
        dstate=2,
        D=None,
        z=False,
        dt_bias=False,
        softplus=False,
        initial=False,
    ),
]


@pytest.mark.parametrize("case", SCALAR_CASES, ids=str)
def test_oracle_matches_scalar_loop(case):
    inputs = as_float64(make_inputs(case))
    expected_out, states = scalar_scan(inputs, case.softplus, case.dt_limit)
    out, final, *varlen = reference.ssd_scan_ref(
        **inputs, **flags(case), return_final_states=True, return_varlen_states=case.varlen
    )
    assert rel_err(out, expected_out) < 1e-12
    assert rel_err(final, states[:, -1]) < 1e-12
    if case.varlen:
        ends = inputs["cu_seqlens"][1:].long() - 1
        assert rel_err(varlen[0], states[0, ends]) < 1e-12
    if not case.softplus:
        assert (inputs["dt"] < 0).any(), "the default dt_limit must leave negative dt unclamped"


# --- the chunked reference ----------------------------------------------------------------------

REF_CASES = [
    Case(seq=(0, 16, 21, 40)),
    Case(batch=1, seq=(0, 10, 16, 33), varlen=True, dt_limit=(0.05, 0.6)),
    Case(D="head", z=False, softplus=False, initial=False, ngroups=1),
    Case(seqlen=1, chunk=4, seq=(0,)),
]


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("case", REF_CASES, ids=str)
def test_chunked_ref_matches_oracle(case, chunk):
    inputs = as_float64(make_inputs(case))
    kw = dict(**flags(case), return_final_states=True, return_varlen_states=case.varlen)
    expected = reference.ssd_scan_ref(**inputs, **kw)
    actual = reference.ssd_chunked_ref(chunk_size=chunk, **inputs, **kw)
    for a, e in zip(actual, expected):
        assert rel_err(a, e) < 1e-12


def test_chunked_ref_gradients_match_oracle():
    case = Case(batch=1, seq=(0, 16, 21, 40), varlen=True)
    inputs = as_float64(make_inputs(case))
    leaves = {k: inputs[k].clone().requires_grad_() for k in GRAD_NAMES}
    kw = dict(**flags(case), return_final_states=True, return_varlen_states=True)
    grads = []
    for scan in (reference.ssd_scan_ref, lambda **a: reference.ssd_chunked_ref(chunk_size=16, **a)):
        results = scan(**{**inputs, **leaves}, **kw)
        cotangents = [torch.ones_like(r) for r in results]
        grads.append(torch.autograd.grad(results, list(leaves.values()), cotangents))
    for name, expected, actual in zip(GRAD_NAMES, *grads):
        assert rel_err(actual, expected) < 1e-10, name


# --- every backend against the oracle -----------------------------------------------------------

SEQ = (0, 16, 21, 40)  # boundaries inside chunks and one exactly at a chunk edge (16)
DEFAULT_CASES = [
    Case(),
    Case(seq=SEQ),
    Case(ngroups=1, D="head", seq=SEQ),
    Case(ngroups=4, D=None, z=False),
    Case(dt_bias=False, softplus=False, initial=False),
    Case(softplus=False, dt_limit=(0.05, 0.6)),
    Case(dt_limit=(0.1, 0.4), seq=SEQ, initial=False),
    Case(batch=1, seq=(0, 10, 16, 33), varlen=True),
    Case(batch=1, seq=(0, 16, 48), varlen=True, chunk=64, initial=False),
    Case(seqlen=64, chunk=16, seq=(0, 32)),
    Case(seqlen=1, chunk=16),
    Case(seqlen=1, chunk=16, batch=1, seq=(0,), varlen=True),
    Case(seqlen=100, chunk=64, dstate=8, seq=(0, 64, 70)),
    Case(seqlen=300, chunk=256, dstate=4, seq=(0, 100, 256)),
    Case(seqlen=50, chunk=16, row_block=4, seq=SEQ),
    Case(seqlen=70, chunk=32, row_block=8, batch=1, seq=(0, 5, 32, 45), varlen=True, ngroups=1),
    Case(dtypes="fp16", seq=SEQ),
    Case(dtypes="bf16", seqlen=24, D="head", softplus=False, dt_limit=(0.05, 0.6)),  # 2 chunks (interpreted bf16)
    Case(dtypes="bf16", seqlen=24, D="head", cb_float32=True),
    Case(dtypes="mixed", batch=1, seq=SEQ, varlen=True),
    Case(nheads=6, seq=SEQ, group_heads=1),  # 3 runs of a group's heads
    Case(batch=1, nheads=8, seqlen=70, chunk=32, seq=(0, 5, 32, 45), varlen=True, dtypes="bf16", group_heads=2),
]


def run_ops(case: Case, inputs: dict, cotangents: dict) -> tuple:
    """The forward and backward operators on the backend in force, as autograd calls them: the forward keeps
    the output before the gate (with z), and the backward reads it."""
    args = op_args(inputs, case)
    out, final, chunk_states, varlen, ungated = torch.ops.ssmops.ssd_scan_fwd(*args, True)
    grads = torch.ops.ssmops.ssd_scan_bwd(*args, cotangents["out"], chunk_states, cotangents["final"],
                                          cotangents.get("varlen"), ungated if case.z else None)
    return out, final, chunk_states, varlen, grads


def oracle_with_grads(case: Case, inputs: dict, cotangents: dict) -> tuple:
    """The float64 oracle's results and gradients (of the given cotangents) on the same values."""
    inputs = as_float64(inputs)
    leaves = {k: inputs[k].clone().requires_grad_() for k in GRAD_NAMES if inputs[k] is not None}
    results = reference.ssd_scan_ref(
        **{**inputs, **leaves}, **flags(case), return_final_states=True, return_varlen_states=case.varlen
    )
    outputs = [results[0], results[1]] + ([results[2]] if case.varlen else [])
    cots = [cotangents["out"].double(), cotangents["final"].double()] + (
        [cotangents["varlen"].double()] if case.varlen else []
    )
    grads = torch.autograd.grad(outputs, list(leaves.values()), cots)
    return results, dict(zip(leaves, grads))


def make_cotangents(case: Case, inputs: dict) -> dict:
    g = torch.Generator().manual_seed(1)
    x = inputs["x"]
    b, L, h, p = x.shape
    n = case.dstate
    cots = dict(out=torch.randn(b, L, h, p, generator=g).to(x.dtype), final=torch.randn(b, h, p, n, generator=g))
    if case.varlen:
        cots["varlen"] = torch.randn(inputs["cu_seqlens"].numel() - 1, h, p, n, generator=g)
    return on_device(cots, x.device)


def test_triton_quick_cases_are_grid_cases():
    """Every id of TRITON_QUICK names a case of the grid (an id that drifted from its case would drop the case
    from the quick set without a word)."""
    assert set(TRITON_QUICK) <= {str(case) for case in DEFAULT_CASES}


@pytest.mark.parametrize("backend, case", ssd_backend_params(DEFAULT_CASES))
def test_backend_matches_oracle(backend, case, monkeypatch):
    if case.row_block is not None:
        monkeypatch.setattr(default, "_ROW_BLOCK", case.row_block)
    triton_knobs = dict(CB_IN_OPERAND_DTYPE=False) if case.cb_float32 else {}
    if case.group_heads is not None:
        triton_knobs["GROUP_HEADS"] = case.group_heads
    if triton_knobs:
        from ssmops.ops.ssd import triton as ssd_triton

        for knob, value in triton_knobs.items():
            monkeypatch.setattr(ssd_triton, knob, value)
    inputs = on_device(make_inputs(case), backend.device)
    cotangents = make_cotangents(case, inputs)
    with ssmops.use_backend(backend):
        out, final, chunk_states, varlen, grads = run_ops(case, inputs, cotangents)
    expected, expected_grads = oracle_with_grads(case, inputs, cotangents)
    x = inputs["x"]
    tol = max(TOLERANCE[t.dtype] for t in inputs.values() if t is not None and t.is_floating_point())

    assert out.dtype == x.dtype and final.dtype == torch.float32 and varlen.dtype == torch.float32
    assert rel_err(out, expected[0]) < tol
    assert rel_err(final, expected[1]) < tol
    if case.varlen:
        assert rel_err(varlen, expected[2]) < tol
    else:
        assert varlen.numel() == 0
    nchunks = -(-case.seqlen // case.chunk)
    assert chunk_states.shape == (case.batch, nchunks * case.nheads, case.headdim, case.dstate)

    for name, grad in zip(GRAD_NAMES, grads):
        given = inputs[name]
        if given is None:
            assert grad.numel() == 0, name
            continue
        assert grad.shape == given.shape and grad.dtype == given.dtype, name
        # dA and dt_bias sum da_t = sum_{l >= t} dL_l over the tokens, and Triton's dL holds terms that cancel
        # (C . dC - B . dB, and the varlen states' parts), with exponents L_l - L_s taken as differences of sums
        # over up to 64 tokens in its dB/dC passes: 3.9e-5 for dA and 6.3e-5 for dt_bias with varlen cotangents
        # and chunks of 64 (32-token blocks: 2.6e-5 and 4.1e-5; default: 1.4e-5 and 1.4e-6; on CUDA, whose sums
        # run in another order, 2.0e-5 for dA with chunks of 256 and 32-token blocks)
        bound = max(tol, 1e-4) if name in ("A", "dt_bias") and (backend == "triton" or backend.device != "cpu") \
            else tol
        assert rel_err(grad, expected_grads[name]) < bound, name


INVARIANCE_CASES = [Case(seq=SEQ), Case(batch=1, seq=(0, 10, 16, 33), varlen=True, softplus=False)]


# (Triton: the oracle cases above run it at chunk sizes 16 to 256, the drawn problems at 1 to 64)
@pytest.mark.parametrize("backend, case", backend_params(INVARIANCE_CASES, names=("default", "cpu")))
def test_chunk_size_changes_nothing_beyond_rounding(backend, case):
    inputs = make_inputs(case)
    cotangents = make_cotangents(case, inputs)
    results = []
    for chunk in (4, 16, 64):
        with ssmops.use_backend(backend):
            out, final, _, varlen, grads = run_ops(dataclasses.replace(case, chunk=chunk), inputs, cotangents)
        results.append((out, final, varlen, *grads))
    for other in results[1:]:
        for a, e in zip(other, results[0]):
            assert rel_err(a, e) < 2e-5


@pytest.mark.parametrize("backend", backend_params(names=SSD_BACKENDS, devices=GRID_DEVICES))
def test_chunk_states_are_the_states_before_each_chunk(backend):
    """Entry c*nheads + h is the recurrence's state after token c*chunk - 1, before any reset
    at the chunk's first token (the boundary at 16 is exactly a chunk edge)."""
    case = Case(seq=SEQ)
    inputs = on_device(make_inputs(case), backend.device)
    with ssmops.use_backend(backend):
        _, _, chunk_states, _, _ = torch.ops.ssmops.ssd_scan_fwd(*op_args(inputs, case))
    chunk_states = chunk_states.view(case.batch, -1, case.nheads, case.headdim, case.dstate)
    assert torch.equal(chunk_states[:, 0], inputs["initial_states"])
    for c in range(1, chunk_states.shape[1]):
        prefix = {
            k: v[:, : c * case.chunk] if k in ("x", "dt", "B", "C", "z", "seq_idx") else v for k, v in inputs.items()
        }
        _, expected = reference.ssd_scan_ref(**as_float64(prefix), **flags(case), return_final_states=True)
        assert rel_err(chunk_states[:, c], expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", backend_params(names=SSD_BACKENDS, devices=GRID_DEVICES))
def test_initial_states_reach_only_sequence_zero(backend):
    """Row 1's ids start at 1: its initial state is dropped and gets no gradient (2 chunks, a boundary
    inside each: enough, and a third of the interpreted Triton kernels of SEQ's 50 steps)."""
    case = Case(seqlen=24, seq=(0, 5, 21))
    inputs = on_device(make_inputs(case), backend.device)
    cotangents = make_cotangents(case, inputs)
    with ssmops.use_backend(backend):
        out, _, _, _, grads = run_ops(case, inputs, {**cotangents, "varlen": None})
        without = torch.ops.ssmops.ssd_scan_fwd(*op_args({**inputs, "initial_states": None}, case))[0]
    assert torch.equal(out[1], without[1]) and not torch.equal(out[0], without[0])
    dinitial = grads[-1]
    assert dinitial[1].abs().max() == 0 and dinitial[0].abs().max() > 0


@pytest.mark.parametrize("backend", backend_params(names=SSD_BACKENDS, devices=GRID_DEVICES))
def test_absent_optionals_and_dtypes(backend):
    case = Case(batch=1, seqlen=20, D=None, z=False, dt_bias=False, initial=False, dtypes="bf16")  # 2 chunks
    inputs = on_device(make_inputs(case), backend.device)
    args = op_args(inputs, case)
    with ssmops.use_backend(backend):
        out, final, chunk_states, varlen, ungated = torch.ops.ssmops.ssd_scan_fwd(*args, True)
        grads = torch.ops.ssmops.ssd_scan_bwd(*args, torch.ones_like(out), chunk_states, None, None)
    assert ungated.numel() == 0  # (no z: nothing to keep)
    dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial = grads
    assert out.dtype == torch.bfloat16 and chunk_states.dtype == torch.float32
    assert dx.dtype == ddt.dtype == dB.dtype == dC.dtype == torch.bfloat16
    assert dA.dtype == torch.float32 and dA.shape == (case.nheads,)
    assert all(g.numel() == 0 for g in (dD, dz, ddt_bias, dinitial))


@pytest.mark.parametrize("backend", backend_params(names=SSD_BACKENDS, devices=GRID_DEVICES))
def test_kept_ungated_output_is_the_output_before_the_gate(backend):
    """keep_ungated: the forward's fifth output is what it returns without z (D included, in x's dtype), the
    gated output does not change, and the backward's gradients are the same with it as without it (the
    Triton backward reads it instead of recomputing the output; the others recompute their chunks)."""
    case = Case(seqlen=24, seq=(0, 5, 21), dtypes="bf16", D="head")  # 2 chunks
    inputs = on_device(make_inputs(case), backend.device)
    args = op_args(inputs, case)
    cotangents = make_cotangents(case, inputs)
    with ssmops.use_backend(backend):
        out, final, chunk_states, _, ungated = torch.ops.ssmops.ssd_scan_fwd(*args, True)
        gated_only = torch.ops.ssmops.ssd_scan_fwd(*args)
        before_gate = torch.ops.ssmops.ssd_scan_fwd(*op_args({**inputs, "z": None}, case))[0]
        grad_args = (*args, cotangents["out"], chunk_states, cotangents["final"], None)
        with_ungated = torch.ops.ssmops.ssd_scan_bwd(*grad_args, ungated)
        recomputed = torch.ops.ssmops.ssd_scan_bwd(*grad_args)
        no_z = op_args({**inputs, "z": None}, case)
        with pytest.raises((ValueError, RuntimeError), match="ungated"):
            torch.ops.ssmops.ssd_scan_bwd(*no_z, cotangents["out"], chunk_states, None, None, ungated)
    assert ungated.dtype == out.dtype and ungated.shape == out.shape and gated_only[4].numel() == 0
    assert torch.equal(out, gated_only[0]) and torch.equal(ungated, before_gate)
    assert all(torch.equal(a, b) for a, b in zip(with_ungated, recomputed))


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))  # Triton: tests/test_triton.py
def test_bitwise_deterministic_across_runs_and_thread_counts(backend):
    case = Case(batch=2, nheads=8, seqlen=300, chunk=128, seq=(0, 100, 128, 250), dstate=8)
    inputs = make_inputs(case)
    cotangents = make_cotangents(case, inputs)
    runs = []
    for threads in (1, 1, 2):
        torch.set_num_threads(threads)
        with ssmops.use_backend(backend):
            out, final, chunk_states, varlen, grads = run_ops(case, inputs, cotangents)
        runs.append((out, final, chunk_states, varlen, *grads))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1])), "two runs differ"
    if backend == "cpu":  # its threads split (batch, head) work, never a reduction
        assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[2])), "1 and 2 threads differ"


def test_softplus_matches_mamba_threshold():
    """softplus is the identity above 20 (mamba_ssm's threshold), log1p(exp) below."""
    dt = torch.tensor([-30.0, -13.0, 0.0, 12.0, 15.0, 20.0, 20.5, 40.0])
    expected = torch.where(dt > 20, dt, torch.log1p(torch.exp(dt.double())).float())
    assert torch.equal(default.discretize_dt(dt, None, True, []), expected)
    assert torch.equal(reference._discretize_dt(dt, None, True, (0.0, INF)), expected)


# --- the public function: mamba_ssm's signature and returns ------------------------------------


def _public_kwargs(inputs: dict, case: Case) -> dict:
    return {**inputs, "chunk_size": case.chunk, **flags(case)}


def test_mamba_chunk_scan_combined_returns_like_mamba_ssm():
    case = Case(batch=1, seq=(0, 10, 16, 33), varlen=True)
    inputs = make_inputs(case)
    kw = _public_kwargs(inputs, case)
    expected_out, expected_final, expected_varlen = reference.ssd_scan_ref(
        **{k: v for k, v in kw.items() if k != "chunk_size"}, return_final_states=True, return_varlen_states=True
    )
    out = ssmops.mamba_chunk_scan_combined(**kw)
    assert isinstance(out, torch.Tensor) and rel_err(out, expected_out) < TOLERANCE[torch.float32]
    out, final = ssmops.mamba_chunk_scan_combined(**kw, return_final_states=True)
    assert rel_err(final, expected_final) < TOLERANCE[torch.float32]
    out, varlen = ssmops.mamba_chunk_scan_combined(**kw, return_varlen_states=True)
    assert rel_err(varlen, expected_varlen) < TOLERANCE[torch.float32]
    out, final, varlen = ssmops.mamba_chunk_scan_combined(**kw, return_final_states=True, return_varlen_states=True)
    assert final.shape == (1, case.nheads, case.headdim, case.dstate) and varlen.shape[0] == 4
    positional = ssmops.mamba_chunk_scan_combined(
        inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], case.chunk, inputs["D"], inputs["z"],
        inputs["dt_bias"], inputs["initial_states"], inputs["seq_idx"], None, True,
    )
    assert torch.equal(positional, out)


def test_infinite_dt_limit_clamps_like_the_reference():
    """An infinite bound travels as float32's largest value (no infinity through export); a
    finite one clamps as the reference does."""
    for limit in [(0.3, INF), (-INF, 0.5), (0.1, 0.4)]:
        case = Case(softplus=False, dt_limit=limit)
        inputs = make_inputs(case)
        out = ssmops.mamba_chunk_scan_combined(**_public_kwargs(inputs, case))
        expected = reference.ssd_scan_ref(**as_float64(inputs), **flags(case))
        assert rel_err(out, expected) < TOLERANCE[torch.float32], limit


def test_differentiable_in_every_tensor_through_final_and_varlen_states():
    case = Case(batch=1, seq=(0, 10, 16, 33), varlen=True)
    inputs = make_inputs(case)
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items() if k in GRAD_NAMES and v is not None}
    kw = {**_public_kwargs(inputs, case), **leaves}
    out, final, varlen = ssmops.mamba_chunk_scan_combined(**kw, return_final_states=True, return_varlen_states=True)
    loss = out.square().sum() + final.sum() + (varlen * 2).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    ref_kw = {k: v for k, v in {**as_float64(inputs), **ref_leaves}.items()}
    r_out, r_final, r_varlen = reference.ssd_scan_ref(
        **ref_kw, **flags(case), return_final_states=True, return_varlen_states=True
    )
    expected = torch.autograd.grad(r_out.square().sum() + r_final.sum() + (r_varlen * 2).sum(),
                                   list(ref_leaves.values()))
    for name, g, e in zip(leaves, grads, expected):
        assert rel_err(g, e) < TOLERANCE[torch.float32], name


# --- the operators' checks and opcheck ----------------------------------------------------------


def _bad(change: dict) -> dict:
    case = Case(batch=1, seq=(0, 10, 33), varlen=True)
    return {**make_inputs(case), **change}


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(x=torch.zeros(1, 50, 4)), ValueError, r"x must have shape \(batch, seqlen, nheads, headdim\)"),
        (dict(dt=torch.zeros(1, 50, 3)), ValueError, r"dt must have shape \(1, 50, 4\)"),
        (dict(A=torch.zeros(4, dtype=torch.float64)), TypeError, "A must have dtype float32"),
        (dict(B=torch.zeros(1, 50, 3, 3)), ValueError, "B has ngroups=3, which does not divide nheads=4"),
        (dict(C=torch.zeros(1, 50, 2, 5)), ValueError, r"C must have shape \(1, 50, 2, 3\)"),
        (dict(D=torch.zeros(5)), ValueError, "D must have shape"),
        (dict(z=torch.zeros(1, 49, 4, 4)), ValueError, "z must have shape"),
        (dict(initial_states=torch.zeros(1, 4, 4, 2)), ValueError, "initial_states must have shape"),
        (dict(seq_idx=torch.zeros(1, 50, dtype=torch.int64)), TypeError, "seq_idx must have dtype int32"),
        (dict(seq_idx=torch.tensor([[0] * 25 + [1] * 20 + [0] * 5], dtype=torch.int32)), ValueError,
         "seq_idx must be non-decreasing"),
        (dict(cu_seqlens=torch.tensor([0, 10, 60], dtype=torch.int32)), ValueError, "cu_seqlens must rise from 0"),
        (dict(cu_seqlens=torch.tensor([0.0, 50.0])), TypeError, "cu_seqlens must have dtype"),
        (dict(seq_idx=None), ValueError, "cu_seqlens needs seq_idx"),
        (dict(chunk_size=0), ValueError, "chunk_size must be an int >= 1"),
        (dict(x=torch.zeros(1, 50, 4, 4, device="meta")), ValueError, "must be on meta like x"),
    ],
)
def test_bad_input_raises_named_error(change, error, match):
    kw = {**_public_kwargs(_bad({}), Case()), "chunk_size": 16, **change}
    with pytest.raises(error, match=match):
        ssmops.mamba_chunk_scan_combined(**kw, return_varlen_states=True)
    # the operator checks too (the C++ library raises RuntimeError naming the argument)
    (name,) = change
    args = list(op_args({k: kw[k] for k in make_inputs(Case())}, dataclasses.replace(Case(), chunk=kw["chunk_size"])))
    with pytest.raises((error, RuntimeError), match=rf"\b{name}\b"):
        torch.ops.ssmops.ssd_scan_fwd(*args)


OPCHECK_CASES = [Case(seqlen=37, seq=SEQ), Case(batch=1, seq=(0, 10, 16, 33), varlen=True, D="head"),
                 Case(D=None, z=False, dt_bias=False, initial=False, dt_limit=(0.1, 0.6))]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck(case):
    inputs = make_inputs(case)
    args = op_args(inputs, case)
    torch.library.opcheck(torch.ops.ssmops.ssd_scan_fwd.default, args)
    grad_args = tuple(t.clone().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                      for t in args)
    torch.library.opcheck(torch.ops.ssmops.ssd_scan_fwd.default, (*grad_args, True))
    out, final, chunk_states, varlen, ungated = torch.ops.ssmops.ssd_scan_fwd(*args, True)
    cotangents = make_cotangents(case, inputs)
    grads = (*args, cotangents["out"], chunk_states, cotangents["final"], cotangents.get("varlen"))
    torch.library.opcheck(torch.ops.ssmops.ssd_scan_bwd.default, grads)
    if case.z:
        torch.library.opcheck(torch.ops.ssmops.ssd_scan_bwd.default, (*grads, ungated))


# --- deployment paths ------------------------------------------------------------------------------


def _ssd_model(full: bool):
    from models import TinySsdModel

    torch.manual_seed(0)
    return TinySsdModel(full=full).eval()


@pytest.mark.parametrize("full", [True, False], ids=["all-optionals", "no-optionals"])
def test_compile_fullgraph_dynamic_seqlen_forward_and_backward(full):
    torch._dynamo.reset()
    model = _ssd_model(full)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seqlen in (37, 100, 301):
        x = torch.randn(2, seqlen, 8, generator=torch.Generator().manual_seed(seqlen))
        x_eager, x_comp = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch._dynamo.mark_dynamic(x_comp, 1)
        y_eager, y_comp = model(x_eager), compiled(x_comp)
        assert rel_err(y_comp, y_eager) < 1e-5
        params = list(model.parameters())
        g_eager = torch.autograd.grad(y_eager.square().sum(), [x_eager, *params], materialize_grads=True)
        g_comp = torch.autograd.grad(y_comp.square().sum(), [x_comp, *params], materialize_grads=True)
        for a, b in zip(g_comp, g_eager):
            assert rel_err(a, b) < 1e-4
    # seqlen stays symbolic: no recompilation per length
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1


def _export(model, seqlen=37):
    seq = torch.export.Dim("seqlen", min=2, max=1 << 20)
    return torch.export.export(model, (torch.randn(2, seqlen, 8),), dynamic_shapes={"x": {1: seq}})


@pytest.mark.parametrize("full", [True, False], ids=["all-optionals", "no-optionals"])
def test_export_dynamic_seqlen_save_load(full, tmp_path):
    model = _ssd_model(full)
    ep = _export(model)
    (scan,) = [n for n in ep.graph.nodes if str(n.target) == "ssmops.ssd_scan_fwd.default"]
    assert scan.args[14:] in ((), (False,)), "an exported program keeps no output before the gate"
    torch.export.save(ep, tmp_path / "model.pt2")
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    for seqlen in (5, 37, 130):
        x = torch.randn(2, seqlen, 8)
        with torch.no_grad():
            assert rel_err(loaded(x), model(x)) < 1e-6
