"""The causal depthwise conv (`causal_conv1d_fn`, `causal_conv1d_update`): every backend against the
reference, forward and backward, the decoding step, the operators' checks and deployment paths, and the
causal-conv1d package's documented semantics.

The reference (`ssmops/ops/causal_conv1d/reference.py`) is itself checked against a scalar float64
transcription of the formula, and against the package's statement of it (a padded F.conv1d).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import ssmops
from conftest import GRID_DEVICES, TOLERANCES, assert_close, backend_params, benchmark_module
from ssmops._registry import interpreting
from ssmops.ops.causal_conv1d.reference import causal_conv1d_ref, causal_conv1d_update_ref


@dataclasses.dataclass(frozen=True)
class Conv:
    width: int = 4
    silu: bool = True
    bias: bool = True
    seq_idx: bool = False
    initial_states: bool = False
    channel_last: bool = False
    dtype: torch.dtype = torch.float32
    batch: int = 2
    dim: int = 5
    seqlen: int = 9
    view_of: int = 0  # channel-last x as the first dim channels of a (batch, seqlen, view_of) tensor (a projection's)

    def __str__(self):
        flags = [f"w{self.width}", "silu" if self.silu else "linear", "bias" if self.bias else "nobias",
                 "cl" if self.channel_last else "cf", str(self.dtype).removeprefix("torch.")]
        flags += [name for name in ("seq_idx", "initial_states") if getattr(self, name)]
        return "-".join(flags + ([f"view{self.view_of}"] if self.view_of else []))


CONV_CASES = [
    Conv(),
    Conv(width=2, silu=False, bias=False),
    Conv(width=3, seq_idx=True, channel_last=True),
    Conv(width=4, initial_states=True, channel_last=True),
    Conv(width=4, seq_idx=True, initial_states=True),
    Conv(width=2, initial_states=True, seq_idx=True, channel_last=True, silu=False),
    Conv(width=3, dtype=torch.bfloat16, initial_states=True),
    Conv(width=4, dtype=torch.bfloat16, seq_idx=True, channel_last=True, bias=False),
    Conv(width=4, channel_last=True, view_of=13, initial_states=True),  # Mamba-2's xBC: a slice of in_proj's output
    Conv(width=3, dtype=torch.bfloat16, channel_last=True, view_of=8, seq_idx=True),
    Conv(width=4, seqlen=2, initial_states=True),  # fewer tokens than width - 1: the final states reach the initial
]


def conv_inputs(case: Conv, device="cpu", seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=case.dtype):
        return torch.randn(*shape, generator=gen).to(dtype)

    b, d, s, w = case.batch, case.dim, case.seqlen, case.width
    x = randn(b, s, case.view_of or d)[..., :d].transpose(1, 2) if case.channel_last else randn(b, d, s)
    seq_idx = None
    if case.seq_idx:  # row 0: three sequences, the last shorter than width - 1; row 1: a restart at 1
        seq_idx = torch.tensor([[0] * (s - 5) + [1] * 3 + [2] * 2, [0] + [1] * (s - 1)], dtype=torch.int32)
    kw = dict(x=x, weight=randn(d, w), bias=randn(d) if case.bias else None, seq_idx=seq_idx,
              initial_states=randn(b, d, w - 1) if case.initial_states else None, silu=case.silu)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def scalar_conv(x, weight, bias, seq_idx, initial_states, silu):
    """The formula, one output at a time in float64 Python floats."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    out = torch.zeros(batch, dim, seqlen, dtype=torch.float64)
    for b in range(batch):
        seq = [0] * seqlen if seq_idx is None else seq_idx[b].tolist()
        for c in range(dim):
            for t in range(seqlen):
                acc = 0.0 if bias is None else float(bias[c])
                for k in range(width):
                    tau = t - (width - 1) + k
                    if tau >= 0:
                        value = float(x[b, c, tau]) if seq[tau] == seq[t] else 0.0
                    else:  # the initial states are in token 0's sequence
                        same = seq[0] == seq[t]
                        value = float(initial_states[b, c, tau + width - 1]) if initial_states is not None and same \
                            else 0.0
                    acc += float(weight[c, k]) * value
                out[b, c, t] = acc / (1.0 + torch.exp(torch.tensor(-acc, dtype=torch.float64))) if silu else acc
    return out


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_reference_is_the_formula(case):
    kw = conv_inputs(case)
    out, final = causal_conv1d_ref(**kw)
    expected = scalar_conv(**kw)
    assert_close(out.double(), expected, TOLERANCES[case.dtype], "out")
    # final states: the last width - 1 entries of cat(initial, x), those outside the last token's sequence zeroed
    init = kw["initial_states"] if kw["initial_states"] is not None else kw["x"].new_zeros(case.batch, case.dim,
                                                                                           case.width - 1)
    stream = torch.cat([init, kw["x"]], dim=-1)[..., -(case.width - 1):]
    if kw["seq_idx"] is not None:
        seq = torch.cat([kw["seq_idx"][:, :1].expand(-1, case.width - 1), kw["seq_idx"]], dim=-1)
        stream = stream * (seq[:, -(case.width - 1):] == seq[:, -1:])[:, None]
    assert torch.equal(final, stream)


def _forward_and_grads(kw: dict, fn):
    """fn's output and final states, and the gradients of a loss through both (inputs as leaves)."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in kw.items()
              if isinstance(v, torch.Tensor) and v.is_floating_point()}
    args = {**kw, **leaves}
    out, final = fn(**args)
    gen = torch.Generator().manual_seed(1)
    g_out = torch.randn(out.shape, generator=gen).to(out)
    g_final = torch.randn(final.shape, generator=gen).to(final)
    grads = torch.autograd.grad((out * g_out).sum() + (final * g_final).sum(), list(leaves.values()))
    return out, final, dict(zip(leaves, grads))


@pytest.mark.parametrize(("backend", "case"), backend_params(CONV_CASES, devices=GRID_DEVICES))
def test_backend_matches_reference(backend, case):
    kw = conv_inputs(case, backend.device)
    out_ref, final_ref, grads_ref = _forward_and_grads(kw, causal_conv1d_ref)

    def operator(x, weight, bias, seq_idx, initial_states, silu):
        return torch.ops.ssmops.causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, silu)

    with ssmops.use_backend(backend):
        out, final, grads = _forward_and_grads(kw, operator)
    tol = TOLERANCES[case.dtype]
    batch, dim, seqlen = kw["x"].shape
    assert out.stride() == ((seqlen * dim, 1, dim) if case.channel_last else (dim * seqlen, seqlen, 1))
    assert_close(out, out_ref, tol, "out")
    assert_close(final, final_ref, tol, "final_states")
    for name, grad in grads.items():
        assert_close(grad, grads_ref[name], tol, f"d{name}")
    assert grads["x"].stride() == out.stride()  # dx in x's layout too
    if case.view_of:  # (autograd's leaves above are dense copies) the operators on the strided view itself
        ops = torch.ops.ssmops
        with ssmops.use_backend(backend):
            direct, _ = ops.causal_conv1d_fwd(*kw.values())
            dx = ops.causal_conv1d_bwd(*list(kw.values())[:5], torch.ones_like(out), None, case.silu)[0]
        assert direct.stride() == out.stride() and dx.stride() == out.stride()
        assert_close(direct, out_ref, tol, "out of the view")
        with ssmops.use_backend("default"):
            expected_dx = ops.causal_conv1d_bwd(*list(kw.values())[:5], torch.ones_like(out), None, case.silu)[0]
        assert_close(dx, expected_dx, tol, "dx of the view")


@dataclasses.dataclass(frozen=True)
class Update:
    width: int
    state_len: int
    seqlen: int
    circular: bool = False
    indices: bool = False
    state_dtype: torch.dtype = torch.float32
    batch: int = 3
    dim: int = 5

    def __str__(self):
        return (f"w{self.width}-L{self.state_len}-T{self.seqlen}" + ("-circular" if self.circular else "")
                + ("-indices" if self.indices else "") + f"-{str(self.state_dtype).removeprefix('torch.')}")


UPDATE_CASES = [
    Update(4, 4, 1),  # the mixers' state: width entries
    Update(4, 3, 3, indices=True),  # width - 1 entries, rows of a cache, one of them padding
    Update(2, 6, 2, circular=True),
    Update(3, 5, 7, circular=True, indices=True, state_dtype=torch.bfloat16),  # more tokens than slots
    Update(4, 8, 1, circular=True),
]


def update_inputs(case: Update, device="cpu") -> dict:
    gen = torch.Generator().manual_seed(2)
    cache = case.batch + 2 if case.indices else case.batch
    kw = dict(
        x=torch.randn(case.batch, case.dim, case.seqlen, generator=gen),
        conv_state=torch.randn(cache, case.dim, case.state_len, generator=gen).to(case.state_dtype),
        weight=torch.randn(case.dim, case.width, generator=gen), bias=torch.randn(case.dim, generator=gen),
        cache_seqlens=torch.tensor([0, 2, 9], dtype=torch.int32) if case.circular else None,
        conv_state_indices=torch.tensor([4, -1, 1], dtype=torch.int32) if case.indices else None,
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


@pytest.mark.parametrize(("backend", "case"), backend_params(UPDATE_CASES, devices=GRID_DEVICES))
def test_update_matches_reference(backend, case):
    kw = update_inputs(case, backend.device)
    expected_state = kw["conv_state"].clone()
    expected = causal_conv1d_update_ref(kw["x"], expected_state, kw["weight"], kw["bias"], True, kw["cache_seqlens"],
                                        kw["conv_state_indices"])
    with ssmops.use_backend(backend):
        out = ssmops.causal_conv1d_update(**kw, activation="silu")
    assert_close(out, expected, TOLERANCES[torch.float32], "out")
    assert_close(kw["conv_state"], expected_state, TOLERANCES[case.state_dtype], "conv_state")


@pytest.mark.skipif(not (interpreting() and ssmops.available_backends()["triton"] == "available"),
                    reason="runs the Triton kernels under TRITON_INTERPRET=1 (see test_triton_interpreter_suite)")
@pytest.mark.parametrize("case", UPDATE_CASES, ids=str)
def test_triton_direct_eager_update_matches_reference(case, monkeypatch):
    """In eager mode on a GPU the front end calls the Triton launcher itself, not the operator (`call_step`): here
    CPU tensors take the GPU route and the operators are out of reach, so the interpreted kernel runs through the
    direct route alone, its plan of the first call reused by the second, in and outside inference mode.
    (Launches, copies and the state's version: tests/test_triton.py's test_triton_eager_step_is_one_direct_launch.)"""
    import ssmops._registry as registry

    monkeypatch.setattr(registry, "GPU_DEVICES", (*registry.GPU_DEVICES, "cpu"))

    def unreachable(*args, **kwargs):
        raise AssertionError("the eager step went through an operator")

    monkeypatch.setattr(registry, "operator_for", unreachable)
    kw = update_inputs(case)
    for inference in (False, True):
        with torch.inference_mode(inference):
            state, expected_state = kw["conv_state"].clone(), kw["conv_state"].clone()
            expected = causal_conv1d_update_ref(kw["x"], expected_state, kw["weight"], kw["bias"], True,
                                                kw["cache_seqlens"], kw["conv_state_indices"])
            for _ in range(2):  # the second call reuses the first's plan: the same result from the same state
                got_state = state.clone()
                out = ssmops.causal_conv1d_update(**{**kw, "conv_state": got_state}, activation="silu")
                assert_close(out, expected, TOLERANCES[torch.float32], "out")
                assert_close(got_state, expected_state, TOLERANCES[case.state_dtype], "conv_state")


def test_decoding_token_by_token_continues_the_sequence():
    """The conv over a whole sequence equals its first part's forward, then the update token by token from
    the first part's final states (in a state of width entries, and in a circular one)."""
    case = Conv(width=4, seqlen=10)
    kw = conv_inputs(case)
    whole = ssmops.causal_conv1d_fn(kw["x"], kw["weight"], kw["bias"], activation="silu")
    head, final = ssmops.causal_conv1d_fn(kw["x"][..., :6], kw["weight"], kw["bias"], return_final_states=True,
                                          activation="silu")
    shifted = F.pad(final, (1, 0))  # (batch, dim, width): the mixers' state
    ring = torch.zeros(case.batch, case.dim, 5)
    for j, p in enumerate(range(3, 6)):  # stream positions 3..5 (the final states) in their slots of a 5-slot ring
        ring[..., p % 5] = final[..., j]
    steps, steps_ring = [], []
    for t in range(6, 10):
        steps.append(ssmops.causal_conv1d_update(kw["x"][..., t], shifted, kw["weight"], kw["bias"], "silu"))
        steps_ring.append(ssmops.causal_conv1d_update(kw["x"][..., t], ring, kw["weight"], kw["bias"], "silu",
                                                      cache_seqlens=torch.full((case.batch,), t, dtype=torch.int32)))
    torch.testing.assert_close(head, whole[..., :6])
    torch.testing.assert_close(torch.stack(steps, -1), whole[..., 6:])
    torch.testing.assert_close(torch.stack(steps_ring, -1), whole[..., 6:])


# --- the operators' registrations and deployment -------------------------------------------------


def _fwd_args(case: Conv) -> tuple:
    kw = conv_inputs(case)
    return tuple(kw.values())


@pytest.mark.parametrize("case", [Conv(seq_idx=True, initial_states=True), Conv(width=2, channel_last=True,
                                                                                  bias=False, silu=False)], ids=str)
def test_opcheck(case):
    args = _fwd_args(case)
    torch.library.opcheck(torch.ops.ssmops.causal_conv1d_fwd.default, args)
    x, weight, bias, seq_idx, initial_states, silu = args
    dout, dfinal = torch.randn_like(x), torch.randn(case.batch, case.dim, case.width - 1)
    torch.library.opcheck(torch.ops.ssmops.causal_conv1d_bwd.default,
                          (x, weight, bias, seq_idx, initial_states, dout, dfinal, silu))


@pytest.mark.parametrize("case", [Update(4, 4, 1), Update(3, 5, 2, circular=True, indices=True)], ids=str)
def test_update_opcheck(case):
    kw = update_inputs(case)
    torch.library.opcheck(torch.ops.ssmops.causal_conv1d_update.default, (*kw.values(), True))


class _Conv(torch.nn.Module):
    """A conv over a channel-last x, as Mamba-2's mixer calls it: (batch, seqlen, dim) in and out."""

    def __init__(self, dim=5, width=4):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim, width))
        self.bias = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x, seq_idx):
        return ssmops.causal_conv1d_fn(x.transpose(1, 2), self.weight, self.bias, seq_idx,
                                       activation="silu").transpose(1, 2) * 2


def test_compiles_with_dynamic_seqlen_and_exports():
    torch.manual_seed(0)
    model = _Conv()
    x = torch.randn(2, 9, 5, requires_grad=True)
    seq_idx = torch.tensor([[0] * 4 + [1] * 5] * 2, dtype=torch.int32)
    expected = model(x, seq_idx)
    expected_grads = torch.autograd.grad(expected.square().sum(), [x, *model.parameters()])
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for seqlen in (9, 12):  # a second length reuses the graph (symbolic seqlen)
        xs = torch.randn(2, seqlen, 5, requires_grad=True) if seqlen != 9 else x
        idx = torch.zeros(2, seqlen, dtype=torch.int32) if seqlen != 9 else seq_idx
        out = compiled(xs, idx)
        grads = torch.autograd.grad(out.square().sum(), [xs, *model.parameters()])
        if seqlen == 9:
            torch.testing.assert_close(out, expected)
            for got, want in zip(grads, expected_grads):
                torch.testing.assert_close(got, want)
        else:
            torch.testing.assert_close(out, model(xs, idx))

    seqlen = torch.export.Dim("seqlen", min=2, max=64)
    ep = torch.export.export(model, (x.detach(), seq_idx), dynamic_shapes=({1: seqlen}, {1: seqlen}))
    assert "causal_conv1d_fwd" in str(ep.graph)
    longer, longer_idx = torch.randn(2, 20, 5), torch.zeros(2, 20, dtype=torch.int32)
    torch.testing.assert_close(ep.module()(longer, longer_idx), model(longer, longer_idx))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(x=torch.zeros(2, 5)), ValueError, r"x must have shape \(batch, dim, seqlen\)"),
        (dict(x=torch.zeros(2, 5, 9, dtype=torch.float64)), TypeError, "x must have dtype float32"),
        (dict(weight=torch.zeros(6, 4)), ValueError, r"weight must have shape \(dim, width\) with dim=5"),
        (dict(bias=torch.zeros(4)), ValueError, r"bias must have shape \(5,\)"),
        (dict(seq_idx=torch.zeros(2, 8, dtype=torch.int32)), ValueError, r"seq_idx must have shape \(2, 9\)"),
        (dict(seq_idx=torch.zeros(2, 9)), TypeError, "seq_idx must have dtype int32 or int64"),
        (dict(initial_states=torch.zeros(2, 5, 4)), ValueError, r"initial_states must have shape \(2, 5, 3\)"),
        (dict(initial_states=torch.zeros(2, 5, 3, dtype=torch.bfloat16)), TypeError,
         "initial_states must have dtype float32"),
    ],
)
def test_errors_name_the_argument(change, error, match):
    kw = {**conv_inputs(Conv()), **change}
    kw.pop("silu")
    with pytest.raises(error, match=match):
        ssmops.causal_conv1d_fn(**kw, activation="silu")
    # the operator checks too (the C++ checks raise RuntimeError, in the same words)
    (name,) = change
    with pytest.raises((error, RuntimeError), match=rf"\b{name}\b"):
        torch.ops.ssmops.causal_conv1d_fwd(*kw.values(), True)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(conv_state=torch.zeros(3, 5, 2)), ValueError, r"state_len >= width - 1 = 3"),
        (dict(conv_state=torch.zeros(4, 5, 4)), ValueError, "conv_state must have batch 3 like x"),
        (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32)), ValueError, r"cache_seqlens must have shape \(3,\)"),
        (dict(conv_state_indices=torch.tensor([0, 1, 3])), ValueError, "conv_state_indices must be < the"),
    ],
)
def test_update_errors_name_the_argument(change, error, match):
    kw = {**update_inputs(Update(4, 4, 1)), **change}
    with pytest.raises(error, match=match):
        ssmops.causal_conv1d_update(**kw)
    (name,) = change
    with pytest.raises((error, RuntimeError), match=rf"\b{name}\b"):
        torch.ops.ssmops.causal_conv1d_update(*kw.values(), False)


@pytest.mark.parametrize("backend", backend_params(names=("default", "triton")))
def test_index_past_the_cache_is_padding_while_a_cuda_graph_is_captured(backend, monkeypatch):
    """While a CUDA graph is captured the indices cannot be read back to check them (a server capturing its
    decoding step): an index past the cache is then padding, nothing written outside it and out = 0, on the
    backends a GPU runs. The capture is simulated: `_checks.capturing` answers yes for the CPU tensors here."""
    from ssmops.ops import _checks

    kw = update_inputs(Update(4, 3, 3, indices=True))  # a cache of 5 rows, indices [4, -1, 1]
    padded = {**kw, "conv_state": kw["conv_state"].clone(),
              "conv_state_indices": torch.tensor([4, -1, -1], dtype=torch.int32)}
    past = {**kw, "conv_state": kw["conv_state"].clone(),
            "conv_state_indices": torch.tensor([4, -1, 5], dtype=torch.int32)}
    monkeypatch.setattr(_checks, "capturing", lambda device: True)
    with ssmops.use_backend(backend):
        expected = ssmops.causal_conv1d_update(**padded, activation="silu")
        out = ssmops.causal_conv1d_update(**past, activation="silu")
    assert torch.equal(out, expected) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.equal(past["conv_state"], padded["conv_state"])


def test_activation_must_be_silu_swish_or_none():
    kw = conv_inputs(Conv())
    with pytest.raises(ValueError, match="activation must be None, 'silu' or 'swish', got 'relu'"):
        ssmops.causal_conv1d_fn(kw["x"], kw["weight"], activation="relu")


# --- the causal-conv1d package's documented semantics ----------------------------------------------


@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_package_semantics(width, activation):
    """As the package documents its functions (causal_conv1d_interface.py's references): the conv is a
    depthwise F.conv1d padded by width - 1 on the left (or with the initial states in front) and cut to
    seqlen; the final states are the last width - 1 inputs; the update concatenates the state and x, keeps
    the last state_len entries as the new state, and returns the conv's last seqlen outputs."""
    gen = torch.Generator().manual_seed(width)
    batch, dim, seqlen = 2, 6, 7
    x = torch.randn(batch, seqlen, dim, generator=gen).transpose(1, 2)  # the package's channel-last layout
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    init = torch.randn(batch, dim, width - 1, generator=gen)
    act = (lambda v: v) if activation is None else F.silu

    out = ssmops.causal_conv1d_fn(x, weight, bias, activation=activation)
    torch.testing.assert_close(out, act(F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)
                                        [..., :seqlen]))
    final_out = torch.empty(batch, width - 1, dim).transpose(1, 2)
    out, final = ssmops.causal_conv1d_fn(x, weight, bias, initial_states=init, return_final_states=True,
                                         final_states_out=final_out, activation=activation)
    stream = torch.cat([init, x], dim=-1)
    torch.testing.assert_close(out, act(F.conv1d(stream, weight.unsqueeze(1), bias, groups=dim)))
    assert final is final_out
    torch.testing.assert_close(final_out, stream[..., -(width - 1):])

    state = torch.randn(batch, dim, width + 1, generator=gen)
    expected_window = torch.cat([state, x[..., :3]], dim=-1)
    expected = act(F.conv1d(expected_window, weight.unsqueeze(1), bias, groups=dim))[..., -3:]
    out = ssmops.causal_conv1d_update(x[..., :3], state, weight, bias, activation)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state, expected_window[..., -(width + 1):])
    one = ssmops.causal_conv1d_update(x[..., 3], state, weight, bias, activation)  # (batch, dim): one token
    assert one.shape == (batch, dim)


# --- the Triton operators themselves (under TRITON_INTERPRET=1 on CPU) ------------------------------


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(ssmops.available_backends()["triton"] != "available" or (TRITON_DEVICE == "cpu"
                                                                              and not interpreting()),
                    reason="needs the Triton backend: a GPU, or TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("case", [Conv(seq_idx=True, initial_states=True, channel_last=True),
                                  Conv(width=3, bias=False, silu=False)], ids=str)
def test_triton_opcheck(case):
    """The Triton operators (`*_triton`, what compiled graphs launch) with the main operators' fakes and
    autograd; the backward and the step without AOTAutograd's extra runs of their kernels."""
    args = tuple(conv_inputs(case, TRITON_DEVICE).values())
    ops = torch.ops.ssmops
    torch.library.opcheck(ops.causal_conv1d_fwd_triton.default, args)
    x, weight, bias, seq_idx, initial_states, silu = args
    bwd_args = (x, weight, bias, seq_idx, initial_states, torch.randn_like(x),
                torch.randn(case.batch, case.dim, case.width - 1, device=x.device), silu)
    no_autograd = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.causal_conv1d_bwd_triton.default, bwd_args, test_utils=no_autograd)
    kw = update_inputs(Update(case.width, case.width, 2, circular=True, indices=True), x.device)
    torch.library.opcheck(ops.causal_conv1d_update_triton.default, (*kw.values(), silu), test_utils=no_autograd)


def _recorded_conv_launches(case: Conv) -> list:
    """(kernel, args, meta, inputs) of the conv's forward, backward and decoding-step launches."""
    aot = benchmark_module("triton_aot")
    from ssmops.ops.causal_conv1d import triton as conv_triton

    args = _fwd_args(case)
    x, weight, bias, seq_idx, initial_states, silu = args
    with aot.recorded_launches() as launches:
        conv_triton.causal_conv1d_fwd(*args)
        conv_triton.causal_conv1d_bwd(x, weight, bias, seq_idx, initial_states, torch.ones_like(x),
                                      torch.ones(case.batch, case.dim, case.width - 1, dtype=case.dtype), silu)
    recorded = [(*launch, args) for launch in launches]
    kw = update_inputs(Update(case.width, case.width, 1, circular=True, indices=True, dim=case.dim))
    with aot.recorded_launches() as launches:
        conv_triton.causal_conv1d_update(*kw.values(), silu)
    return recorded + [(*launches[0], tuple(v for k, v in kw.items() if k != "conv_state"))]


# Mamba-2 2.7b's xBC (conv_dim 5376) channel-last in bf16, as its mixer passes it; and a channel-first fp32 x with
# every optional input
COMPILE_CASES = [Conv(dtype=torch.bfloat16, channel_last=True, batch=1, dim=5376, seqlen=512),
                 Conv(width=3, seq_idx=True, initial_states=True, batch=2, dim=64, seqlen=40)]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(interpreting(), reason="compiles the JIT kernels, which the interpreter replaces")
@pytest.mark.parametrize("case", COMPILE_CASES, ids=str)
def test_conv_kernels_compile_for_sm90_without_spills(case):
    """Each launch compiled for an H100 (no GPU needed): no register spills. (What each writes:
    tests/test_triton.py's test_triton_kernels_write_only_flat_buffers_of_their_own, for every family.)"""
    aot = benchmark_module("triton_aot")

    names = []
    for kernel, args, meta, _ in _recorded_conv_launches(case):
        usage = aot.resource_usage(aot.compile_launch(kernel, args, meta, "sm90"))
        assert usage["spills"] == 0, (kernel.__name__, usage)
        names.append(kernel.__name__)
    assert names == ["causal_conv1d_fwd_kernel", "causal_conv1d_dpre_kernel", "causal_conv1d_dstream_kernel",
                     "causal_conv1d_update_kernel"]


def test_compat_extension_takes_and_returns_what_the_package_s_does():
    """`ssmops.compat.causal_conv1d_cuda`, for code that calls the package's extension (mamba_ssm's
    mamba_inner_fn does): its forward, backward and update give what the front end and autograd give."""
    from ssmops.compat import causal_conv1d_cuda

    kw = conv_inputs(Conv(initial_states=True, channel_last=True))
    x, weight, bias, _, initial_states, _ = kw.values()
    final_out = torch.empty(2, 5, 3)
    out = causal_conv1d_cuda.causal_conv1d_fwd(x, weight, bias, None, initial_states, final_out, True)
    expected, final = ssmops.causal_conv1d_fn(x, weight, bias, None, initial_states, True, activation="silu")
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(final_out, final)

    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias, initial_states)]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(ssmops.causal_conv1d_fn(leaves[0], leaves[1], leaves[2], None, leaves[3],
                                                        activation="silu"), leaves, dout)
    dx = torch.empty_like(x)
    got = causal_conv1d_cuda.causal_conv1d_bwd(x, weight, bias, dout, None, initial_states, None, dx, True, True)
    assert got[0] is dx
    for g, e in zip(got, grads):
        torch.testing.assert_close(g, e)
    assert causal_conv1d_cuda.causal_conv1d_bwd(x, weight, None, dout, None, None, None, None, False, True)[2:] == \
        [None, None]

    update = update_inputs(Update(4, 4, 2))
    state = update["conv_state"].clone()
    out = causal_conv1d_cuda.causal_conv1d_update(update["x"], state, update["weight"], update["bias"], False, None,
                                                  None)
    expected = ssmops.causal_conv1d_update(**update)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state, update["conv_state"])
