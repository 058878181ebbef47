"""Mamba-2 and hybrid models: the gated RMSNorm, mamba_split_conv1d_scan_combined, the Mamba2
block, attention layers, the LM (decoding, packed sequences, training under torch.compile)
and checkpoints (mamba_ssm's layout, transformers' Mamba2ForCausalLM and BambaForCausalLM).

Everything is checked against the per-timestep Mamba-2 and the formulas written below.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

import ssmops
import ssmops.modules
from ssmops.layernorm_gated import layernorm_fn, rmsnorm_fn
from ssmops.models import InferenceParams, MambaConfig, MambaLMHeadModel
from ssmops.modules import Mamba2

from conftest import assert_close
from test_models import _greedy_by_recomputing, train

# --- the references ------------------------------------------------------------------------------


def gated_rmsnorm_formula(x, weight, z, eps, group_size, norm_before_gate, rms=True):
    """out = norm(x) * silu(z) or norm(x * silu(z)), norm over groups of group_size features
    (RMSNorm, or LayerNorm without a bias when not `rms`)."""
    x = x.double()
    if z is not None and not norm_before_gate:
        x = x * F.silu(z.double())
    groups = x.reshape(*x.shape[:-1], -1, group_size)
    if not rms:
        groups = groups - groups.mean(-1, keepdim=True)
    normed = groups / torch.sqrt((groups**2).mean(-1, keepdim=True) + eps)
    out = normed.reshape(x.shape) * weight.double()
    if z is not None and norm_before_gate:
        out = out * F.silu(z.double())
    return out.float()


def mamba2_block_reference(block: Mamba2, u: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, d_model) -> (batch, seqlen, d_model): Mamba-2 one timestep at a time, float32."""
    batch, seqlen, _ = u.shape
    p = {k: v.float() for k, v in block.named_parameters()}
    nh, hd, n, g = block.nheads, block.headdim, block.d_state, block.ngroups
    zxbcdt = F.linear(u.float(), p["in_proj.weight"], p.get("in_proj.bias"))
    d_mlp = (zxbcdt.shape[-1] - 2 * block.d_ssm - 2 * g * n - nh) // 2
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_mlp, d_mlp, block.d_ssm, block.conv_dim, nh], dim=-1)
    A = -torch.exp(p["A_log"])
    D = p["D"].reshape(nh, hd) if block.D_has_hdim else p["D"][:, None]
    window = u.new_zeros(batch, block.conv_dim, block.d_conv)
    h = u.new_zeros(batch, nh, hd, n)
    outputs = []
    for t in range(seqlen):
        window = torch.cat([window[..., 1:], xBC[:, t, :, None]], dim=-1)
        xbc = F.silu((window * p["conv1d.weight"][:, 0]).sum(-1) + p.get("conv1d.bias", 0))
        x, B, C = torch.split(xbc, [block.d_ssm, g * n, g * n], dim=-1)
        x = x.reshape(batch, nh, hd)
        B = B.reshape(batch, g, n).repeat_interleave(nh // g, dim=1)  # head i reads group i // (nh / g)
        C = C.reshape(batch, g, n).repeat_interleave(nh // g, dim=1)
        delta = F.softplus(dt[:, t] + p["dt_bias"]).clamp(*block.dt_limit)  # (batch, nh)
        h = torch.exp(delta * A)[..., None, None] * h + (delta[..., None] * x)[..., None] * B[:, :, None, :]
        y = (h * C[:, :, None, :]).sum(-1) + D * x
        y = y.reshape(batch, block.d_ssm)
        if block.rmsnorm:
            y = gated_rmsnorm_formula(y, p["norm.weight"], z[:, t], block.norm.eps, block.d_ssm // g,
                                      block.norm_before_gate)
        else:
            y = y * F.silu(z[:, t])
        if d_mlp:
            y = torch.cat([F.silu(z0[:, t]) * x0[:, t], y], dim=-1)
        outputs.append(F.linear(y, p["out_proj.weight"], p.get("out_proj.bias")))
    return torch.stack(outputs, dim=1)


# --- operators and the block ---------------------------------------------------------------------


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("group_size", [None, 4])
def test_gated_norms_match_the_formula(norm_before_gate, group_size):
    torch.manual_seed(0)
    x, z, w = torch.randn(3, 5, 12), torch.randn(3, 5, 12), torch.rand(12) + 0.5
    out = rmsnorm_fn(x, w, z=z, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    ref = gated_rmsnorm_formula(x, w, z, 1e-5, group_size or 12, norm_before_gate)
    assert_close(out, ref, 1e-6, "out")
    assert_close(rmsnorm_fn(x, w, eps=1e-5), gated_rmsnorm_formula(x, w, None, 1e-5, 12, True), 1e-6, "no gate")
    layer_norm = layernorm_fn(x, w, z=z, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    assert_close(layer_norm, gated_rmsnorm_formula(x, w, z, 1e-5, group_size or 12, norm_before_gate, rms=False),
                 1e-6, "layer norm")
    with pytest.raises(ValueError, match="group_size must divide"):
        rmsnorm_fn(x, w, group_size=5)


BLOCK_CASES = {
    "default": {},
    "ngroups2-D_hdim-bias": {"ngroups": 2, "D_has_hdim": True, "bias": True},
    "d_ssm-mlp-norm_before_gate": {"d_ssm": 32, "norm_before_gate": True},
    "no-rmsnorm-dt_limit": {"rmsnorm": False, "dt_limit": (0.01, 0.05)},
}


@pytest.mark.parametrize("use_mem_eff_path", [True, False], ids=["split_conv1d_scan", "unrolled"])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_mamba2_block_matches_per_timestep_reference(case, use_mem_eff_path):
    torch.manual_seed(0)
    block = Mamba2(d_model=32, d_state=8, d_conv=4, headdim=8, chunk_size=4, use_mem_eff_path=use_mem_eff_path,
                   **BLOCK_CASES[case])
    with torch.no_grad():  # the init leaves D, the norm's weight and the biases at 1 or 0
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    u = torch.randn(2, 11, 32)
    y, y_ref = block(u), mamba2_block_reference(block, u)
    assert_close(y, y_ref, 1e-5, "out")
    g = torch.randn_like(y)
    params = dict(block.named_parameters())
    grads = torch.autograd.grad((y * g).sum(), list(params.values()))
    grads_ref = torch.autograd.grad((y_ref * g).sum(), list(params.values()))
    for name, a, b in zip(params, grads, grads_ref):
        assert_close(a, b, 1e-4, f"d{name}")


def test_mamba2_block_trains_compiled_fullgraph_dynamic():
    """The stock block under torch.compile(fullgraph=True, dynamic=True) on the CPU, its input without a
    gradient (the parameters only, as a model's first layer trains): outputs and every gradient equal eager's
    at two lengths. (Its backward was compiled for the first length's strides of a saved view and refused
    the second: mamba_chunk_scan_combined's contiguous_when_compiling_backward.) The block's default path;
    the unrolled one calls the same scan front end."""
    torch.manual_seed(0)
    block = Mamba2(d_model=32, d_state=8, headdim=8, chunk_size=16)
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    params = list(block.parameters())
    for seqlen in (40, 29):
        u = torch.randn(2, seqlen, 32)
        y, y_ref = compiled(u), block(u)
        assert_close(y, y_ref, 1e-5, f"out at {seqlen}")
        grads = torch.autograd.grad(y.square().sum(), params)
        grads_ref = torch.autograd.grad(y_ref.square().sum(), params)
        for (name, _), a, b in zip(block.named_parameters(), grads, grads_ref):
            assert_close(a, b, 1e-4, f"d{name} at {seqlen}")


def test_mamba2_block_parameters_and_init_follow_mamba_ssm():
    """mamba_ssm's Mamba2(d_model=64, d_state=16, headdim=16, ngroups=2) state_dict: names and shapes."""
    torch.manual_seed(0)
    block = Mamba2(64, d_state=16, headdim=16, ngroups=2, A_init_range=(1, 16), dt_min=0.001, dt_max=0.1)
    shapes = {k: tuple(v.shape) for k, v in block.state_dict().items()}
    assert shapes == {
        "dt_bias": (8,), "A_log": (8,), "D": (8,), "in_proj.weight": (2 * 128 + 2 * 2 * 16 + 8, 64),
        "conv1d.weight": (128 + 64, 1, 4), "conv1d.bias": (192,), "norm.weight": (128,), "out_proj.weight": (64, 128),
    }
    A = torch.exp(block.A_log)
    assert A.min() >= 1 and A.max() <= 16
    dt = F.softplus(block.dt_bias)
    assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    assert block.norm.group_size == 64 and not block.norm_before_gate


def test_mamba2_step_continues_the_prefill():
    torch.manual_seed(0)
    block = Mamba2(32, d_state=8, headdim=8, ngroups=2, chunk_size=4, layer_idx=0, dt_limit=(0.0, 0.2)).eval()
    u = torch.randn(2, 13, 32)
    with torch.no_grad():
        full = block(u)
        params = InferenceParams(max_seqlen=13, max_batch_size=2)
        outs = [block(u[:, :6], inference_params=params)]
        for t in range(6, 13):
            params.seqlen_offset = t
            outs.append(block(u[:, t:t + 1], inference_params=params))
    assert_close(torch.cat(outs, dim=1), full, 1e-5, "prefill + steps")


def test_packed_sequences_match_separate_ones():
    """seq_idx: the conv and the scan restart at each sequence; cu_seqlens with inference_params
    leaves each sequence's own decoding states."""
    torch.manual_seed(0)
    block = Mamba2(32, d_state=8, headdim=8, chunk_size=4, layer_idx=0).eval()
    lengths = [5, 9, 3]
    parts = [torch.randn(1, n, 32) for n in lengths]
    packed = torch.cat(parts, dim=1)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    cu_seqlens = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    with torch.no_grad():
        separate = torch.cat([block(p) for p in parts], dim=1)
        for path in (True, False):
            block.use_mem_eff_path = path
            assert_close(block(packed, seq_idx=seq_idx), separate, 1e-5, f"packed (mem_eff {path})")
        params = InferenceParams(max_seqlen=20, max_batch_size=3)
        block(packed, seq_idx=seq_idx, cu_seqlens=cu_seqlens, inference_params=params)
        conv_state, ssm_state = params.key_value_memory_dict[0]
        for i, part in enumerate(parts):
            own = InferenceParams(max_seqlen=20, max_batch_size=1)
            block(part, inference_params=own)
            assert_close(conv_state[i:i + 1], own.key_value_memory_dict[0][0], 1e-6, f"conv state {i}")
            assert_close(ssm_state[i:i + 1], own.key_value_memory_dict[0][1], 1e-5, f"ssm state {i}")


def test_split_conv1d_scan_returns_final_states_and_checks_shapes():
    torch.manual_seed(0)
    block = Mamba2(32, d_state=8, headdim=8, chunk_size=4, layer_idx=0)
    u = torch.randn(2, 10, 32)
    zxbcdt = block.in_proj(u)
    args = (zxbcdt, block.conv1d.weight, block.conv1d.bias, block.dt_bias, -torch.exp(block.A_log), block.D, 4)
    out, final = ssmops.mamba_split_conv1d_scan_combined(
        *args, return_final_states=True, headdim=8, rmsnorm_weight=block.norm.weight, rmsnorm_eps=1e-5,
        norm_before_gate=False, outproj_weight=block.out_proj.weight)
    assert_close(out, block(u), 1e-6, "out")
    params = InferenceParams(max_seqlen=10, max_batch_size=2)  # the unrolled path keeps the last state
    with torch.no_grad():
        block(u, inference_params=params)
    assert final.dtype == torch.float32
    assert_close(final, params.key_value_memory_dict[0][1], 1e-5, "final states")
    with pytest.raises(ValueError, match="headdim must be given"):
        ssmops.mamba_split_conv1d_scan_combined(*args)
    with pytest.raises(ValueError, match="zxbcdt's last dimension"):
        ssmops.mamba_split_conv1d_scan_combined(zxbcdt[..., 1:], *args[1:], headdim=8)


# --- language models: Mamba-2 and hybrids ------------------------------------------------------------


def mamba2_config(**kw) -> MambaConfig:
    ssm_cfg = {"layer": "Mamba2", "d_state": 8, "headdim": 8, "ngroups": 2, "chunk_size": 4, **kw.pop("ssm_cfg", {})}
    return MambaConfig(**{"d_model": 32, "n_layer": 2, "vocab_size": 61, "ssm_cfg": ssm_cfg, **kw})


HYBRID = {
    "d_intermediate": 64, "n_layer": 4, "attn_layer_idx": [1, 3],
    "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "causal": True, "rotary_emb_dim": 4, "d_conv": 3, "mlp_dim": 40},
}
MODELS = {"mamba2": {}, "hybrid": HYBRID,
          "hybrid-interleaved-rotary": {**HYBRID, "attn_cfg": {**HYBRID["attn_cfg"], "rotary_emb_interleaved": True}}}


# The hybrid's two kinds of layer (Mamba-2, attention with a KV cache, MLPs) once each: for the checks
# that compile or export a package per model, where the repeated layers would only add compile time.
HYBRID_PAIR = {"n_layer": 2, "attn_layer_idx": [1]}


def tiny_model(name: str, seed: int = 0, **overrides) -> MambaLMHeadModel:
    """MODELS[name] (with `overrides` of its config), its parameters moved off their initial values."""
    torch.manual_seed(seed)
    model = MambaLMHeadModel(mamba2_config(**{**MODELS[name], **overrides})).eval()
    with torch.no_grad():  # move the parameters the init leaves at 0 or 1
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_with_state_equals_recomputing_the_sequence(name):
    model = tiny_model(name, seed=3)
    prompt = torch.randint(0, 61, (3, 6), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, max_length=16, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, _greedy_by_recomputing(model, prompt, 16))
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, 5:]
    assert_close(torch.stack(out.scores, 1), full, 1e-5, "decode logits")


def test_lm_layers_follow_the_config():
    model = tiny_model("hybrid")
    kinds = [type(layer.mixer).__name__ for layer in model.backbone.layers]
    assert kinds == ["Mamba2", "MHA", "Mamba2", "MHA"]
    keys = set(model.state_dict())
    assert {"backbone.layers.1.mixer.in_proj.weight", "backbone.layers.1.mixer.conv1d.weight",
            "backbone.layers.0.norm2.weight", "backbone.layers.0.mlp.fc1.weight", "backbone.layers.0.mlp.fc2.weight",
            "backbone.layers.0.mixer.norm.weight"} <= keys
    # MHA's in_proj: q (4 heads) + k, v (2 heads) of 8, then the 256-rounded MLP width
    assert model.backbone.layers[1].mixer.in_proj.weight.shape == (8 * (4 + 2 * 2) + 256, 32)
    with pytest.raises(ValueError, match="ssm_cfg layer must be one of"):
        mamba2_config(ssm_cfg={"layer": "Mamba3"})


def test_hybrid_packed_sequences_match_separate_ones():
    """seq_idx reaches every layer: attention does not look across sequences either."""
    model = tiny_model("hybrid", seed=1)
    lengths = [4, 7]
    parts = [torch.randint(0, 61, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model(torch.cat(parts, dim=1), seq_idx=seq_idx).logits
        separate = torch.cat([model(p).logits for p in parts], dim=1)
    assert_close(packed, separate, 1e-5, "packed logits")


@pytest.mark.slow
def test_lm_trains_on_packed_sequences_under_compile_fullgraph():
    """A copying task on packed pairs of sequences (seq_idx): the loss on the copied halves
    falls by a quarter within 60 steps. The hybrid's two kinds of layer once each (HYBRID_PAIR): its
    Mamba-2 layer is what a Mamba-2 LM repeats, and each compile costs ~25 s on 2 cores."""
    torch.manual_seed(0)
    vocab, half = 8, 5
    model = MambaLMHeadModel(mamba2_config(**{**HYBRID, **HYBRID_PAIR, "vocab_size": vocab}))
    compiled = torch.compile(model, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    seq_idx = torch.arange(2, dtype=torch.int32).repeat_interleave(2 * half)[None].expand(4, -1).contiguous()
    copied = torch.cat([torch.arange(half, 2 * half - 1), torch.arange(3 * half, 4 * half - 1)])

    def loss_of_batch():
        firsts = torch.randint(1, vocab, (4, 2, half), generator=gen)
        ids = torch.cat([firsts, firsts], dim=2).flatten(1)  # two sequences, each its half twice
        logits = compiled(ids, seq_idx=seq_idx).logits
        return F.cross_entropy(logits[:, copied].reshape(-1, vocab), ids[:, copied + 1].reshape(-1))

    first, last = train(model, loss_of_batch, steps=60)
    assert last < 0.75 * first, f"loss went from {first:.3f} to {last:.3f}"


# --- checkpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mamba2", "hybrid"])
def test_loads_mamba_ssm_checkpoint_strictly(name, tmp_path):
    """What mamba_ssm writes: config.json with its keys, pytorch_model.bin with its names."""
    model = tiny_model(name, seed=5)
    config = {k: v for k, v in model.config.to_dict().items()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = MambaLMHeadModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    state = model.state_dict()
    state["backbone.layers.0.mixer.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        MambaLMHeadModel.from_state_dict(model.config, state)


def _randomized(model):
    with torch.no_grad():  # random weights everywhere (the init leaves some at 0 or 1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.generation_config.eos_token_id = None  # decode the full length, as ours does
    return model.eval()


def _hf_mamba2():
    tf = pytest.importorskip("transformers", reason="transformers is a test-only dependency: pip install transformers")
    torch.manual_seed(0)
    return _randomized(tf.Mamba2ForCausalLM(tf.Mamba2Config(
        vocab_size=70, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, head_dim=8, num_heads=8,
        n_groups=2, chunk_size=4, time_step_limit=(0.0, 0.3), layer_norm_epsilon=1e-5, use_bias=True)))


def _hf_bamba():
    tf = pytest.importorskip("transformers", reason="transformers is a test-only dependency: pip install transformers")
    torch.manual_seed(0)
    return _randomized(tf.BambaForCausalLM(tf.BambaConfig(
        vocab_size=70, hidden_size=32, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1,
        mamba_d_state=8, mamba_chunk_size=4, rms_norm_eps=1e-6)))


@pytest.mark.parametrize("make_hf", [_hf_mamba2, _hf_bamba], ids=["Mamba2ForCausalLM", "BambaForCausalLM"])
def test_transformers_checkpoint_converts_to_the_same_logits(make_hf, tmp_path):
    hf = make_hf()
    ids = torch.randint(0, 70, (2, 13))
    with torch.no_grad():
        expected = hf(ids, use_cache=False).logits
    ours = MambaLMHeadModel.from_hf(hf).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, expected, rtol=1e-4, atol=1e-5)
    hf.save_pretrained(tmp_path)  # transformers' config.json + model.safetensors
    loaded = MambaLMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-4, atol=1e-5)
        hf_tokens = hf.generate(ids[:, :5], max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert torch.equal(ours.generate(ids[:, :5], max_length=15), hf_tokens)


def test_unmappable_transformers_configs_are_refused_by_name():
    from ssmops.models import convert_hf_config

    with pytest.raises(ValueError, match="model_type 'zamba2' is not supported"):
        convert_hf_config({"model_type": "zamba2", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 5})
    bamba = _hf_bamba().config.to_dict()
    with pytest.raises(ValueError, match="intermediate_size 100 is not a multiple of 128"):
        convert_hf_config({**bamba, "intermediate_size": 100})


# --- against mamba_ssm's own module code -------------------------------------------------------------


def _mamba_ssm_modules():
    """mamba_ssm 2.3.2.post1's Mamba2 and MHA modules from its published sdist (benchmarks/peers.py),
    with ssmops' functions in place of the GPU kernels they import; needs einops and the registry."""
    pytest.importorskip("einops", reason="mamba_ssm's code needs einops (make bench-deps installs it)")
    import subprocess

    from conftest import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    import peers

    gpu_only = {
        "causal_conv1d": ("causal_conv1d_fn", "causal_conv1d_update"),
        "causal_conv1d.causal_conv1d_varlen": ("causal_conv1d_varlen_states",),
        "mamba_ssm.ops.triton.selective_state_update": ("selective_state_update",),
        "mamba_ssm.ops.triton.ssd_combined": ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"),
        "mamba_ssm.ops.triton.layernorm_gated": ("RMSNorm",),
        "mamba_ssm.distributed.tensor_parallel": ("ColumnParallelLinear", "RowParallelLinear"),
        "mamba_ssm.distributed.distributed_utils": ("all_reduce", "reduce_scatter"),
        "flash_attn": ("flash_attn_with_kvcache",),
        "flash_attn.layers.rotary": ("RotaryEmbedding",),
    }
    try:
        mamba2 = peers.mamba_ssm_module("mamba_ssm/modules/mamba2.py", gpu_only)
        mha = peers.mamba_ssm_module("mamba_ssm/modules/mha.py", gpu_only)
    except (subprocess.CalledProcessError, ImportError) as err:
        pytest.skip(f"mamba_ssm's sdist is not available here: {err}")
    mamba2.mamba_chunk_scan_combined = ssmops.mamba_chunk_scan_combined
    mamba2.mamba_split_conv1d_scan_combined = ssmops.mamba_split_conv1d_scan_combined
    mamba2.selective_state_update = ssmops.selective_state_update
    mamba2.RMSNormGated = ssmops.modules.RMSNormGated
    return mamba2, mha


@pytest.fixture
def no_stand_ins_left():
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("mamba_ssm", "causal_conv1d", "flash_attn", "peers"):
            del sys.modules[name]


@pytest.mark.slow
def test_mamba_ssm_module_code_gives_the_same_outputs(no_stand_ins_left):
    """mamba_ssm's Mamba2 (unrolled path, decoding step) and MHA, as published, with their GPU kernels
    replaced by ssmops' functions: same state_dict, strict loading, the same outputs as ssmops' modules."""
    from ssmops.modules.mha import MHA

    theirs_mamba2, theirs_mha = _mamba_ssm_modules()
    for kw in [{}, {"ngroups": 2}, {"d_ssm": 32, "norm_before_gate": True}, {"rmsnorm": False}]:
        torch.manual_seed(0)
        theirs = theirs_mamba2.Mamba2(48, d_state=8, headdim=8, chunk_size=4, layer_idx=0, use_mem_eff_path=False,
                                      **kw)
        ours = Mamba2(48, d_state=8, headdim=8, chunk_size=4, layer_idx=0, **kw)
        ours.load_state_dict(theirs.state_dict(), strict=True)
        u = torch.randn(2, 13, 48)
        with torch.no_grad():
            assert_close(ours(u), theirs(u), 1e-6, f"Mamba2 {kw}")
            params = [InferenceParams(max_seqlen=16, max_batch_size=2) for _ in range(2)]
            for module, p in zip((theirs, ours), params):
                module(u[:, :9], inference_params=p)
                p.seqlen_offset = 9
            assert_close(ours(u[:, 9:10], inference_params=params[1]),
                         theirs(u[:, 9:10], inference_params=params[0]), 1e-6, f"Mamba2 step {kw}")
    theirs = theirs_mha.MHA(32, 4, num_heads_kv=2, causal=True, layer_idx=0, d_conv=4, mlp_dim=64)
    ours = MHA(32, 4, num_heads_kv=2, causal=True, layer_idx=0, d_conv=4, mlp_dim=64)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        assert_close(ours(x), theirs(x), 1e-6, "MHA")
