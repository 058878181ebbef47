"""Decoding at the weights' read bandwidth: weight formats for inference (`convert_weights`,
`from_pretrained(..., weights=...)`) and the compiled one-token step (`generate(..., cg=True)`).

The weight formats are checked on a model trained here on a task with one right answer (count up
by one), so that greedy decoding has clear margins: every format must give fp32's tokens, and its
logits within a bound that says how much the format loses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssmops.models import MambaLMHeadModel
from conftest import CountOps
from ssmops.modules.linear import Linear
from test_models import tiny_config, train
from test_models_mamba2 import tiny_model as tiny_mamba2_model

VOCAB = 16


@pytest.fixture(scope="module")
def counting_model():
    """A 2-layer Mamba LM trained to continue t, t+1, t+2, ... (mod 16)."""
    torch.manual_seed(0)
    model = MambaLMHeadModel(tiny_config(vocab_size=VOCAB))
    gen = torch.Generator().manual_seed(0)

    def loss_of_batch():
        ids = (torch.randint(0, VOCAB, (16, 1), generator=gen) + torch.arange(12)) % VOCAB
        logits = model(ids[:, :-1]).logits[..., :VOCAB]
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    train(model, loss_of_batch, steps=80)
    return model.eval()


def _counting_prompts():
    return (torch.tensor([[3], [9]]) + torch.arange(4)) % VOCAB


def test_the_counting_model_counts(counting_model):
    out = counting_model.generate(_counting_prompts(), max_length=16, vocab_size=VOCAB)
    expected = (out[:, :1] + torch.arange(16)) % VOCAB
    assert torch.equal(out, expected)


# largest relative logits error each format may add (bf16/fp16 weights: 8/11-bit mantissas; int8: 127 levels a row)
LOGIT_TOLERANCE = {"bf16": 2e-2, "fp16": 3e-3, "int8": 3e-2}


@pytest.mark.parametrize("weights", list(LOGIT_TOLERANCE))
def test_weight_formats_give_fp32s_greedy_tokens(counting_model, weights, tmp_path):
    counting_model.save_pretrained(tmp_path)
    converted = MambaLMHeadModel.from_pretrained(tmp_path, weights=weights).eval()
    prompts = _counting_prompts()
    expected = counting_model.generate(prompts, max_length=16, vocab_size=VOCAB)
    assert torch.equal(converted.generate(prompts, max_length=16, vocab_size=VOCAB), expected)
    with torch.no_grad():
        ref, got = counting_model(expected).logits, converted(expected).logits
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < LOGIT_TOLERANCE[weights], f"{weights}: relative logits error {err:.2e}"
    assert err > 0  # the weights did change


def test_convert_weights_converts_the_projections_only():
    model = tiny_mamba2_model("hybrid")
    embedding = model.backbone.embedding.weight
    assert model.lm_head.weight is embedding
    model.convert_weights("int8")
    assert model.lm_head.weight is not embedding and embedding.dtype == torch.float32
    converted = {name for name, m in model.named_modules() if isinstance(m, Linear) and m.weight.dtype == torch.int8}
    assert "lm_head" in converted
    layers = "backbone.layers"
    assert {f"{layers}.0.mixer.in_proj", f"{layers}.1.mixer.out_proj", f"{layers}.1.mlp.fc1"} <= converted
    assert model.state_dict()["lm_head.weight_scale"].shape == (model.config.padded_vocab_size,)
    caches = model.allocate_inference_cache(2, 8)
    assert all(t.dtype == torch.float32 for states in caches.values() for t in states if t is not None)
    mamba1 = MambaLMHeadModel(tiny_config()).convert_weights("bf16")
    mixer = mamba1.backbone.layers[0].mixer
    assert mixer.in_proj.weight.dtype == mixer.x_proj.weight.dtype == mixer.dt_proj.weight.dtype == torch.bfloat16
    # the decoding state keeps the model's dtype, not the converted dt_proj's (mamba_ssm's rule)
    assert mixer.allocate_inference_cache(1, 8)[1].dtype == torch.float32
    with pytest.raises(ValueError, match="weights must be one of"):
        mamba1.convert_weights("int4")
    mamba1.convert_weights("int8")  # from bf16: the activations stay float32
    assert mixer.in_proj.weight.dtype == torch.int8 and mixer.in_proj.compute_dtype == torch.float32
    with pytest.raises(ValueError, match="the weight is int8 already"):
        mamba1.convert_weights("bf16")


def test_keep_float_keeps_the_named_layers_in_the_models_dtype():
    model = MambaLMHeadModel(tiny_config()).convert_weights("int8", keep_float=("x_proj", "mixer.dt_proj", "lm_head"))
    dtypes = {name: m.weight.dtype for name, m in model.named_modules() if isinstance(m, Linear)}
    kept = {name for name, dtype in dtypes.items() if dtype == torch.float32}
    assert kept == {"lm_head"} | {f"backbone.layers.{i}.mixer.{p}" for i in (0, 1) for p in ("x_proj", "dt_proj")}
    assert model.lm_head.weight is model.backbone.embedding.weight  # still tied: nothing converted it
    assert all(dtypes[f"backbone.layers.{i}.mixer.{p}"] == torch.int8 for i in (0, 1) for p in ("in_proj", "out_proj"))
    with pytest.raises(ValueError, match=r"keep_float names no linear layer of the model: 'xproj'"):
        MambaLMHeadModel(tiny_config()).convert_weights("int8", keep_float="xproj")


def test_a_converted_state_dict_is_refused_by_name(tmp_path):
    model = MambaLMHeadModel(tiny_config()).convert_weights("int8")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds int8 weights written after convert_weights \(backbone"):
        MambaLMHeadModel.from_pretrained(tmp_path)


@pytest.mark.slow  # a hybrid's compile (a Mamba-1 LM's compiled steps: the next test, not slow)
def test_compiled_step_generates_the_eager_tokens(monkeypatch):
    """cg=True: every token after the prompt from one compiled graph, caches advanced in place (on
    CPU, its kernels and operators called from inductor's C++ wrapper), for the hybrid LM, whose
    Mamba-2 layers are a Mamba-2 LM's (a compile of each costs ~25 s on 2 cores)."""
    monkeypatch.setattr(MambaLMHeadModel, "decoding_step", lambda *args: None)
    model = tiny_mamba2_model("hybrid")
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    eager = model.generate(prompt, max_length=14, return_dict_in_generate=True, output_scores=True)
    compiled = model.generate(prompt, max_length=14, cg=True, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.scores), torch.stack(eager.scores), rtol=1e-5, atol=1e-5)


def test_compiled_steps_of_models_and_batch_sizes_taking_turns_keep_their_own_tokens(monkeypatch):
    """cg=True for Mamba-1 LMs, compiled as any other model would be (on CPU they decode through their own
    step otherwise): the compiled step's guards are evaluated on each generation's first token only, and
    models and batch sizes that take turns still each decode their own eager tokens."""
    monkeypatch.setattr(MambaLMHeadModel, "decoding_step", lambda *args: None)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(MambaLMHeadModel(tiny_config()).eval())
    gen = torch.Generator().manual_seed(2)
    for batch in (2, 1, 2):
        for model in models:
            prompt = torch.randint(0, 61, (batch, 5), generator=gen)
            eager = model.generate(prompt, max_length=10, return_dict_in_generate=True, output_scores=True)
            compiled = model.generate(prompt, max_length=10, cg=True, return_dict_in_generate=True,
                                      output_scores=True)
            assert torch.equal(compiled.sequences, eager.sequences)
            torch.testing.assert_close(torch.stack(compiled.scores), torch.stack(eager.scores), rtol=1e-5,
                                       atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")
@pytest.mark.parametrize("name", ["mamba1", "hybrid"])
def test_cuda_graph_step_generates_the_eager_tokens(name):
    """cg=True on CUDA: the one-token step captured in a CUDA graph (mamba_ssm's cg=True; generation's
    cuda_graph_step) gives the eager tokens and scores, for a generation after another (the caches the
    capture's warm-up runs advance are restored), for a Mamba-1 LM and a hybrid, at two batch sizes."""
    model = (MambaLMHeadModel(tiny_config()).eval() if name == "mamba1" else tiny_mamba2_model("hybrid")).cuda()
    gen = torch.Generator().manual_seed(1)
    for batch in (2, 1, 2):
        prompt = torch.randint(0, 61, (batch, 5), generator=gen).cuda()
        eager = model.generate(prompt, max_length=12, return_dict_in_generate=True, output_scores=True)
        graphed = model.generate(prompt, max_length=12, cg=True, return_dict_in_generate=True, output_scores=True)
        assert torch.equal(graphed.sequences, eager.sequences)
        torch.testing.assert_close(torch.stack(graphed.scores), torch.stack(eager.scores), rtol=1e-5, atol=1e-5)


def test_cuda_graph_step_restores_the_caches_and_falls_back_where_capture_fails(monkeypatch):
    """cg=True on CUDA (generation.cuda_graph_step), its bookkeeping on the CPU with torch.cuda's streams and
    graphs stood in for: the capture's warm-up runs advance the caches, which are restored when the capture fails
    (e.g. a step that reads a value on the host); token_step then warns and compiles the step, as on other
    devices."""
    import contextlib

    from ssmops.models import generation

    class Stream:
        def wait_stream(self, other):
            pass

    def failing_capture(graph):
        raise RuntimeError("operation not permitted when stream is capturing")

    for name, value in dict(Stream=lambda device: Stream(), current_stream=lambda device: Stream(),
                            stream=lambda s: contextlib.nullcontext(), CUDAGraph=object, graph=failing_capture).items():
        monkeypatch.setattr(torch.cuda, name, value)
    memory = {0: (torch.randn(2, 3), torch.randn(2, 4)), 1: (torch.randn(2, 3), None)}
    before = {layer: tuple(None if t is None else t.clone() for t in states) for layer, states in memory.items()}

    def step(input_ids, positions):  # advances every cache, as a decoding step does
        for states in memory.values():
            for t in states:
                if t is not None:
                    t.add_(1.0)
        return torch.zeros(2, 5)

    with pytest.raises(RuntimeError, match="capturing"):
        generation.cuda_graph_step(step, memory, 2, torch.device("cpu"))
    for layer, states in memory.items():
        for got, want in zip(states, before[layer]):
            assert (got is None and want is None) or torch.equal(got, want)
    monkeypatch.setattr(MambaLMHeadModel, "decoding_step", lambda *args: None)
    monkeypatch.setattr(generation, "cuda_graph_step", lambda *args: failing_capture(None))  # (no CUDA tensors here)
    monkeypatch.setattr(generation, "compiled_step_logits", lambda device: lambda *args: "compiled")
    with pytest.warns(UserWarning, match="could not be captured in a CUDA graph"):
        fallback, compiled = generation.token_step(MambaLMHeadModel(tiny_config()).eval(), memory, 2, "cuda", True)
    assert compiled and fallback(None, None) == "compiled"


@pytest.mark.slow
def test_compiled_step_under_inductors_python_wrapper(monkeypatch):
    """On CPU, cg=True compiles the step with inductor's cpp_wrapper (the test above);
    TORCHINDUCTOR_CPP_WRAPPER=0 keeps its Python wrapper, which gives the eager tokens too."""
    from ssmops.models import generation

    monkeypatch.setattr(MambaLMHeadModel, "decoding_step", lambda *args: None)
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "0")
    torch.manual_seed(0)
    model = MambaLMHeadModel(tiny_config()).eval()
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    eager = model.generate(prompt, max_length=10, return_dict_in_generate=True, output_scores=True)
    compiled = model.generate(prompt, max_length=10, cg=True, return_dict_in_generate=True, output_scores=True)
    assert generation.compiled_step_logits("cpu") is generation._compiled_step_logits[False]
    assert not torch._inductor.config.cpp_wrapper
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.scores), torch.stack(eager.scores), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_mamba1_lm_on_cpu_decodes_through_its_own_step_with_or_without_cg(weights, monkeypatch):
    """A Mamba-1 LM's tokens after the prompt come from `decoding_step` (its layers' arguments to one
    `mamba_layers_step` call gathered once a generation), cg=True or not: nothing is compiled, and the
    logits are `step_logits`' bit for bit."""
    from ssmops.models import generation

    model = MambaLMHeadModel(tiny_config(n_layer=3)).eval().convert_weights(weights)
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    by_step_logits = {}
    for cg in (False, True):
        monkeypatch.setattr(generation, "compiled_step_logits", lambda device: pytest.fail("compiled"))
        out = model.generate(prompt, max_length=12, cg=cg, return_dict_in_generate=True, output_scores=True)
        monkeypatch.setattr(MambaLMHeadModel, "decoding_step", lambda *args: None)
        monkeypatch.setattr(generation, "compiled_step_logits", lambda device: generation.step_logits)
        by_step_logits[cg] = model.generate(prompt, max_length=12, cg=cg, return_dict_in_generate=True,
                                            output_scores=True)
        monkeypatch.undo()
        assert torch.equal(out.sequences, by_step_logits[cg].sequences)
        assert all(torch.equal(a, b) for a, b in zip(out.scores, by_step_logits[cg].scores, strict=True))
    with torch.inference_mode():
        memory = model.allocate_inference_cache(2, 8)
        assert model.decoding_step(memory, 2) is not None
        assert model.decoding_step(model.allocate_inference_cache(17, 8), 17) is None  # past 16 sequences


def test_compiled_step_uses_cpp_wrapper_on_cpu_unless_the_environment_says(monkeypatch):
    from ssmops.models import generation

    monkeypatch.setattr(generation, "_compiled_step_logits", {})
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WRAPPER", raising=False)
    cpu, cuda = generation.compiled_step_logits("cpu"), generation.compiled_step_logits("cuda")
    assert cpu is not cuda and set(generation._compiled_step_logits) == {True, False}
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "0")
    assert generation.compiled_step_logits("cpu") is cuda


@pytest.mark.parametrize("name", ["mamba1", "hybrid"])
def test_prompts_of_different_lengths_decode_as_if_alone(name):
    """A list of prompts: each is prefilled into its own cache row, then all decode together at
    their own positions (attention masks by position); every sequence is what it is alone."""
    torch.manual_seed(0)
    model = MambaLMHeadModel(tiny_config()).eval() if name == "mamba1" else tiny_mamba2_model(name)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 61, (n,), generator=gen) for n in (3, 7, 5)]
    out = model.generate(prompts, max_length=7 + 6, return_dict_in_generate=True, output_scores=True)
    assert [s.numel() for s in out.sequences] == [3 + 6, 7 + 6, 5 + 6] and len(out.scores) == 6
    for row, (prompt, seq) in enumerate(zip(prompts, out.sequences, strict=True)):
        alone = model.generate(prompt[None], max_length=prompt.numel() + 6, return_dict_in_generate=True,
                               output_scores=True)
        assert torch.equal(seq, alone.sequences[0])
        torch.testing.assert_close(torch.stack(out.scores)[:, row], torch.stack(alone.scores)[:, 0],
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate([prompts[0], prompts[0][:0]], max_length=10)


@pytest.mark.parametrize("block", ["mamba", "mamba2"])
def test_decay_rates_are_kept_between_steps_while_A_log_is_unchanged(block):
    """A decoding step's A = -exp(A_log) is worked out once and kept while A_log is the same tensor at the same
    version; an in-place change (an optimizer step, load_state_dict) or a new parameter is seen, and with
    autograd recording the rates are computed afresh and reach A_log."""
    from ssmops.modules import Mamba, Mamba2
    from ssmops.modules.decay import decay_rates

    torch.manual_seed(0)
    mixer = Mamba(d_model=16, d_state=4) if block == "mamba" else Mamba2(d_model=32, headdim=8, d_state=8)
    with torch.no_grad():
        first = decay_rates(mixer, mixer.A_log)
        assert decay_rates(mixer, mixer.A_log) is first
        torch.testing.assert_close(first, -torch.exp(mixer.A_log.float()))
        mixer.A_log.add_(0.5)
        second = decay_rates(mixer, mixer.A_log)
        torch.testing.assert_close(second, -torch.exp(mixer.A_log.float()))
        mixer.A_log = torch.nn.Parameter(mixer.A_log + 1.0)
        torch.testing.assert_close(decay_rates(mixer, mixer.A_log), -torch.exp(mixer.A_log.float()))
    with torch.inference_mode():  # an inference tensor has no version: never kept
        made = torch.nn.Parameter(mixer.A_log.detach() * 2, requires_grad=False)
        torch.testing.assert_close(decay_rates(mixer, made), -torch.exp(made.float()))
        made.add_(1.0)
        torch.testing.assert_close(decay_rates(mixer, made), -torch.exp(made.float()))
    rates = decay_rates(mixer, mixer.A_log)
    assert rates.requires_grad
    rates.sum().backward()
    torch.testing.assert_close(mixer.A_log.grad, -torch.exp(mixer.A_log.detach().float()))


def test_mamba2_step_computes_its_decay_rates_once():
    """Mamba2.step's later tokens reuse A = -exp(A_log): no exp among a step's operators after the first."""
    from ssmops.modules import Mamba2

    torch.manual_seed(0)
    mixer = Mamba2(d_model=32, headdim=8, d_state=8)
    conv_state, ssm_state = mixer.allocate_inference_cache(2, 1, dtype=torch.float32)
    with torch.no_grad():
        first = mixer.step(torch.randn(2, 1, 32), conv_state, ssm_state)[0]
        with CountOps() as ops:
            second = mixer.step(torch.randn(2, 1, 32), conv_state, ssm_state)[0]
    assert ops.counts["aten.exp"] == 0 and ops.counts["aten.neg"] == 0, ops.counts
    assert first.isfinite().all() and second.isfinite().all()
