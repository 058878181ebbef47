"""The fused decoding step of a Mamba block's mixer (`mamba_step`): every backend against the
reference, for every weight format; the states updated in place, strided or not; the checks;
opcheck; bitwise results across thread counts and concurrent callers; and the Mamba block, whose
`step` runs it on CPU, against its unfused step. Then the same for a stack of blocks
(`mamba_layers_step`), and the language model, whose decoding token runs it on CPU, against its
layer-by-layer step.

The reference (`ssmops/ops/mamba_step/reference.py`) is built from the references of the
operators it fuses (each tested in its own module) and the conv window's formula, tested here."""

from __future__ import annotations

import pytest
import torch

import ssmops
from conftest import CountOps, assert_close, backend_params, run_in_threads
from ssmops import causal_conv1d_update
from ssmops.modules import Mamba
from ssmops.modules.linear import quantize_int8
from ssmops.ops.mamba_step.reference import mamba_layers_step_ref, mamba_step_ref

WEIGHT_FORMATS = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
# (batch, d_model, d_inner, d_state, d_conv, dt_rank): mamba-130m's layer (d_inner 1536 = 64 tasks of
# the kernel's 24 rows); d_inner not a multiple of 24 and a d_state with a vector tail; the largest
# batch the module sends here (16) with a long d_state and a 2-wide conv
SHAPES = [(1, 768, 1536, 16, 4, 48), (3, 40, 100, 5, 3, 7), (16, 48, 72, 37, 2, 3)]


def step_inputs(batch, d_model, d_inner, d_state, d_conv, dt_rank, weight_dtype=torch.float32, optional=True,
                seed=0) -> list:
    """mamba_step's arguments, in order; `optional=False` leaves every optional one None."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def projection(out_features, in_features, bias):
        w, scale = randn(out_features, in_features) / in_features**0.5, None
        if weight_dtype == torch.int8:
            w, scale = quantize_int8(w)
        else:
            w = w.to(weight_dtype)
        return [w, scale, randn(out_features) if bias and optional else None]

    return [
        randn(batch, d_model), randn(batch, d_inner, d_conv), randn(batch, d_inner, d_state),
        *projection(2 * d_inner, d_model, True), randn(d_inner, d_conv) / d_conv, randn(d_inner) if optional else None,
        *projection(dt_rank + 2 * d_state, d_inner, False)[:2], *projection(d_inner, dt_rank, True),
        torch.rand(d_inner, d_state, generator=gen).mul(4).add(0.01).log(), randn(d_inner) if optional else None,
        *projection(d_model, d_inner, True),
    ]


def run_step(fn, args):
    """fn on copies of args; returns (out, conv_state, ssm_state)."""
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*args)
    return out, args[1], args[2]


def unfused_on_cpu_kernels(*args):
    """The step as the CPU kernels of the operators it fuses: the same int16 rounding of the
    activations for int8 weights as the fused kernel's."""
    ops = torch.ops.ssmops
    (h, conv_state, ssm_state, in_w, in_s, in_b, conv_w, conv_b, x_w, x_s, dt_w, dt_s, dt_b, A_log, D, out_w, out_s,
     out_b) = args
    d_inner, d_state = A_log.shape
    A = -torch.exp(A_log)
    x, z = ops.weight_only_linear(h, in_w, in_s, in_b).split(d_inner, dim=-1)
    x = causal_conv1d_update(x, conv_state, conv_w, conv_b, activation="silu")
    dt, B, C = ops.weight_only_linear(x, x_w, x_s, None).split([x_w.shape[0] - 2 * d_state, d_state, d_state], -1)
    y = ops.selective_state_update(ssm_state, x, ops.weight_only_linear(dt, dt_w, dt_s, None), A, B, C, D, z, dt_b,
                                   True)
    return ops.weight_only_linear(y, out_w, out_s, out_b)


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
@pytest.mark.parametrize("weight_dtype", WEIGHT_FORMATS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backend_matches_reference(backend, weight_dtype, shape):
    args = step_inputs(*shape, weight_dtype)
    with ssmops.use_backend(backend):
        got = run_step(torch.ops.ssmops.mamba_step, args)
    expected = run_step(mamba_step_ref, args)
    if backend == "cpu" and weight_dtype == torch.int8:
        # the kernel rounds activations to int16 for int8 weights (weight_only_linear's tests bound
        # that): here it must do exactly what the unfused CPU kernels do
        expected = run_step(unfused_on_cpu_kernels, args)
    for name, a, b in zip(("out", "conv_state", "ssm_state"), got, expected):
        assert_close(a, b, 2e-5, name)


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
def test_without_the_optional_arguments(backend):
    args = step_inputs(2, 32, 48, 8, 4, 2, optional=False)
    assert args[5] is None and args[7] is None and args[12] is None and args[14] is None
    with ssmops.use_backend(backend):
        got = run_step(torch.ops.ssmops.mamba_step, args)
    for name, a, b in zip(("out", "conv_state", "ssm_state"), got, run_step(mamba_step_ref, args)):
        assert_close(a, b, 2e-5, name)


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
def test_strided_states_are_updated_in_place(backend):
    args = step_inputs(3, 32, 48, 8, 4, 2)
    expected = run_step(mamba_step_ref, args)
    # the states as views of larger buffers, in another memory order
    conv_buffer = args[1].transpose(1, 2).contiguous()
    ssm_buffer = torch.zeros(3, 48, 16)
    ssm_buffer[..., ::2] = args[2]
    conv_state, ssm_state = conv_buffer.transpose(1, 2), ssm_buffer[..., ::2]
    with ssmops.use_backend(backend):
        out = torch.ops.ssmops.mamba_step(args[0], conv_state, ssm_state, *args[3:])
    assert_close(out, expected[0], 2e-5, "out")
    assert_close(conv_buffer.transpose(1, 2), expected[1], 2e-5, "conv_state")
    assert_close(ssm_buffer[..., ::2], expected[2], 2e-5, "ssm_state")
    assert not ssm_buffer[..., 1::2].any(), "the step wrote outside the state's view"


def test_reference_token_by_token_is_the_blocks_sequence_forward():
    """The reference's formulas, one token at a time from zero states, give the block's forward over
    the whole sequence (the causal conv and the selective scan, each tested against the design's
    formulas in its own module)."""
    torch.manual_seed(0)
    block = Mamba(d_model=16, d_state=5, d_conv=3, dt_rank=3, bias=True)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        expected = block(x)
        conv_state, ssm_state = torch.zeros(2, block.d_inner, 3), torch.zeros(2, block.d_inner, 5)
        out = [mamba_step_ref(x[:, t], conv_state, ssm_state, *block.step_parameters()) for t in range(7)]
    assert_close(torch.stack(out, dim=1), expected, 1e-5, "out")


def test_opcheck():
    for weight_dtype in WEIGHT_FORMATS:
        torch.library.opcheck(torch.ops.ssmops.mamba_step.default, step_inputs(2, 16, 24, 4, 3, 2, weight_dtype))


def _replace(index, value):
    return lambda a: [value(a[index]) if i == index else t for i, t in enumerate(a)]


@pytest.mark.parametrize(
    "change, error, match",
    [
        (_replace(0, lambda t: t.double()), TypeError, "hidden_states must have dtype float32"),
        (_replace(0, lambda t: t[0]), ValueError, r"hidden_states must have shape \(batch, d_model\)"),
        (_replace(3, lambda t: t[:-1]), ValueError, r"in_proj_weight must have shape \(2 \* d_inner, d_model\)"),
        (_replace(3, lambda t: t[:, :-1]), ValueError, r"in_proj_weight must have shape \(48, 16\)"),
        (_replace(4, lambda t: None), ValueError, "an int8 in_proj_weight needs in_proj_scale"),
        (_replace(1, lambda t: t.to(torch.bfloat16)), TypeError, "conv_state must have dtype float32"),
        (_replace(2, lambda t: t[:, :, :-1]), ValueError, r"ssm_state must have shape \(2, 24, 4\)"),
        (_replace(6, lambda t: t[:-1]), ValueError, r"conv_weight must have shape \(24, 3\)"),
        (_replace(6, lambda t: t[:, :0]), ValueError,
         r"conv_weight must have shape \(d_inner, d_conv\) with d_conv >= 1"),
        (_replace(8, lambda t: t[:8]), ValueError, r"x_proj_weight must have shape \(dt_rank \+ 2 \* d_state"),
        (_replace(10, lambda t: t[:, :1]), ValueError, r"dt_proj_weight must have shape \(24, 2\)"),
        (_replace(12, lambda t: t[:-1]), ValueError, r"dt_proj_bias must have shape \(24,\)"),
        (_replace(13, lambda t: t[:, :0]), ValueError, "A_log must have 1 <= d_state"),
        (_replace(14, lambda t: t.half()), TypeError, "D must have dtype float32"),
        (_replace(16, lambda t: t[:-1]), ValueError, r"out_proj_scale must have shape \(16,\)"),
        (_replace(15, lambda t: t.float()), ValueError, "out_proj_scale is for int8 weights only"),
    ],
)
@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
def test_errors_name_the_argument(backend, change, error, match):
    """The Python checks (the default kernel's, and the fake kernel's under torch.compile and export)
    and the C++ kernel's (a RuntimeError: the operator has no Python front end) say the same."""
    args = change(step_inputs(2, 16, 24, 4, 3, 2, torch.int8))
    with ssmops.use_backend(backend), pytest.raises(error if backend == "default" else RuntimeError, match=match):
        torch.ops.ssmops.mamba_step(*args)


# --- the Mamba block's step --------------------------------------------------------------


def _decode(block, tokens, fused: bool):
    """Steps `block` over tokens (batch, T, d_model) from zero states; returns (outs, conv_state, ssm_state)."""
    conv_state, ssm_state = block.allocate_inference_cache(tokens.shape[0], 1)
    outs = []
    for t in range(tokens.shape[1]):
        assert block.fused_step_serves(tokens[:, t:t + 1], conv_state, ssm_state) == fused
        outs.append(block.step(tokens[:, t:t + 1], conv_state, ssm_state)[0])
    return torch.cat(outs, dim=1), conv_state, ssm_state


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
def test_block_step_is_one_fused_call_on_cpu_and_matches_the_unfused_step(weights, monkeypatch):
    torch.manual_seed(0)
    block = Mamba(d_model=32, d_state=8, layer_idx=0)
    for layer in (block.in_proj, block.out_proj):
        layer.convert_weight(weights)
    tokens = torch.randn(3, 4, 32)
    with torch.no_grad():
        fused = _decode(block, tokens, fused=True)
        monkeypatch.setattr(Mamba, "fused_step_serves", lambda *args: False)
        unfused = _decode(block, tokens, fused=False)
    for name, a, b in zip(("out", "conv_state", "ssm_state"), fused, unfused):
        assert_close(a, b, 1e-5, name)


def test_block_step_unfused_where_the_operator_does_not_serve():
    block = Mamba(d_model=16, d_state=4, layer_idx=0)
    token = torch.randn(17, 1, 16)
    conv_state, ssm_state = block.allocate_inference_cache(17, 1)
    assert not block.fused_step_serves(token, conv_state, ssm_state)  # past 16 sequences: matmuls
    assert not block.fused_step_serves(token[:2], conv_state[:2].bfloat16(), ssm_state[:2])
    assert not block.fused_step_serves(token[:2], conv_state[:2], ssm_state[:2])  # autograd: parameters need grads
    with torch.no_grad():
        assert block.fused_step_serves(token[:2], conv_state[:2], ssm_state[:2])


@pytest.mark.parametrize("backend", backend_params(names=("cpu",)))
def test_bitwise_across_thread_counts_and_concurrent_callers(backend):
    """Every output value is computed by one thread whatever the split (projection rows, channels),
    and the kernel's buffers are per calling thread: 1 or 2 threads, and four Python threads calling
    at once with different shapes, give the serial results bit for bit."""
    cases = [step_inputs(b, 48, 96, 16, 4, 3, fmt, seed=i)
             for i, (b, fmt) in enumerate([(1, torch.int8), (5, torch.float32), (2, torch.bfloat16), (16, torch.int8)])]
    threads = torch.get_num_threads()
    try:
        serial = []
        for n in (1, 2):
            torch.set_num_threads(n)
            serial.append([run_step(torch.ops.ssmops.mamba_step, args) for args in cases])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*serial):
        assert all(torch.equal(a, b) for a, b in zip(one, two))
    results = run_in_threads(lambda i: run_step(torch.ops.ssmops.mamba_step, cases[i]), len(cases), repeats=5)
    for got, expected in zip(results, serial[1]):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_exported_decoding_step_records_one_call_for_all_layers():
    """A CPU export of a Mamba-1 LM's step records `mamba_layers_step` once for its layers (tests/test_deploy.py
    runs such packages in the C++ runner against eager, for each weight format)."""
    from ssmops.export import decoding_step_program
    from ssmops.models import MambaConfig, MambaLMHeadModel

    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=3, vocab_size=64, ssm_cfg={}, tie_embeddings=True))
    model.convert_weights("int8")
    ep = decoding_step_program(model, batch_size=2, max_seqlen=16)
    calls = [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "ssmops" in str(n.target)]
    assert calls == ["ssmops.mamba_layers_step.default", "ssmops.weight_only_linear.default"]  # the layers, the head


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
def test_empty_sizes(backend):
    """No sequences; and a zero-width input, from which in_proj gives its bias."""
    with ssmops.use_backend(backend):
        assert torch.ops.ssmops.mamba_step(*step_inputs(0, 16, 24, 4, 3, 2, torch.int8)).shape == (0, 16)
        args = step_inputs(2, 0, 24, 4, 3, 2)
        got = run_step(torch.ops.ssmops.mamba_step, args)
    for name, a, b in zip(("out", "conv_state", "ssm_state"), got, run_step(mamba_step_ref, args)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), name


# --- a stack of blocks: mamba_layers_step ---------------------------------------------------


def layers_inputs(layers, shape, weight_dtype=torch.float32, residual=True, optional=True, final_norm=False) -> list:
    """mamba_layers_step's arguments, in order: `layers` layers of mamba_step's `shape` (whose out_proj
    gives d_model), each drawn with its own seed, norm_eps 1e-5; with `final_norm`, a final_norm_weight."""
    per_layer = [step_inputs(*shape, weight_dtype, optional=optional, seed=i) for i in range(layers)]
    gen = torch.Generator().manual_seed(layers)
    hidden = per_layer[0][0]
    return [hidden, torch.randn(hidden.shape, generator=gen) if residual else None,
            [p[1] for p in per_layer], [p[2] for p in per_layer],
            [torch.rand(hidden.shape[1], generator=gen) + 0.5 for _ in per_layer], 1e-5,
            *([p[k] for p in per_layer] for k in range(3, 18)),
            *([torch.rand(hidden.shape[1], generator=gen) + 0.5] if final_norm else [])]


def run_layers(fn, args):
    """fn on copies of args; returns (hidden_states, residual, *conv_states, *ssm_states)."""
    def copy(a):
        return [copy(t) for t in a] if isinstance(a, list) else a.clone() if isinstance(a, torch.Tensor) else a

    args = copy(args)
    return (*fn(*args), *args[2], *args[3])


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
@pytest.mark.parametrize("weight_dtype", WEIGHT_FORMATS, ids=str)
@pytest.mark.parametrize("residual, final_norm", [(True, False), (False, False), (True, True)],
                         ids=["residual", "first", "final-norm"])
def test_layers_step_matches_reference(backend, weight_dtype, residual, final_norm):
    args = layers_inputs(3, (2, 40, 100, 5, 3, 7), weight_dtype, residual=residual, final_norm=final_norm)
    with ssmops.use_backend(backend):
        got = run_layers(torch.ops.ssmops.mamba_layers_step, args)
    tol = 2e-5
    if backend == "cpu" and weight_dtype == torch.int8:
        tol = 2e-3  # activations rounded to int16 (mamba_step's test above bounds it layer by layer, exactly)
    for i, (a, b) in enumerate(zip(got, run_layers(mamba_layers_step_ref, args), strict=True)):
        assert_close(a, b, tol, f"output {i}")


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
def test_layers_step_is_mamba_step_layer_by_layer(backend):
    """The operator against its formula written with the other operators of the same backend: per
    layer the residual add, RMSNorm (aten's) and `mamba_step`; int8 weights with the optional
    arguments left out, so the int16 rounding of the activations is the same on both sides; then the
    final norm."""
    args = layers_inputs(4, (3, 32, 48, 8, 4, 2), torch.int8, optional=False, final_norm=True)
    assert args[1] is not None and all(b is None for b in args[8])  # in_proj_bias left out
    conv_states, ssm_states = [t.clone() for t in args[2]], [t.clone() for t in args[3]]
    with ssmops.use_backend(backend):
        got = run_layers(torch.ops.ssmops.mamba_layers_step, args)
        hidden, residual = args[0], args[1]
        for i in range(4):
            residual = hidden + residual
            normed = torch.nn.functional.rms_norm(residual, (32,), args[4][i], 1e-5)
            mixer = (lst[i] for lst in args[6:21])
            hidden = torch.ops.ssmops.mamba_step(normed, conv_states[i], ssm_states[i], *mixer)
        residual = hidden + residual
        hidden = torch.nn.functional.rms_norm(residual, (32,), args[21], 1e-5)
    expected = (hidden, residual, *conv_states, *ssm_states)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert_close(a, b, 1e-5, f"output {i}")


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
def test_layers_step_empty_sizes(backend):
    """No sequences; and a zero-width residual stream, from which each out_proj gives its bias."""
    with ssmops.use_backend(backend):
        out = torch.ops.ssmops.mamba_layers_step(*layers_inputs(2, (0, 16, 24, 4, 3, 2), torch.int8))
        assert [tuple(t.shape) for t in out] == [(0, 16), (0, 16)]
        args = layers_inputs(2, (2, 0, 24, 4, 3, 2))
        got = run_layers(torch.ops.ssmops.mamba_layers_step, args)
    for i, (a, b) in enumerate(zip(got, run_layers(mamba_layers_step_ref, args), strict=True)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), f"output {i}"


def test_layers_step_opcheck():
    for weight_dtype in (torch.float32, torch.int8):
        for residual, final_norm in ((True, False), (False, False), (False, True)):
            torch.library.opcheck(torch.ops.ssmops.mamba_layers_step.default,
                                  layers_inputs(2, (2, 16, 24, 4, 3, 2), weight_dtype, residual=residual,
                                                final_norm=final_norm))


def _replace_in_list(index, layer, value):
    def change(args):
        args = list(args)
        args[index] = [value(t) if i == layer else t for i, t in enumerate(args[index])]
        return args
    return change


@pytest.mark.parametrize(
    "change, error, match",
    [
        (_replace(1, lambda t: t[:, :-1]), ValueError, r"residual must have shape \(2, 16\)"),
        (_replace(4, lambda lst: []), ValueError, "norm_weight must hold one tensor per layer, at least one"),
        (_replace(21, lambda t: t[:-1]), ValueError, r"final_norm_weight must have shape \(16,\)"),
        (_replace(3, lambda lst: lst[:1]), ValueError, r"ssm_states must hold one entry per layer \(2\), got 1"),
        (_replace(7, lambda lst: lst[:1]), ValueError, r"in_proj_scale must hold one entry per layer \(2\), got 1"),
        (_replace_in_list(4, 1, lambda t: t[:-1]), ValueError, r"layer 1: norm_weight must have shape \(16,\)"),
        (_replace_in_list(6, 1, lambda t: t[:, :-1]), ValueError,
         r"layer 1: in_proj_weight must have shape \(48, 16\)"),
        (_replace_in_list(7, 0, lambda t: None), ValueError, "layer 0: an int8 in_proj_weight needs in_proj_scale"),
        (_replace_in_list(3, 1, lambda t: t.double()), TypeError, "layer 1: ssm_state must have dtype float32"),
        (_replace_in_list(18, 1, lambda t: t[:-1]), ValueError, "layer 1: out_proj_weight must have d_model=16 output"),
    ],
)
@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
def test_layers_step_errors_name_the_argument_and_layer(backend, change, error, match):
    args = layers_inputs(2, (2, 16, 24, 4, 3, 2), torch.int8, final_norm=True)
    if "d_model=16 output" in match:  # out_proj with another width, and its scale and bias with it
        args = _replace_in_list(19, 1, lambda t: t[:-1])(_replace_in_list(20, 1, lambda t: t[:-1])(args))
    args = change(args)
    with ssmops.use_backend(backend), pytest.raises(error if backend == "default" else RuntimeError, match=match):
        torch.ops.ssmops.mamba_layers_step(*args)


def _lm(weights: str, n_layer: int = 3):
    from ssmops.models import MambaConfig, MambaLMHeadModel

    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=32, n_layer=n_layer, vocab_size=64, ssm_cfg={}))
    return model.eval().convert_weights(weights)


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
def test_lm_decoding_token_is_one_layers_call_and_matches_the_layer_by_layer_step(weights, monkeypatch):
    """generate() on CPU: every token after the prompt through one `mamba_layers_step` call; the
    scores and tokens those of the blocks stepped one by one (each a `mamba_step`)."""
    from ssmops.models.mixer_seq_simple import MixerModel

    model, prompt = _lm(weights), torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with CountOps() as ops:
        fused = model.generate(prompt, max_length=12, return_dict_in_generate=True, output_scores=True)
    assert ops.counts["ssmops.mamba_layers_step"] == 6  # the tokens after the first: one call each
    monkeypatch.setattr(MixerModel, "_layers_step_arguments", lambda *a: None)
    by_layer = model.generate(prompt, max_length=12, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(fused.sequences, by_layer.sequences)
    for a, b in zip(fused.scores, by_layer.scores, strict=True):
        assert_close(a, b, 1e-5, "logits")


def test_lm_decoding_token_applies_a_final_norm_of_another_eps_after_the_layers_call(monkeypatch):
    """norm_f with an eps of its own: `mamba_layers_step` gets no final_norm_weight and the model
    applies norm_f after the call; the tokens and scores still those of the blocks stepped one by one."""
    from ssmops.models import InferenceParams
    from ssmops.models.mixer_seq_simple import MixerModel

    model, prompt = _lm("fp32"), torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    model.backbone.norm_f.eps = 1e-3
    params = InferenceParams(max_seqlen=4, max_batch_size=2, seqlen_offset=1)
    with torch.no_grad():
        hidden = model.backbone.embedding(torch.zeros(2, 1, dtype=torch.long))
        assert model.backbone._layers_step_arguments(hidden, params, {})[-1] is None
    fused = model.generate(prompt, max_length=12, return_dict_in_generate=True, output_scores=True)
    monkeypatch.setattr(MixerModel, "_layers_step_arguments", lambda *a: None)
    by_layer = model.generate(prompt, max_length=12, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(fused.sequences, by_layer.sequences)
    for a, b in zip(fused.scores, by_layer.scores, strict=True):
        assert_close(a, b, 1e-5, "logits")


def test_lm_layer_by_layer_where_the_layers_operator_does_not_serve():
    """LayerNorm blocks, norms of different eps, and a model with gradients step layer by layer."""
    from ssmops.models import InferenceParams

    model = _lm("fp32")
    token = torch.zeros(2, 1, dtype=torch.long)
    params = InferenceParams(max_seqlen=4, max_batch_size=2, seqlen_offset=1)
    hidden = model.backbone.embedding(token)
    with torch.no_grad():
        assert model.backbone._layers_step_arguments(hidden, params, {}) is not None
        assert model.backbone._layers_step_arguments(hidden, InferenceParams(4, 2), {}) is None  # the prompt
        model.backbone.layers[1].norm.eps = 1e-3
        assert model.backbone._layers_step_arguments(hidden, params, {}) is None
        model.backbone.layers[1].norm = torch.nn.LayerNorm(32)
        assert model.backbone._layers_step_arguments(hidden, params, {}) is None
    model.backbone.layers[1].norm = model.backbone.layers[0].norm
    assert model.backbone._layers_step_arguments(hidden, params, {}) is None  # autograd
