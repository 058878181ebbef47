"""No NaN where the reference is finite, on every backend, and none before its cause (issue 45).

Gradients stay finite and match a float64 reference across the decays and steps a model meets
(strong decay, dt limits, every chunk size, one token, prime lengths): the decay between two
tokens that the causal mask drops may overflow, and a mask multiplied in turns it into NaN
(0 * inf), in the forward or in autograd's backward. And a scan is causal: a NaN or inf in one
token's input reaches no output before that token, and those outputs stay what they were
without it; all outputs are non-finite exactly where the reference's are.

The Triton backend runs CPU tensors under its interpreter (test_triton_interpreter_suite runs
this file's Triton cases so), on tiny problems; `-m slow` adds larger ones, and the `cuda` cases
run the same properties on a GPU.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ssmops
from conftest import backend_params, interpreter_examples, rel_err
from ssmops.ops.ssd.reference import ssd_scan_ref

HAS_CUDA_TRITON = torch.cuda.is_available() and ssmops.available_backends()["triton"] == "available"
CUDA = pytest.param("triton", "cuda", id="triton-cuda",
                    marks=pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs a CUDA device and Triton"))


def _targets(slow_triton: bool = False, names=("default", "cpu", "triton")) -> list:
    """(backend, device): every backend on CPU tensors (Triton's under the interpreter, marked slow
    if `slow_triton`), and Triton on CUDA tensors."""
    params = []
    for p in backend_params(names=names):
        marks = [*p.marks, *([pytest.mark.slow] if slow_triton and p.values[0] == "triton" else [])]
        params.append(pytest.param(p.values[0], "cpu", marks=marks, id=p.id))
    return params + [CUDA]


def _tiny(backend: str, device: str) -> bool:
    return backend == "triton" and device == "cpu"


def _on(kw: dict, device: str, dtype: torch.dtype | None = None) -> dict:
    """kw's tensors on device, the floating ones of dtype too when given."""
    def move(v):
        if not isinstance(v, torch.Tensor):
            return v
        return v.to(device, dtype) if dtype is not None and v.is_floating_point() else v.to(device)
    return {k: move(v) for k, v in kw.items()}


# --- the SSD scan (Mamba-2) ---------------------------------------------------------------------

CHUNKS = [16, 32, 64, 128, 256]
LENGTHS = [1, 2, 3, 17, 31, 61, 67, 127, 131, 257]  # one token, primes about the chunk sizes
LIMITS = [(0.0, math.inf), (0.05, math.inf), (1e-3, 0.1), (0.01, 2.0)]


def _inverse_softplus(dt: torch.Tensor) -> torch.Tensor:
    return torch.where(dt > 20, dt, torch.log(torch.expm1(dt)))


@st.composite
def ssd_problems(draw, tiny: bool = False, strong: bool = False, limits=LIMITS):
    """mamba_chunk_scan_combined's arguments, float32. A = -exp(U(lo, hi)) from -0.002 to -12, dt
    (after the bias and softplus) log-uniform over ranges from 1e-4 to 30, limits that cut it or not;
    `strong` keeps to strong decays and large steps. `tiny`: problems the interpreter runs quickly."""
    batch = 1 if tiny else draw(st.integers(1, 2))
    ngroups = draw(st.sampled_from([1, 2]))
    nheads = ngroups * draw(st.sampled_from([1, 2]))
    headdim = draw(st.sampled_from([4, 16]))  # 16: gradients whose product with e^87 overflows
    dstate = draw(st.sampled_from([4, 16]))
    chunk = 16 if tiny else draw(st.sampled_from(CHUNKS))
    seqlen = draw(st.sampled_from([1, 2, 17] if tiny else LENGTHS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    a_range = draw(st.sampled_from([(1.5, 2.5)] if strong else [(-6.0, -2.0), (-2.0, 0.5), (0.0, 2.0), (1.5, 2.5)]))
    dt_range = draw(st.sampled_from([(0.3, 30.0)] if strong else [(1e-4, 1e-2), (1e-3, 0.5), (0.05, 3.0), (1.0, 30.0)]))
    softplus = draw(st.booleans())

    def uniform(shape, lo, hi):
        return torch.empty(shape).uniform_(lo, hi, generator=g)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    dt = torch.exp(uniform((batch, seqlen, nheads), *map(math.log, dt_range)))
    dt_bias = randn(nheads) * 0.5 if draw(st.booleans()) else None
    dt = (_inverse_softplus(dt) if softplus else dt) - (0 if dt_bias is None else dt_bias)
    return dict(
        x=randn(batch, seqlen, nheads, headdim), dt=dt, A=-torch.exp(uniform(nheads, *a_range)),
        B=randn(batch, seqlen, ngroups, dstate), C=randn(batch, seqlen, ngroups, dstate), chunk_size=chunk,
        D=draw(st.sampled_from([None, randn(nheads), randn(nheads, headdim)])),
        z=randn(batch, seqlen, nheads, headdim) if draw(st.booleans()) else None, dt_bias=dt_bias,
        initial_states=randn(batch, nheads, headdim, dstate) if draw(st.booleans()) else None,
        dt_softplus=softplus,
        dt_limit=draw(st.sampled_from(limits)),
    )


def _ssd_gradients(kw: dict, backend: str | None, device: str) -> dict:
    """The gradients of a weighted sum of out and the final states for every tensor input: the
    backend's in float32 on device, or (backend None) the float64 reference's on CPU."""
    names = [k for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states") if kw[k] is not None]
    if backend is None:
        fn, kw = ssd_scan_ref, _on({k: v for k, v in kw.items() if k != "chunk_size"}, "cpu", torch.float64)
    else:
        fn, kw = ssmops.mamba_chunk_scan_combined, _on(kw, device)
    leaves = {k: kw[k].detach().clone().requires_grad_() for k in names}
    weights = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(1)).to(kw["x"])
    with ssmops.use_backend(backend) if backend else contextlib.nullcontext():
        out, final = fn(**{**kw, **leaves}, return_final_states=True)
        grads = torch.autograd.grad((out * weights).sum() + final.sum(), list(leaves.values()))
    return {k: g.cpu() for k, g in zip(names, grads)}


def _assert_gradients_match(kw: dict, backend: str, device: str) -> None:
    expected = _ssd_gradients(kw, None, device)
    got = _ssd_gradients(kw, backend, device)
    for name, e in expected.items():
        assert e.isfinite().all(), f"d{name}: the reference is not finite"
        assert got[name].isfinite().all(), f"d{name}: not finite"
        if name != "A":
            assert rel_err(got[name], e) <= 1e-3, f"d{name}"
    # dA sums per head terms of about x_t . dx_t that cancel (the decay of a token to itself is 1 for
    # any A), each rounded to float32: where strong decays leave dA tiny, that rounding is all of it
    # (a few % of dA on every backend), so the error is measured against that scale too (a drawn
    # problem at chunk 64 without softplus gave 1.08e-2 on the native backend; a wrong formula is O(1))
    floor = 1e-4 * (kw["x"].double() * expected["x"]).sum(-1).abs().sum((0, 1)).max()
    err = (got["A"].double() - expected["A"]).abs().max() / torch.maximum(expected["A"].abs().max(), floor)
    assert err <= 2e-2, f"dA: relative error {err:.3g}"


@pytest.mark.parametrize("backend, device", _targets())
@interpreter_examples(3)
@given(data=st.data())
def test_ssd_gradients_are_finite_and_match_the_reference(backend, device, data):
    _assert_gradients_match(data.draw(ssd_problems(tiny=_tiny(backend, device))), backend, device)


@pytest.mark.parametrize("backend, device", _targets(slow_triton=True))
@interpreter_examples(2)
@given(data=st.data())
def test_ssd_gradients_under_strong_decay_and_large_steps(backend, device, data):
    """Decays of e^-87 and less over a block: the dropped factors above the diagonal overflow."""
    _assert_gradients_match(data.draw(ssd_problems(strong=True)), backend, device)


@pytest.mark.parametrize("backend, device", _targets(slow_triton=True))
def test_ssd_gradients_finite_in_issue_45s_case(backend, device):
    """dB and dC were NaN on `default`: A = -exp(U(0, 2)), softplus, dt_limit (0.05, inf), 129 tokens in
    chunks of 64, 6 heads of 16 channels in 3 groups, dstate 64, D per head."""
    g = torch.Generator().manual_seed(0)
    kw = dict(x=torch.randn(1, 129, 6, 16, generator=g), dt=torch.randn(1, 129, 6, generator=g),
              A=-torch.exp(torch.rand(6, generator=g) * 2), B=torch.randn(1, 129, 3, 64, generator=g),
              C=torch.randn(1, 129, 3, 64, generator=g), chunk_size=64, D=torch.randn(6, generator=g), z=None,
              dt_bias=None, initial_states=None, dt_softplus=True, dt_limit=(0.05, math.inf))
    _assert_gradients_match(kw, backend, device)


@pytest.mark.parametrize("backend, device", _targets())
def test_ssd_single_token_gradients(backend, device):
    """One token and no initial state: dA is 0 exactly (the decay multiplies a zero state), and no
    rounding of terms that cancel may make it otherwise (Triton's dA was ~1e-6 here)."""
    g = torch.Generator().manual_seed(0)
    kw = dict(x=torch.randn(1, 1, 4, 8, generator=g), dt=torch.randn(1, 1, 4, generator=g),
              A=-torch.exp(torch.rand(4, generator=g) * 2), B=torch.randn(1, 1, 1, 16, generator=g),
              C=torch.randn(1, 1, 1, 16, generator=g), chunk_size=16, D=torch.randn(4, generator=g),
              z=torch.randn(1, 1, 4, 8, generator=g), dt_bias=torch.randn(4, generator=g), initial_states=None,
              dt_softplus=True, dt_limit=(0.0, math.inf))
    assert torch.equal(_ssd_gradients(kw, backend, device)["A"], torch.zeros(4))
    _assert_gradients_match(kw, backend, device)


def _poisoned(data, kw: dict, names: list[str], time_dim: int) -> tuple[dict, int]:
    """kw with a NaN or inf put into one element of one of `names` at a drawn token t; returns it and t."""
    name = data.draw(st.sampled_from([n for n in names if kw.get(n) is not None]), label="input")
    shape = kw[name].shape
    index = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]), label="value")
    poisoned = {**kw, name: kw[name].clone()}
    poisoned[name][index] = value
    return poisoned, index[time_dim]


def _assert_causal(got: tuple, clean: tuple, expected: tuple, t: int, time_dim: int) -> None:
    """got's outputs before token t are finite and clean's; got is non-finite where expected is."""
    before = got[0].narrow(time_dim, 0, t)
    assert before.isfinite().all(), "a non-finite input reached an earlier output"
    assert torch.equal(before, clean[0].narrow(time_dim, 0, t)), "a non-finite input changed an earlier output"
    for g, e in zip(got, expected):
        assert torch.equal(g.isfinite(), e.isfinite()), "non-finite where the reference is finite, or finite where not"


def _assert_ssd_causal(kw: dict, poisoned: dict, t: int, backend: str, device: str) -> None:
    def run(kw):
        with ssmops.use_backend(backend):
            return tuple(r.cpu() for r in ssmops.mamba_chunk_scan_combined(**_on(kw, device), return_final_states=True))

    ref_kw = _on({k: v for k, v in poisoned.items() if k != "chunk_size"}, "cpu", torch.float64)
    _assert_causal(run(poisoned), run(kw), ssd_scan_ref(**ref_kw, return_final_states=True), t, time_dim=1)


@pytest.mark.parametrize("backend, device", _targets())
@interpreter_examples(4)
@given(data=st.data())
def test_ssd_non_finite_input_reaches_no_earlier_output(backend, device, data):
    kw = data.draw(ssd_problems(tiny=_tiny(backend, device)))
    poisoned, t = _poisoned(data, kw, ["x", "dt", "B", "C", "z"], time_dim=1)
    _assert_ssd_causal(kw, poisoned, t, backend, device)


@pytest.mark.parametrize("backend, device", _targets())
@pytest.mark.parametrize("name, index, value, dt_limit", [
    ("x", (0, 20, 1, 2), math.nan, (0.0, math.inf)), ("dt", (0, 20, 1), math.inf, (0.0, math.inf)),
    ("B", (0, 20, 0, 3), math.nan, (0.0, math.inf)), ("dt", (0, 20, 1), math.inf, (0.05, math.inf)),
    ("dt", (0, 20, 0), -math.inf, (-math.inf, 0.5))], ids=["x-nan", "dt-inf", "B-nan", "dt-inf-low-limit",
                                                          "dt-minus-inf-high-limit"])
def test_ssd_non_finite_input_in_a_chunks_middle(backend, device, name, index, value, dt_limit):
    """Issue 45's case: a NaN at token 20 (chunk 16) made the outputs NaN from token 16, the start of its
    chunk (the block of its row products), on `default` and `cpu`. And an infinite dt under a dt_limit
    with one infinite bound: the operators carry that bound as float32's largest value, and clamped the
    infinite dt to it (finite outputs where the reference's are not)."""
    g = torch.Generator().manual_seed(0)
    kw = dict(x=torch.randn(1, 37, 2, 4, generator=g), dt=torch.rand(1, 37, 2, generator=g),
              A=-torch.rand(2, generator=g), B=torch.randn(1, 37, 1, 8, generator=g),
              C=torch.randn(1, 37, 1, 8, generator=g), chunk_size=16, dt_limit=dt_limit)
    poisoned = {**kw, name: kw[name].clone()}
    poisoned[name][index] = value
    _assert_ssd_causal(kw, poisoned, 20, backend, device)


# --- the selective scan (Mamba-1) -------------------------------------------------------------


@st.composite
def scan_problems(draw, tiny: bool = False):
    """selective_scan_fn's arguments, float32, B and C variable (per batch or per group) or constant."""
    batch = 1 if tiny else draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2]))
    dim = groups * draw(st.integers(1, 2))
    dstate = draw(st.sampled_from([1, 4, 16]))
    seqlen = draw(st.sampled_from([1, 2, 17] if tiny else LENGTHS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    # a variable B and C share their groups: (batch, dstate, seqlen) is one group
    variable = (batch, dstate, seqlen) if groups == 1 and draw(st.booleans()) else (batch, groups, dstate, seqlen)

    def bc():
        return draw(st.sampled_from([randn(dim, dstate), randn(*variable)]))

    softplus = draw(st.booleans())
    delta = torch.rand(batch, dim, seqlen, generator=g) * draw(st.sampled_from([0.01, 1.0, 20.0])) + 1e-4
    delta_bias = randn(dim) * 0.1 if draw(st.booleans()) else None
    if delta_bias is not None and not softplus:  # dt = delta + bias > 0, as in a model: dt < 0 grows the state
        delta_bias = delta_bias.abs()
    return dict(
        u=randn(batch, dim, seqlen), delta=_inverse_softplus(delta) if softplus else delta,
        A=-torch.exp(torch.empty(dim, dstate).uniform_(-4.0, 2.5, generator=g)), B=bc(), C=bc(),
        D=randn(dim) if draw(st.booleans()) else None, z=randn(batch, dim, seqlen) if draw(st.booleans()) else None,
        delta_bias=delta_bias, delta_softplus=softplus,
    )


@pytest.mark.parametrize("backend, device", _targets(names=None))
@interpreter_examples(4)
@given(data=st.data())
def test_scan_non_finite_input_reaches_no_earlier_output(backend, device, data):
    kw = data.draw(scan_problems(tiny=_tiny(backend, device)))
    # (B and C: only variable ones have a time axis)
    poisoned, t = _poisoned(data, kw, ["u", "delta", "z"] + [n for n in ("B", "C") if kw[n].dim() > 2], time_dim=-1)

    def run(kw):
        with ssmops.use_backend(backend):
            return tuple(r.cpu() for r in ssmops.selective_scan_fn(**_on(kw, device), return_last_state=True))

    expected = ssmops.selective_scan_ref(**_on(poisoned, "cpu", torch.float64), return_last_state=True)
    _assert_causal(run(poisoned), run(kw), expected, t, time_dim=-1)


# --- packed sequences: a restart selects a zero state, it does not multiply by 0 ----------------

# Three sequences in one row: tokens [0, 12), [12, 25), [25, 37). In chunks of 16 a restart falls inside
# each chunk and the second sequence carries its state across the chunks' boundary; in chunks of 32 cut into
# blocks of 8 (default) or 16 (Triton) tokens, the second sequence reaches the third's block inside a chunk.
PACKED = (0, 12, 25, 37)


@pytest.fixture(params=[16, 32], ids=["chunks", "blocks"])
def chunk_size(request, monkeypatch) -> int:
    """The chunk size, with the blocks of the backends' chunks made small for 32."""
    from ssmops.ops.ssd import default, triton as ssd_triton

    if request.param == 32:
        monkeypatch.setattr(default, "_ROW_BLOCK", 8)
        monkeypatch.setattr(ssd_triton, "SCAN_BLOCK_T", 16)
        monkeypatch.setattr(ssd_triton, "BWD_BLOCK_T", 16)
        monkeypatch.setattr(ssd_triton, "GROUP_BLOCK_T", 16)
    return request.param


def _packed(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_idx (1, length) and cu_seqlens of PACKED's sequences, cut at length."""
    bounds = [b for b in PACKED if b < length] + [length]
    seq_idx = torch.cat([torch.full((e - s,), i, dtype=torch.int32) for i, (s, e) in
                         enumerate(zip(bounds, bounds[1:]))])[None]
    return seq_idx, torch.tensor(bounds, dtype=torch.int32)


def _packed_ssd_problem() -> dict:
    g = torch.Generator().manual_seed(0)
    seq_idx, cu_seqlens = _packed(37)
    return dict(x=torch.randn(1, 37, 2, 4, generator=g), dt=torch.rand(1, 37, 2, generator=g),
                A=-torch.rand(2, generator=g) - 0.1, B=torch.randn(1, 37, 1, 8, generator=g),
                C=torch.randn(1, 37, 1, 8, generator=g), D=torch.randn(2, generator=g),
                z=torch.randn(1, 37, 2, 4, generator=g), dt_bias=torch.randn(2, generator=g) * 0.1,
                initial_states=torch.randn(1, 2, 4, 8, generator=g), seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                dt_softplus=True)


def _packed_ssd(kw: dict, backend: str, device: str, chunk_size: int, weights: torch.Tensor | None = None):
    """(out, final_states, varlen_states) of `backend` (or the reference), and with `weights` the
    gradients of (out * weights).sum() + the states' sums for x, dt, B, C, z and initial_states."""
    if backend == "reference":
        fn, kw = ssd_scan_ref, _on(kw, "cpu", torch.float64)
    else:
        fn, kw = ssmops.mamba_chunk_scan_combined, {**_on(kw, device), "chunk_size": chunk_size}
    names = ["x", "dt", "B", "C", "z", "initial_states"]
    leaves = {k: kw[k].detach().clone().requires_grad_(weights is not None) for k in names}
    with contextlib.nullcontext() if backend == "reference" else ssmops.use_backend(backend):
        results = fn(**{**kw, **leaves}, return_final_states=True, return_varlen_states=True)
        if weights is None:
            return tuple(r.detach().cpu() for r in results)
        out, final, varlen = results
        loss = (out * weights.to(out)).sum() + final.sum() + varlen.sum()
        return dict(zip(names, (g.cpu() for g in torch.autograd.grad(loss, list(leaves.values())))))


def _assert_same_finite(got: torch.Tensor, clean: torch.Tensor, what: str) -> None:
    assert got.isfinite().all(), f"{what}: a non-finite input of another sequence reached it"
    assert rel_err(got, clean) <= 1e-5, f"{what}: changed by another sequence's non-finite input"


PACKED_TARGETS = [pytest.param("reference", "cpu", id="reference"), *_targets()]
# the backward's: ~2-3 s a case under the interpreter, so marked slow there (as the other gradient sweeps)
PACKED_GRADIENT_TARGETS = [pytest.param("reference", "cpu", id="reference"), *_targets(slow_triton=True)]
# (input, index, value): in the first sequence, and in the second (which spans a chunk boundary) at a
# token of the first chunk, whose state enters the next chunk, where the third sequence starts
POISONS = [("x", (0, 5, 1, 2), math.nan), ("x", (0, 14, 0, 1), math.inf), ("dt", (0, 5, 1), math.nan),
           ("dt", (0, 14, 0), math.inf), ("B", (0, 11, 0, 3), math.nan), ("B", (0, 14, 0, 5), -math.inf),
           ("C", (0, 14, 0, 2), math.nan), ("z", (0, 5, 1, 2), math.inf)]
POISON_IDS = ["x-nan-first", "x-inf-second", "dt-nan-first", "dt-inf-second", "B-nan-first-last-token",
              "B-minus-inf-second", "C-nan-second", "z-inf-first"]


def _later(index: tuple) -> int:
    """The first token of the sequence after the one of token index[1]."""
    return next(b for b in PACKED if b > index[1])


@pytest.mark.parametrize("backend, device", PACKED_TARGETS)
@pytest.mark.parametrize("name, index, value", POISONS, ids=POISON_IDS)
def test_ssd_non_finite_input_reaches_no_later_sequence(backend, device, name, index, value, chunk_size):
    """A NaN or inf in one packed sequence (seq_idx, cu_seqlens) leaves the outputs and states of the
    later sequences of its row what they are without it: a restart selects a zero state (issue 59)."""
    kw = _packed_ssd_problem()
    poisoned = {**kw, name: kw[name].clone()}
    poisoned[name][index] = value
    start = _later(index)
    (out, final, varlen), (clean_out, clean_final, clean_varlen) = (
        _packed_ssd(k, backend, device, chunk_size) for k in (poisoned, kw))
    _assert_same_finite(out[:, start:], clean_out[:, start:], "the later sequences' outputs")
    _assert_same_finite(final, clean_final, "final_states")
    later = PACKED.index(start)
    _assert_same_finite(varlen[later:], clean_varlen[later:], "the later sequences' varlen_states")
    assert not out[:, index[1]].isfinite().all(), "the non-finite input did not reach its own token"


@pytest.mark.parametrize("backend, device", PACKED_GRADIENT_TARGETS)
@pytest.mark.parametrize("name, index, value", POISONS, ids=POISON_IDS)
def test_ssd_non_finite_input_reaches_no_other_sequences_gradients(backend, device, name, index, value, chunk_size):
    """Backward: the gradients of the other sequences' inputs (the later ones', and the earlier ones' with
    initial_states) stay what they are without one sequence's NaN or inf."""
    kw = _packed_ssd_problem()
    poisoned = {**kw, name: kw[name].clone()}
    poisoned[name][index] = value
    weights = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(1))
    got, clean = (_packed_ssd(k, backend, device, chunk_size, weights) for k in (poisoned, kw))
    start, own = _later(index), max(b for b in PACKED if b <= index[1])
    for k in ("x", "dt", "B", "C", "z"):
        _assert_same_finite(got[k][:, start:], clean[k][:, start:], f"d{k} of the later sequences")
        if own > 0:
            _assert_same_finite(got[k][:, :own], clean[k][:, :own], f"d{k} of the earlier sequences")
    if own > 0:
        _assert_same_finite(got["initial_states"], clean["initial_states"], "dinitial_states")


@pytest.mark.parametrize("backend, device", PACKED_GRADIENT_TARGETS)
@pytest.mark.parametrize("token", [30, 26, 14], ids=["third", "third-first-token", "second"])
def test_ssd_non_finite_gradient_reaches_no_earlier_sequence(backend, device, token, chunk_size):
    """Backward: a NaN in a later sequence's output gradient leaves the gradients of the earlier
    sequences' inputs (initial_states too) what they are without it."""
    kw = _packed_ssd_problem()
    weights = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(1))
    poisoned = weights.clone()
    poisoned[0, token, 1, 2] = math.nan
    got, clean = (_packed_ssd(kw, backend, device, chunk_size, w) for w in (poisoned, weights))
    start = max(b for b in PACKED if b <= token)
    for k in ("x", "dt", "B", "C", "z"):
        _assert_same_finite(got[k][:, :start], clean[k][:, :start], f"d{k} of the earlier sequences")
    _assert_same_finite(got["initial_states"], clean["initial_states"], "dinitial_states")


# The causal conv: sequences [0, 7), [7, 13), [13, 20), width 4 (a window spans three tokens back).
CONV_PACKED = (0, 7, 13, 20)


def _packed_conv(kw: dict, backend: str, device: str, weights: torch.Tensor | None = None):
    """(out, final_states) of `backend` (or the reference), or with `weights` the gradients of
    (out * weights).sum() + final_states.sum() for x and initial_states."""
    from ssmops.ops.causal_conv1d.reference import causal_conv1d_ref

    leaves = {k: kw[k].detach().clone().to(device).requires_grad_(weights is not None) for k in ("x", "initial_states")}
    args = dict(weight=kw["weight"].to(device), bias=kw["bias"].to(device), seq_idx=kw["seq_idx"].to(device), **leaves)
    if backend == "reference":
        out, final = causal_conv1d_ref(**args, silu=True)
    else:
        with ssmops.use_backend(backend):
            out, final = ssmops.causal_conv1d_fn(**args, return_final_states=True, activation="silu")
    if weights is None:
        return out.detach().cpu(), final.detach().cpu()
    grads = torch.autograd.grad((out * weights.to(out)).sum() + final.sum(), list(leaves.values()))
    return dict(zip(leaves, (g.cpu() for g in grads)))


def _packed_conv_problem() -> dict:
    g = torch.Generator().manual_seed(0)
    seq_idx = torch.cat([torch.full((e - s,), i, dtype=torch.int32)
                         for i, (s, e) in enumerate(zip(CONV_PACKED, CONV_PACKED[1:]))])[None]
    return dict(x=torch.randn(1, 4, 20, generator=g), weight=torch.randn(4, 4, generator=g),
                bias=torch.randn(4, generator=g), initial_states=torch.randn(1, 4, 3, generator=g), seq_idx=seq_idx)


CONV_TARGETS = [pytest.param("reference", "cpu", id="reference"), *_targets()]


@pytest.mark.parametrize("backend, device", CONV_TARGETS)
@pytest.mark.parametrize("token, value", [(6, math.nan), (3, math.inf), (12, -math.inf)],
                         ids=["nan-first-last-token", "inf-first", "minus-inf-second-last-token"])
def test_conv_non_finite_input_reaches_no_later_sequence(backend, device, token, value):
    """The causal conv's windows do not reach across a restart (seq_idx), non-finite values included:
    forward (the later sequences' outputs and the final states) and backward (the other sequences' dx)."""
    kw = _packed_conv_problem()
    poisoned = {**kw, "x": kw["x"].clone()}
    poisoned["x"][0, 1, token] = value
    start, own = next(b for b in CONV_PACKED if b > token), max(b for b in CONV_PACKED if b <= token)
    (out, final), (clean_out, clean_final) = (_packed_conv(k, backend, device) for k in (poisoned, kw))
    _assert_same_finite(out[..., start:], clean_out[..., start:], "the later sequences' outputs")
    _assert_same_finite(final, clean_final, "final_states")
    weights = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(1))
    got, clean = (_packed_conv(k, backend, device, weights) for k in (poisoned, kw))
    _assert_same_finite(got["x"][..., start:], clean["x"][..., start:], "dx of the later sequences")
    if own > 0:
        _assert_same_finite(got["x"][..., :own], clean["x"][..., :own], "dx of the earlier sequences")
        _assert_same_finite(got["initial_states"], clean["initial_states"], "dinitial_states")


@pytest.mark.parametrize("backend, device", CONV_TARGETS)
@pytest.mark.parametrize("token", [13, 9], ids=["third-first-token", "second"])
def test_conv_non_finite_gradient_reaches_no_earlier_sequence(backend, device, token):
    kw = _packed_conv_problem()
    weights = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(1))
    poisoned = weights.clone()
    poisoned[0, 1, token] = math.nan
    got, clean = (_packed_conv(kw, backend, device, w) for w in (poisoned, weights))
    start = max(b for b in CONV_PACKED if b <= token)
    _assert_same_finite(got["x"][..., :start], clean["x"][..., :start], "dx of the earlier sequences")
    _assert_same_finite(got["initial_states"], clean["initial_states"], "dinitial_states")
