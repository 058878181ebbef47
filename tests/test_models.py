"""The Mamba model layer: mamba_inner_fn, the Mamba block, the
language model (forward, decoding, training under torch.compile) and checkpoint loading
(mamba_ssm layout and transformers' MambaForCausalLM through the converter).

Everything is checked against the readable per-timestep Mamba written below.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ssmops
from ssmops.models import InferenceParams, MambaConfig, MambaLMHeadModel
from ssmops.modules import Mamba

from conftest import REPO, assert_close

# --- the reference: Mamba one timestep at a time ---------------------------------------


def mamba_block_reference(block: Mamba, hidden_states: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, d_model) -> (batch, seqlen, d_model), a plain loop over time, float32."""
    batch, seqlen, _ = hidden_states.shape
    p = {k: v.float() for k, v in block.named_parameters()}
    conv_w = p["conv1d.weight"][:, 0, :]  # (d_inner, d_conv)
    A = -torch.exp(p["A_log"])
    xz = F.linear(hidden_states.float(), p["in_proj.weight"], p.get("in_proj.bias"))
    x_in, z = xz.chunk(2, dim=-1)
    window = hidden_states.new_zeros(batch, block.d_inner, block.d_conv, dtype=torch.float32)
    h = hidden_states.new_zeros(batch, block.d_inner, block.d_state, dtype=torch.float32)
    outputs = []
    for t in range(seqlen):
        window = torch.cat([window[..., 1:], x_in[:, t, :, None]], dim=-1)  # the last d_conv inputs
        x = (window * conv_w).sum(-1)
        if "conv1d.bias" in p:
            x = x + p["conv1d.bias"]
        x = F.silu(x)
        dt_low, B, C = torch.split(x @ p["x_proj.weight"].T, [block.dt_rank, block.d_state, block.d_state], -1)
        dt = F.softplus(dt_low @ p["dt_proj.weight"].T + p["dt_proj.bias"])  # (batch, d_inner)
        h = torch.exp(dt[..., None] * A) * h + (dt * x)[..., None] * B[:, None, :]
        y = (h * C[:, None, :]).sum(-1) + p["D"] * x
        y = y * F.silu(z[:, t])
        outputs.append(F.linear(y, p["out_proj.weight"], p.get("out_proj.bias")))
    return torch.stack(outputs, dim=1)


def lm_reference(model: MambaLMHeadModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the LM with every block run by `mamba_block_reference`."""

    def rms_norm(x, weight, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    eps = model.config.norm_epsilon
    hidden = model.backbone.embedding.weight[input_ids].float()
    residual = torch.zeros_like(hidden)
    for layer in model.backbone.layers:
        residual = residual + hidden
        hidden = mamba_block_reference(layer.mixer, rms_norm(residual, layer.norm.weight, eps))
    final = rms_norm(residual + hidden, model.backbone.norm_f.weight, eps)
    return final @ model.lm_head.weight.T


def tiny_config(**kw) -> MambaConfig:
    ssm_cfg = {"d_state": 8, "d_conv": 4, "expand": 2, **kw.pop("ssm_cfg", {})}
    return MambaConfig(**{"d_model": 32, "n_layer": 2, "vocab_size": 61, "ssm_cfg": ssm_cfg, **kw})


def tiny_model(seed: int = 0, **kw) -> MambaLMHeadModel:
    torch.manual_seed(seed)
    return MambaLMHeadModel(tiny_config(**kw)).eval()


# --- mamba_inner_fn and the Mamba block ------------------------------------------------------


def test_mamba_block_parameters_and_init_follow_mamba_ssm():
    torch.manual_seed(0)
    block = Mamba(d_model=40, d_state=16, d_conv=4, expand=2, dt_min=0.001, dt_max=0.1)
    shapes = {k: tuple(v.shape) for k, v in block.state_dict().items()}
    assert shapes == {
        "in_proj.weight": (160, 40), "conv1d.weight": (80, 1, 4), "conv1d.bias": (80,),
        "x_proj.weight": (3 + 32, 80), "dt_proj.weight": (80, 3), "dt_proj.bias": (80,),
        "A_log": (80, 16), "D": (80,), "out_proj.weight": (40, 80),
    }
    torch.testing.assert_close(block.A_log, torch.log(torch.arange(1.0, 17.0)).repeat(80, 1))
    assert torch.equal(block.D, torch.ones(80))
    dt = F.softplus(block.dt_proj.bias)
    assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    assert block.dt_proj.weight.abs().max() <= 3**-0.5
    assert Mamba(40, bias=True, conv_bias=False).in_proj.bias is not None


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["mamba_inner_fn", "unrolled"])
def test_mamba_block_matches_per_timestep_reference(use_fast_path):
    torch.manual_seed(0)
    block = Mamba(d_model=16, d_state=4, d_conv=3, expand=2, bias=True, use_fast_path=use_fast_path)
    x = torch.randn(2, 11, 16)
    y = block(x)
    y_ref = mamba_block_reference(block, x)
    assert_close(y, y_ref, 1e-5, "out")
    # differentiable: gradients match autograd through the reference loop
    names = ["in_proj.weight", "conv1d.weight", "x_proj.weight", "dt_proj.bias", "A_log", "D", "out_proj.bias"]
    params = [dict(block.named_parameters())[n] for n in names]
    g = torch.randn_like(y)
    grads = torch.autograd.grad((y * g).sum(), params)
    grads_ref = torch.autograd.grad((y_ref * g).sum(), params)
    for name, a, b in zip(names, grads, grads_ref):
        assert_close(a, b, 1e-4, f"d{name}")


def test_mamba_inner_fn_takes_external_B_C_and_proj_biases():
    torch.manual_seed(0)
    block = Mamba(d_model=16, d_state=4)
    xz = block.in_proj(torch.randn(2, 9, 16)).transpose(1, 2)
    common = (xz, block.conv1d.weight, block.conv1d.bias, block.x_proj.weight, block.dt_proj.weight,
              block.out_proj.weight, block.out_proj.bias, -torch.exp(block.A_log))
    bias_B, bias_C = torch.randn(4), torch.randn(4)
    y = ssmops.mamba_inner_fn(*common, D=block.D, delta_bias=block.dt_proj.bias, B_proj_bias=bias_B,
                              C_proj_bias=bias_C)
    # the same with B and C computed outside and passed in
    x = F.silu(F.conv1d(xz[:, :32], block.conv1d.weight, block.conv1d.bias, padding=3, groups=32)[..., :9])
    x_dbl = F.linear(x.transpose(1, 2), block.x_proj.weight)
    B = (x_dbl[..., 1:5] + bias_B).transpose(1, 2)
    C = (x_dbl[..., 5:9] + bias_C).transpose(1, 2)
    y2 = ssmops.mamba_inner_fn(*common, B=B, C=C, D=block.D, delta_bias=block.dt_proj.bias)
    torch.testing.assert_close(y, y2)


def test_mamba_block_step_continues_the_prefill():
    """Prompt through forward(inference_params) (scan + last state), then step per token,
    equals the forward over the whole sequence; and the prefilled states equal stepping
    the prompt token by token from zero states."""
    torch.manual_seed(0)
    block = Mamba(d_model=16, d_state=4, d_conv=4, layer_idx=0).eval()
    x = torch.randn(2, 10, 16)
    full = block(x)
    for prompt in (2, 6):  # shorter and longer than d_conv
        params = InferenceParams(max_seqlen=10, max_batch_size=2)
        outs = [block(x[:, :prompt], inference_params=params)]
        params.seqlen_offset = prompt
        for t in range(prompt, 10):
            outs.append(block(x[:, t : t + 1], inference_params=params))
            params.seqlen_offset += 1
        assert_close(torch.cat(outs, 1), full, 1e-5, f"prompt {prompt}")

        conv_state, ssm_state = block.allocate_inference_cache(2, 10)
        for t in range(prompt):
            block.step(x[:, t : t + 1], conv_state, ssm_state)
        prefill = InferenceParams(max_seqlen=10, max_batch_size=2)
        block(x[:, :prompt], inference_params=prefill)
        torch.testing.assert_close(prefill.key_value_memory_dict[0][0], conv_state)
        torch.testing.assert_close(prefill.key_value_memory_dict[0][1], ssm_state, atol=1e-5, rtol=1e-5)


# --- the language model ----------------------------------------------------------------------


def test_lm_state_dict_layout_is_mamba_ssm():
    model = tiny_model()
    keys = set(model.state_dict())
    assert {"backbone.embedding.weight", "backbone.norm_f.weight", "lm_head.weight",
            "backbone.layers.1.norm.weight", "backbone.layers.1.mixer.A_log"} <= keys
    assert model.lm_head.weight is model.backbone.embedding.weight
    assert model.backbone.embedding.weight.shape == (64, 32)  # vocab 61 padded to a multiple of 8


def test_lm_matches_per_timestep_reference():
    model = tiny_model()
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    logits = model(ids).logits
    assert logits.shape == (2, 13, 64)
    assert_close(logits, lm_reference(model, ids), 1e-5, "logits")
    torch.testing.assert_close(model(ids, num_last_tokens=3).logits, logits[:, -3:])


def _greedy_by_recomputing(model, ids, max_length):
    with torch.no_grad():
        while ids.shape[1] < max_length:
            next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids


def test_generate_with_state_equals_recomputing_the_sequence():
    model = tiny_model(seed=3)
    prompt = torch.randint(0, 61, (3, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, max_length=24, return_dict_in_generate=True, output_scores=True)
    assert out.sequences.shape == (3, 24) and len(out.scores) == 19
    assert torch.equal(out.sequences[:, :5], prompt)
    assert torch.equal(out.sequences, _greedy_by_recomputing(model, prompt, 24))
    # and the logits of the recurrent path are those of the full forward
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, 4:]
    assert_close(torch.stack(out.scores, 1), full, 1e-5, "decode logits")


def test_generate_sampling_and_eos():
    model = tiny_model(seed=3)
    prompt = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    a = model.generate(prompt, 16, top_k=5, temperature=0.7)
    torch.manual_seed(7)
    b = model.generate(prompt, 16, top_k=5, temperature=0.7)
    assert torch.equal(a, b) and a.shape == (2, 16)
    torch.manual_seed(7)
    c = model.generate(prompt, 16, top_k=0, top_p=0.9, min_p=0.05, vocab_size=61)
    assert c.shape == (2, 16) and int(c.max()) < 61
    # top_k=5: every sampled token is among the 5 most likely at its step
    out = model.generate(prompt, 10, top_k=5, return_dict_in_generate=True, output_scores=True)
    for step, scores in enumerate(out.scores):
        top5 = scores.topk(5, dim=-1).indices
        assert (top5 == out.sequences[:, 4 + step, None]).any(-1).all()
    # eos: a finished sequence is padded with eos and decoding stops once all are
    greedy = model.generate(prompt, 16)
    eos = int(greedy[0, 6])
    stopped = model.generate(prompt, 16, eos_token_id=eos)
    assert stopped.shape[1] <= 16 and (stopped[0, 6:] == eos).all()


@pytest.mark.slow
def test_lm_trains_under_compile_fullgraph():
    """A copying task: the second half of each sequence repeats the first; the loss on the
    second half falls by a third within 40 steps."""
    torch.manual_seed(0)
    vocab, half_len = 8, 6
    model = MambaLMHeadModel(tiny_config(vocab_size=vocab, ssm_cfg={"d_state": 8}))
    compiled = torch.compile(model, fullgraph=True)
    gen = torch.Generator().manual_seed(0)

    def loss_of_batch():
        half = torch.randint(1, vocab, (8, half_len), generator=gen)
        ids = torch.cat([half, half], dim=1)
        logits = compiled(ids[:, :-1]).logits[:, half_len:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, half_len + 1 :].reshape(-1))

    first, last = train(model, loss_of_batch, steps=40)
    assert last < 0.75 * first, f"loss went from {first:.3f} to {last:.3f}"


def train(model, loss_of_batch, steps: int, lr: float = 1e-2) -> tuple[float, float]:
    """Adam on `loss_of_batch()` for `steps` steps; the mean loss of the first five and of the last five."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_of_batch()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


def test_lm_exports_with_dynamic_seqlen():
    import ssmops.export as sx

    model = tiny_model()
    ids = torch.randint(0, 61, (2, 9))
    ep = sx.export_program(_Logits(model), (ids,))
    other = torch.randint(0, 61, (2, 17))
    torch.testing.assert_close(ep.module()(other), model(other).logits)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


# --- checkpoints ---------------------------------------------------------------------------------


def test_loads_mamba_ssm_checkpoint_as_it_is(tmp_path):
    model = tiny_model(seed=5)
    # what mamba_ssm writes: its config keys, a torch.save'd state_dict (with the tied lm_head)
    config = {"d_model": 32, "n_layer": 2, "vocab_size": 61, "ssm_cfg": {"d_state": 8, "d_conv": 4, "expand": 2},
              "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = MambaLMHeadModel.from_pretrained(tmp_path)
    ids = torch.randint(0, 61, (2, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert loaded.lm_head.weight is loaded.backbone.embedding.weight
    # without lm_head.weight (tied) and through the dataclass
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    again = MambaLMHeadModel.from_state_dict(tiny_config(), state)
    torch.testing.assert_close(again(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="unknown mamba_ssm config keys"):
        MambaLMHeadModel.from_state_dict({**config, "n_layers": 2}, state)




def _hf_model(**kw):
    tf = pytest.importorskip("transformers", reason="transformers is a test-only dependency: pip install transformers")
    torch.manual_seed(0)
    settings = dict(
        vocab_size=70, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank="auto", use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5,
    )
    config = tf.MambaConfig(**{**settings, **kw})
    model = tf.MambaForCausalLM(config).eval()
    with torch.no_grad():  # random weights everywhere (the init leaves some at 0 or 1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_transformers_checkpoint_converts_to_the_same_logits(tmp_path):
    hf = _hf_model(use_bias=True)
    ids = torch.randint(0, 70, (2, 12))
    with torch.no_grad():
        expected = hf(ids, use_cache=False).logits
    ours = MambaLMHeadModel.from_hf(hf).eval()
    assert_close(ours(ids).logits, expected, 1e-5, "logits")
    # the same through a saved checkpoint directory (safetensors, transformers' config.json)
    hf.save_pretrained(tmp_path)
    loaded = MambaLMHeadModel.from_pretrained(tmp_path)
    assert_close(loaded(ids).logits, expected, 1e-5, "logits after save/load")
    # and greedy decoding agrees with transformers' own generate (cache path)
    with torch.no_grad():
        hf_tokens = hf.generate(ids[:, :5], max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert torch.equal(ours.generate(ids[:, :5], max_length=15), hf_tokens)


@pytest.mark.slow
def test_models_benchmark_runs():
    pytest.importorskip("transformers", reason="the benchmark compares with transformers (a test-only dependency)")
    # (without the compiled step: tests/test_decoding.py compiles the steps and checks their tokens)
    out = subprocess.run([sys.executable, "benchmarks/models.py", "--quick", "--repeats", "1", "--no-compile"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "ratio" in out.stdout and "decode tok/s" in out.stdout
    assert "== Mamba1" in out.stdout and "== Mamba2" in out.stdout


@pytest.mark.parametrize("ssm_state_dtype", [None, torch.float32], ids=["weights-dtype", "float32"])
def test_low_precision_model_decodes_with_its_cache_dtype(ssm_state_dtype):
    """As mamba_ssm, a bfloat16 model keeps its ssm states in bfloat16; `ssm_state_dtype` keeps them
    in float32. Either way the recurrent logits follow the full forward's, to bfloat16's precision."""
    model = tiny_model(seed=3).to(torch.bfloat16)
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(2))
    params = InferenceParams(max_seqlen=12, max_batch_size=2, ssm_state_dtype=ssm_state_dtype)
    with torch.no_grad():
        model(prompt, inference_params=params)
        for conv_state, ssm_state in params.key_value_memory_dict.values():
            assert conv_state.dtype == torch.bfloat16
            assert ssm_state.dtype == (ssm_state_dtype or torch.bfloat16)
    out = model.generate(prompt, max_length=12, return_dict_in_generate=True, output_scores=True,
                         ssm_state_dtype=ssm_state_dtype)
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, 4:]
    assert_close(torch.stack(out.scores, 1).float(), full.float(), 5e-2, "decode logits")
