"""transformers' own Mamba-family models with ssmops' mixers (ssmops.enable_transformers): the same
logits and greedy tokens as transformers' path, a compiled training step, an exported forward.

Tiny random configurations built in code (nothing is downloaded), float32, on CPU (ssmops' native
kernels) and, where a GPU is present, on CUDA (its Triton kernels, against transformers' torch path there)."""

from __future__ import annotations

import copy
import functools
import pickle
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ssmops  # noqa: E402
from ssmops.integrations import transformers as integration  # noqa: E402

from conftest import GRID_DEVICES, REPO, CountOps  # noqa: E402

try:
    integration._transformers()
except integration.UnsupportedTransformersError as error:  # e.g. an older transformers on a GPU machine
    pytest.skip(str(error), allow_module_level=True)

VOCAB = 64
_SLOW = pytest.mark.slow  # the module stays near a minute on 2 cores without these


def _config(family: str, **overrides):
    """A tiny random configuration of `family` (2 layers, one of them the family's SSM mixer at least)."""
    common = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "pad_token_id": 0,
              "eos_token_id": VOCAB - 1, "bos_token_id": 1}
    attention = {"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    # chunk_size 8 for Mamba-2 layers: the prompts below cross chunk boundaries
    settings = {
        "mamba": {"state_size": 8, "expand": 2, "conv_kernel": 4},
        "falcon_mamba": {"state_size": 8, "expand": 2, "conv_kernel": 4},
        "mamba2": {"state_size": 16, "expand": 2, "num_heads": 8, "head_dim": 8, "n_groups": 2, "chunk_size": 8,
                   "conv_kernel": 4},
        "bamba": {**attention, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 16,
                  "mamba_chunk_size": 8, "attn_layer_indices": [1]},  # layer 0 Mamba-2, layer 1 attention
        "jamba": {**attention, "num_experts": 1, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 8,
                  "mamba_dt_rank": 4},
        # two hybrid layers: a Mamba layer each, behind the shared attention block (one would tie to nothing)
        "zamba": {**attention, "num_key_value_heads": 4, "n_mamba_heads": 2, "attention_hidden_size": 64,
                  "layers_block_type": ["hybrid", "hybrid"], "mamba_d_state": 8, "mamba_dt_rank": 4},
        "zamba2": {**attention, "num_key_value_heads": 4, "n_mamba_heads": 8, "mamba_d_state": 16,
                   "mamba_ngroups": 2, "chunk_size": 8, "layers_block_type": ["mamba", "hybrid"]},
        # mup multipliers that differ per part of in_proj; Mamba and attention in parallel in each layer
        "falcon_h1": {**attention, "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 2,
                      "mamba_d_state": 16, "mamba_chunk_size": 8, "ssm_multipliers": [0.5, 1.5, 0.7, 1.3, 0.9],
                      "ssm_in_multiplier": 0.8},
        "granitemoehybrid": {**attention, "num_local_experts": 2, "num_experts_per_tok": 1,
                             "shared_intermediate_size": 32, "layer_types": ["mamba", "attention"],
                             "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 16,
                             "mamba_chunk_size": 8},
        "nemotron_h": {**attention, "head_dim": 8, "layers_block_type": ["mamba", "attention"], "mamba_num_heads": 8,
                       "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 8},
    }[family]
    cls = transformers.AutoConfig.for_model(family).__class__
    return cls(**{**common, **settings, **overrides})


# Layouts with Mamba layers only, for packed rows (attention under sdpa would see across the sequences)
_SSM_ONLY = {"mamba2": {}, "zamba2": {"layers_block_type": ["mamba", "mamba"]},
             "granitemoehybrid": {"layer_types": ["mamba", "mamba"]},
             "nemotron_h": {"layers_block_type": ["mamba", "mamba"]}}


_MODELS = {"mamba": "MambaForCausalLM", "falcon_mamba": "FalconMambaForCausalLM",
           "mamba2": "Mamba2ForCausalLM", "bamba": "BambaForCausalLM", "jamba": "JambaForCausalLM",
           "zamba": "ZambaForCausalLM", "zamba2": "Zamba2ForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
           "granitemoehybrid": "GraniteMoeHybridForCausalLM", "nemotron_h": "NemotronHForCausalLM"}


def _pair(family: str, **overrides):
    """(transformers' model, a copy with ssmops' mixers), both in eval mode. The copy is switched with
    `to_ssmops`: building under `enable_transformers` costs transformers' patch walk over all of its
    modules (~1 s a model); `test_enabled_build_switches_every_family` covers that path."""
    torch.manual_seed(0)
    reference = getattr(transformers, _MODELS[family])(_config(family, **overrides)).eval()
    model = integration.to_ssmops(copy.deepcopy(reference))
    assert integration.uses_ssmops(model) and not integration.uses_ssmops(reference)
    return reference, model


@functools.cache
def _inference_pair(family: str, device: str = "cpu"):
    """`_pair(family)` on device, built once for the tests that only run it without gradients (building
    the pair costs more than such a test of a tiny model)."""
    if device != "cpu":
        return tuple(copy.deepcopy(m).to(device) for m in _inference_pair(family))
    return _pair(family)


def _prompt(batch: int = 2, length: int = 11, device: str = "cpu") -> torch.Tensor:
    return torch.randint(2, VOCAB - 1, (batch, length), generator=torch.Generator().manual_seed(1)).to(device)


@pytest.mark.parametrize("device", GRID_DEVICES)
@pytest.mark.parametrize("family", list(_MODELS))
def test_logits_match_transformers(family, device):
    reference, model = _inference_pair(family, device)
    ids = _prompt(device=device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            expected = reference(ids, use_cache=False, **kwargs).logits
            torch.testing.assert_close(model(ids, use_cache=False, **kwargs).logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", GRID_DEVICES)
@pytest.mark.parametrize("family", list(_MODELS))
def test_greedy_generate_matches(family, device):
    reference, model = _inference_pair(family, device)
    ids = _prompt(device=device)
    settings = {"max_new_tokens": 8, "do_sample": False, "attention_mask": torch.ones_like(ids)}
    expected = reference.generate(ids, **settings)
    cached = model.generate(ids, **settings)
    uncached = model.generate(ids, use_cache=False, **settings)
    assert torch.equal(cached, expected)
    assert torch.equal(uncached, expected)


@pytest.mark.parametrize("device", GRID_DEVICES)
@pytest.mark.parametrize("family", list(_MODELS))
def test_decoding_step_logits_match(family, device):
    """The logits of single-token steps after a cached prompt (the decoding step: Mamba-1's fused
    `mamba_step` on CPU, the state update elsewhere), not only the argmax that generate compares."""
    reference, model = _inference_pair(family, device)
    ids = _prompt(length=9, device=device)
    with torch.no_grad():
        caches = [m(ids[:, :7], use_cache=True) for m in (reference, model)]
        caches = [out.cache_params if hasattr(out, "cache_params") else out.cache for out in caches]
        for t in (7, 8):
            expected = reference(ids[:, t:t + 1], cache=caches[0], use_cache=True).logits
            torch.testing.assert_close(model(ids[:, t:t + 1], cache=caches[1], use_cache=True).logits, expected,
                                       rtol=1e-4, atol=1e-5)


def test_mamba_decoding_token_is_one_fused_call_a_layer():
    """On CPU a Mamba decoding token runs each layer's mixer as one `ssmops::mamba_step` and the output
    head on `weight_only_linear`; a prompt runs the scan."""
    _, model = _inference_pair("mamba")
    ids = _prompt(length=8)
    with torch.no_grad():
        with CountOps() as prompt_ops:
            cache = model(ids[:, :7], use_cache=True).cache
        with CountOps() as token_ops:
            model(ids[:, 7:], cache=cache, use_cache=True)
    assert token_ops.counts["ssmops.mamba_step"] == model.config.num_hidden_layers
    assert token_ops.counts["ssmops.weight_only_linear"] == 1
    assert prompt_ops.counts["ssmops.mamba_step"] == 0 and prompt_ops.counts["ssmops.selective_scan_fwd"] > 0


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_decoding_calls_wrapped_projections(family):
    """A projection that is more than F.linear (PEFT's LoRA wrapper, a hook) is called as a module by
    the decoding token too, not read for its weight by the fused step or weight_only_linear."""
    reference, model = _pair(family)
    for m in (reference, model):
        for layer in m.base_model.layers:
            for proj in (layer.mixer.in_proj, layer.mixer.out_proj):
                proj.register_forward_hook(lambda module, args, out: out + 0.25)
    ids = _prompt(length=8)
    with torch.no_grad():
        caches = [m(ids[:, :7], use_cache=True).cache for m in (reference, model)]
        expected = reference(ids[:, 7:], cache=caches[0], use_cache=True).logits
        torch.testing.assert_close(model(ids[:, 7:], cache=caches[1], use_cache=True).logits, expected,
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides", [{"mamba_rms_norm": True, "mamba_norm_before_gate": False},
                                       {"mamba_rms_norm": True, "mamba_norm_before_gate": True}])
def test_falcon_h1_gated_norm_variants(overrides):
    """Falcon-H1's optional gated norm, after or before the gate (the default config gates in the scan)."""
    reference, model = _pair("falcon_h1", **overrides)
    ids = _prompt()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-5)
    settings = {"max_new_tokens": 4, "do_sample": False, "attention_mask": torch.ones_like(ids)}
    assert torch.equal(model.generate(ids, **settings), reference.generate(ids, **settings))


@pytest.mark.parametrize("family", ["mamba", "mamba2", "zamba"])
def test_prefill_in_chunks_continues_the_state(family):
    """A prompt fed in two pieces through the cache gives the logits of the whole prompt at once: the
    second piece's scan starts from the first's state (ssmops' scans take an initial state)."""
    _, model = _inference_pair(family)
    ids = _prompt(length=12)
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        first = model(ids[:, :7], use_cache=True)
        cache = first.cache_params if hasattr(first, "cache_params") else first.cache
        second = model(ids[:, 7:], cache=cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", GRID_DEVICES)
@pytest.mark.parametrize("family", list(_SSM_ONLY))
def test_packed_sequences_stay_apart(family, device):
    """A `seq_idx` keyword restarts the conv and the scan (transformers' own path ignores it without
    mamba_ssm). The CausalLM classes do not all pass their extra keywords on; the base models do."""
    _, model = _pair(family, **_SSM_ONLY[family])
    model.to(device)
    a, b = _prompt(1, 5, device), _prompt(1, 9, device)[:, 2:]
    seq_idx = torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32, device=device)
    with torch.no_grad():
        packed = model.base_model(torch.cat([a, b], 1), seq_idx=seq_idx, use_cache=False).last_hidden_state
        apart = [model.base_model(part, use_cache=False).last_hidden_state for part in (a, b)]
        torch.testing.assert_close(packed, torch.cat(apart, 1), rtol=1e-4, atol=1e-5)
        if family == "nemotron_h":  # DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s form
            cu_seqlens = torch.tensor([0, 5, 12], device=device)
            by_lengths = model.base_model(torch.cat([a, b], 1), cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                                          max_length_q=7, max_length_k=7, use_cache=False).last_hidden_state
            torch.testing.assert_close(by_lengths, packed, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides", [{}, {"mamba_rms_norm": True, "mamba_norm_before_gate": True}],
                         ids=["gate-in-scan", "gated-norm"])
def test_falcon_h1_packed_sequences_stay_apart_in_its_mixer(overrides):
    """Falcon-H1's layers run attention beside the mixer on the same input (no SSM-only layout: packed rows
    meet in attention under sdpa), and pass their keywords on to the mixer: there, a `seq_idx` restarts
    the conv and the scan, with Falcon-H1's multipliers and either way of gating."""
    _, model = _pair("falcon_h1", **overrides)
    mixer = model.base_model.layers[0].mamba
    hidden = torch.randn(1, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    seq_idx = torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32)
    with torch.no_grad():
        packed = mixer(hidden, seq_idx=seq_idx)
        apart = torch.cat([mixer(hidden[:, :5]), mixer(hidden[:, 5:])], 1)
        whole = mixer(hidden)
    torch.testing.assert_close(packed, apart, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(packed[:, 5:], whole[:, 5:], rtol=1e-4, atol=1e-5)  # the second sequence did restart


def test_bad_packing_is_named():
    """A seq_idx of the wrong shape, or cu_seq_lens_q with several rows: a ValueError naming it."""
    _, model = _inference_pair("nemotron_h")
    ids = _prompt(2, 8)
    with pytest.raises(ValueError, match=r"seq_idx must be a tensor of shape \(2, 8\)"):
        model.base_model(ids, seq_idx=torch.zeros(2, 7, dtype=torch.int32), use_cache=False)
    with pytest.raises(ValueError, match="cu_seq_lens_q .* needs batch 1"):
        model.base_model(ids, cu_seq_lens_q=torch.tensor([0, 8]), use_cache=False)


def test_packed_sequences_refused_by_mamba1_mixers():
    """Zamba passes seq_idx to its Mamba-1 mixers, whose scan cannot restart inside a row: a ValueError."""
    _, model = _inference_pair("zamba")
    with pytest.raises(ValueError, match="seq_idx"):
        model.base_model(_prompt(1, 8), seq_idx=torch.zeros(1, 8, dtype=torch.int32), use_cache=False)


# The others compile and export too (checked by hand: `_COMPILED` can take any family); the suite runs
# these to stay within its minutes on 2 cores.
_COMPILED = ["mamba", "mamba2", "zamba2", "nemotron_h"] + [
    pytest.param(family, marks=_SLOW) for family in ("falcon_mamba", "bamba")]


@pytest.mark.parametrize("family", _COMPILED)
def test_training_step_compiles_fullgraph(family):
    """torch.compile(model, fullgraph=True): forward and loss in one graph (no break anywhere in
    transformers' model either), its backward through ssmops' backward operators; loss and gradients
    as transformers' eager path. Backend aot_eager: dynamo, fake kernels and autograd as inductor would
    see them, in a tenth of inductor's compile time on 2 cores (tests/test_compile_export.py compiles
    ssmops' own models with inductor)."""
    reference, model = _pair(family)
    reference.train()
    model.train()
    ids = _prompt()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    expected = reference(ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@_SLOW
@pytest.mark.parametrize("family, device", [(family, device) for family in ("mamba2", "mamba")
                                            for device in GRID_DEVICES if device != "cpu"])
def test_training_step_compiles_fullgraph_inductor(family, device):
    """The same step with torch.compile's default backend on a GPU: ssmops' Triton kernels inside inductor's
    graph. On CPU (~40 s a family on 2 cores) the parts are checked apart: the step in one graph with
    ssmops' fake kernels and backward (the aot_eager test above), and ssmops' operators called from
    inductor's CPU code (tests/test_models.py's and tests/test_models_mamba2.py's compiled LMs and
    tests/test_compile_export.py)."""
    reference, model = (m.to(device) for m in _pair(family))
    reference.train()
    model.train()
    ids = _prompt(device=device)
    loss = torch.compile(model, fullgraph=True)(ids, labels=ids).loss
    loss.backward()
    expected = reference(ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    mixer, reference_mixer = model.backbone.layers[0].mixer, reference.backbone.layers[0].mixer
    torch.testing.assert_close(mixer.A_log.grad, reference_mixer.A_log.grad, rtol=1e-4, atol=1e-6)


class _RepeatKV(torch.nn.Module):
    """transformers' `repeat_kv` (attention with fewer key/value heads than query heads): an expand, then a reshape."""

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        batch, heads, length, dim = keys.shape
        return keys[:, :, None].expand(batch, heads, 2, length, dim).reshape(batch, 2 * heads, length, dim)


@functools.cache
def _length_dim():
    """The dynamic length to export with: a named range, as users write it, where this torch's export can
    prove its own guards on `repeat_kv`. torch 2.11's cannot (2.13's can), on any device, with or without
    ssmops: the reshape gives the heads a stride `min(8*L, 16*L)`, and the guard `min(8*L, 16*L) == 8*L`,
    true for every length, stops the export as a constraint violation (Bamba's and NemotronH's exports on an
    H100 with torch 2.11; their CPU exports there would have stopped too). `Dim.DYNAMIC` checks each guard
    against the traced length instead, and exports these models on that torch (docs/limits.md)."""
    seqlen = torch.export.Dim("seqlen", min=2, max=64)
    try:
        torch.export.export(_RepeatKV(), (torch.zeros(2, 2, 11, 8),), dynamic_shapes={"keys": {2: seqlen}})
    except torch._dynamo.exc.UserError:
        return torch.export.Dim.DYNAMIC
    return seqlen


@pytest.mark.parametrize("device", GRID_DEVICES)
@pytest.mark.parametrize("family", _COMPILED)
def test_export_forward(family, device):
    """The forward exported with a dynamic sequence length, then run at another length. On CUDA the
    attention layers run eagerly: with SDPA, Zamba2's export stopped on a guard on the length padded to
    a multiple of 8 (`L*(8 + L - L%8) > 1`, the form of SDPA's padded mask), which export's solver
    cannot prove for a dynamic length (torch 2.11, H100)."""
    reference, model = (m.to(device) for m in _pair(family, **({"attn_implementation": "eager"}
                                                                if device != "cpu" else {})))
    model.config.use_cache = False  # not as a keyword: Granite's forward takes it in **kwargs, which export refuses
    program = torch.export.export(model, (_prompt(device=device),), dynamic_shapes={"input_ids": {1: _length_dim()}})
    ops = [str(n.target) for n in program.graph.nodes
           if n.op == "call_function" and str(n.target).startswith("ssmops.")]
    mixers = [m for m in model.modules() if type(m) in integration._mixer_classes.values()]
    scans, convs = [op for op in ops if "scan" in op], [op for op in ops if "causal_conv1d" in op]
    assert len(scans) == len(convs) == len(mixers) > 0 and len(ops) == 2 * len(mixers), \
        "one ssmops conv and one scan per Mamba layer in the exported graph"
    ids = _prompt(2, 23, device)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(ids).logits, reference(ids, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-5)


def test_from_pretrained_one_line(tmp_path):
    """The user's flow: a saved checkpoint, `ssmops.enable_transformers()`, `from_pretrained`."""
    reference, _ = _pair("mamba2")
    reference.save_pretrained(tmp_path)
    with ssmops.enable_transformers():
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model) is type(reference) and integration.uses_ssmops(model)
    ids = _prompt()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)


def test_gradient_checkpointing_mamba2():
    """transformers' gradient checkpointing re-runs the ssmops mixers in the backward: same loss and grads."""
    reference, model = _pair("mamba2")
    ids = _prompt()
    for m in (reference, model):
        m.gradient_checkpointing_enable()
        m.train()
        m(ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", ["mamba", pytest.param("mamba2", marks=_SLOW)])
def test_peft_lora_with_trainer(family, tmp_path):
    """LoRA on in_proj (PEFT) trained by transformers' Trainer: the same losses, step by step, as
    transformers' own path (PEFT refuses out_proj and conv1d on Mamba models, whichever path runs)."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

    def train(model):
        torch.manual_seed(0)
        model = peft.get_peft_model(model.train(), peft.LoraConfig(r=4, target_modules=["in_proj"],
                                                                   task_type="CAUSAL_LM"))
        rows = _prompt(4, 16)
        data = [{"input_ids": row, "labels": row, "attention_mask": torch.ones_like(row)} for row in rows]
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                                              learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
                                              save_strategy="no", disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        assert integration.uses_ssmops(model) == (model.base_model.model is ours)
        return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])

    reference, ours = _pair(family)
    torch.testing.assert_close(train(ours), train(reference), rtol=1e-4, atol=1e-5)


def test_enabled_build_switches_every_family():
    """While enabled, transformers' build (from_pretrained and from_config run it inside `apply_patches`)
    gives every family's mixers on ssmops, NemotronH's too (its block builds them from a table)."""
    from transformers.monkey_patching import apply_patches

    with ssmops.enable_transformers(), apply_patches():  # one patch walk for the ten builds
        models = {family: getattr(transformers, name)(_config(family)) for family, name in _MODELS.items()}
    for family, model in models.items():
        mixers = [m for m in model.modules() if isinstance(m, integration.mixer_class(family).__mro__[1])]
        assert mixers and all(type(m) is integration.mixer_class(family) for m in mixers), family
    nemotron = models["nemotron_h"]
    assert not integration.uses_ssmops(integration.from_ssmops(nemotron))
    assert type(nemotron.model.layers[0]) is transformers.models.nemotron_h.modeling_nemotron_h.NemotronHBlock


def test_enable_disable_leave_transformers_as_shipped():
    from transformers.models.mamba.modeling_mamba import MambaMixer
    from transformers.monkey_patching import get_patch_mapping

    config = _config("mamba")
    before = transformers.MambaForCausalLM._from_config(config)
    handle = ssmops.enable_transformers(["mamba"])
    try:
        during = transformers.AutoModelForCausalLM.from_config(config)
        falcon = transformers.FalconMambaForCausalLM._from_config(_config("falcon_mamba"))  # not asked for
    finally:
        ssmops.disable_transformers()
    after = transformers.MambaForCausalLM._from_config(config)
    assert handle is not None and not get_patch_mapping()
    assert integration.uses_ssmops(during)
    assert not any(map(integration.uses_ssmops, (before, after, falcon)))
    assert type(after.backbone.layers[0].mixer) is MambaMixer
    assert isinstance(during.backbone.layers[0].mixer, MambaMixer)  # a subclass: isinstance checks hold
    assert type(during.backbone.layers[0].mixer).__name__ == "MambaMixer"  # _no_split_modules go by name
    assert integration.uses_ssmops(pickle.loads(pickle.dumps(during)))  # torch.save(model) keeps the mixers

    keys = before.state_dict().keys()
    integration.to_ssmops(before)  # an already built model, in place, and back
    assert integration.uses_ssmops(before) and type(before.lm_head) is integration.DecodingHead
    assert before.lm_head.weight is before.backbone.embeddings.weight  # still tied
    assert before.state_dict().keys() == keys
    assert not integration.uses_ssmops(integration.from_ssmops(before))
    assert type(before.lm_head) is torch.nn.Linear


def test_unsupported_is_named(monkeypatch):
    with pytest.raises(integration.UnsupportedTransformersError, match="'rwkv' is not supported"):
        ssmops.enable_transformers(["mamba", "rwkv"])
    with pytest.raises(integration.UnsupportedTransformersError, match="model_type 'gpt2'"):
        integration.to_ssmops(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)))
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(integration.UnsupportedTransformersError, match=r"transformers 4\.57\.1 is not supported"):
        ssmops.enable_transformers()


def test_ssmops_without_transformers():
    """Without transformers, ssmops imports (and never imports transformers) and runs; the integration
    says what it needs."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import torch, ssmops\n"
        "u = torch.randn(1, 4, 6); A = -torch.rand(4, 3)\n"
        "ssmops.selective_scan_fn(u, u.abs(), A, torch.randn(1, 3, 6), torch.randn(1, 3, 6))\n"
        "try:\n    ssmops.enable_transformers()\nexcept ImportError as e:\n    print('ImportError:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ImportError: ssmops.enable_transformers needs transformers" in result.stdout
