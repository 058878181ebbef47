"""Hugging Face transformers checkpoints as mamba_ssm-layout models (transformers is never imported).

Three transformers families map onto `MambaLMHeadModel`'s blocks exactly:

- `MambaForCausalLM` ("mamba"): Mamba-1 blocks; only the embedding's key is renamed.
- `Mamba2ForCausalLM` ("mamba2"): Mamba-2 blocks (gated norm before the gate's product,
  i.e. norm_before_gate=False, over n_groups groups); the same key renaming.
- `BambaForCausalLM` ("bamba"): Mamba-2 and attention layers, each followed by a gated MLP
  (`d_intermediate`), rotary embedding on half of each attention head. q/k/v projections
  are concatenated into `in_proj`, gate/up into `fc1`.

Hybrids whose layers do not have this shape are refused by name (Zamba2's shared attention
blocks, NemotronH's separate MLP-only layers, Granite 4.0's and Falcon-H1's multipliers and
experts).
"""

from __future__ import annotations

import torch

from .config_mamba import MambaConfig


def is_hf_config(config: dict) -> bool:
    return "model_type" in config or "hidden_size" in config


def convert_hf_config(hf_config) -> MambaConfig:
    """A transformers config (an object or its dict) of model_type mamba, mamba2 or bamba ->
    MambaConfig. Raises ValueError naming what does not map."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    model_type = c.get("model_type", "mamba")
    if model_type not in _CONFIGS:
        raise ValueError(f"transformers model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(sorted(_CONFIGS))}")
    if c.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act={c['hidden_act']!r}: Mamba blocks use silu")
    return MambaConfig(
        d_model=c["hidden_size"],
        n_layer=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
        rms_norm=True,
        fused_add_norm=False,
        pad_vocab_size_multiple=1,  # transformers' vocab_size is the embedding's row count
        **_CONFIGS[model_type](c),
    )


def _mamba1_config(c: dict) -> dict:
    return {
        "ssm_cfg": {
            "d_state": c.get("state_size", 16),
            "d_conv": c.get("conv_kernel", 4),
            "expand": c.get("expand", 2),
            "dt_rank": c.get("time_step_rank", "auto"),
            "conv_bias": c.get("use_conv_bias", True),
            "bias": c.get("use_bias", False),
        },
        "residual_in_fp32": c.get("residual_in_fp32", True),
        "tie_embeddings": c.get("tie_word_embeddings", True),
        "norm_epsilon": c.get("layer_norm_epsilon", 1e-5),
    }


def _mamba2_block(c: dict, *, nheads: int, headdim: int, expand: int, eps: float, **block) -> dict:
    if expand * c["hidden_size"] != nheads * headdim:
        raise ValueError(f"expand * hidden_size ({expand} * {c['hidden_size']}) must equal the heads' width "
                         f"({nheads} * {headdim}) for a Mamba-2 block")
    return {"layer": "Mamba2", "expand": expand, "headdim": headdim, "rmsnorm": True, "norm_before_gate": False,
            "rmsnorm_eps": eps, "dt_limit": _dt_limit(c.get("time_step_limit")), **block}


def _dt_limit(limit) -> tuple[float, float]:
    """time_step_limit as floats: transformers' config.json writes infinity as {"__float__": "Infinity"}."""
    if not limit:
        return (0.0, float("inf"))
    return tuple(float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)


def _mamba2_config(c: dict) -> dict:
    eps = c.get("layer_norm_epsilon", 1e-5)
    return {
        "ssm_cfg": _mamba2_block(
            c, nheads=c["num_heads"], headdim=c["head_dim"], expand=c.get("expand", 2), eps=eps,
            d_state=c.get("state_size", 128), d_conv=c.get("conv_kernel", 4), ngroups=c.get("n_groups", 8),
            conv_bias=c.get("use_conv_bias", True), bias=c.get("use_bias", False),
            chunk_size=c.get("chunk_size", 256),
        ),
        "residual_in_fp32": c.get("residual_in_fp32", True),
        "tie_embeddings": c.get("tie_word_embeddings", False),
        "norm_epsilon": eps,
    }


def _bamba_config(c: dict) -> dict:
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r}: only the default rotary embedding maps onto MHA")
    if c["intermediate_size"] % 128:
        raise ValueError(f"intermediate_size {c['intermediate_size']} is not a multiple of 128, which "
                         "mamba_ssm's GatedMLP rounds its width to")
    eps = c.get("rms_norm_eps", 1e-5)
    expand = c.get("mamba_expand", 2)
    headdim = c.get("mamba_d_head", "auto")
    headdim = expand * hidden // c["mamba_n_heads"] if headdim == "auto" else headdim
    return {
        "d_intermediate": c["intermediate_size"],
        "ssm_cfg": _mamba2_block(
            c, nheads=c["mamba_n_heads"], headdim=headdim, expand=expand, eps=eps, d_state=c.get("mamba_d_state", 256),
            d_conv=c.get("mamba_d_conv", 4), ngroups=c.get("mamba_n_groups", 1),
            conv_bias=c.get("mamba_conv_bias", True), bias=c.get("mamba_proj_bias", False),
            chunk_size=c.get("mamba_chunk_size", 256),
        ),
        "attn_layer_idx": list(c.get("attn_layer_indices") or []),
        "attn_cfg": {
            "num_heads": heads, "num_heads_kv": c.get("num_key_value_heads") or heads, "head_dim": head_dim,
            "qkv_proj_bias": c.get("attention_bias", False), "out_proj_bias": c.get("attention_bias", False),
            "causal": True, "rotary_emb_dim": int(head_dim * rope.get("partial_rotary_factor", 0.5)),
            "rotary_emb_base": rope.get("rope_theta", c.get("rope_theta", 10000.0)),
        },
        "residual_in_fp32": False,
        "tie_embeddings": c.get("tie_word_embeddings", False),
        "norm_epsilon": eps,
    }


_CONFIGS = {"mamba": _mamba1_config, "mamba2": _mamba2_config, "bamba": _bamba_config}

# Bamba's per-layer names -> mamba_ssm's Block names
_BAMBA_RENAMES = {
    "input_layernorm.": "norm.", "pre_ff_layernorm.": "norm2.", "mamba.": "mixer.",
    "self_attn.o_proj.": "mixer.out_proj.", "feed_forward.down_proj.": "mlp.fc2.",
}


def convert_hf_state_dict(state_dict: dict) -> dict:
    """transformers keys -> mamba_ssm's. Mamba and Mamba2: `backbone.embeddings.weight` becomes
    `backbone.embedding.weight`, every other key is already the same. Bamba (`model.*` keys):
    layers are renamed to mamba_ssm's Block, `self_attn.{q,k,v}_proj` concatenated into
    `mixer.in_proj` and `feed_forward.{up,gate}_proj` into `mlp.fc1` (y, then gate)."""
    if not any(k.startswith("model.layers.") for k in state_dict):
        return {("backbone.embedding.weight" if k == "backbone.embeddings.weight" else k): v
                for k, v in state_dict.items()}
    out, fused = {}, {}
    for key, value in state_dict.items():
        if key == "model.embed_tokens.weight":
            out["backbone.embedding.weight"] = value
        elif key == "model.final_layernorm.weight":
            out["backbone.norm_f.weight"] = value
        elif key.startswith("model.layers."):
            _, _, index, rest = key.split(".", 3)
            prefix = f"backbone.layers.{index}."
            part = next((p for p in ("q_proj", "k_proj", "v_proj", "up_proj", "gate_proj") if f".{p}." in rest), None)
            if part is not None:  # gathered and concatenated below
                target = "mixer.in_proj." if part in ("q_proj", "k_proj", "v_proj") else "mlp.fc1."
                fused.setdefault(prefix + target + rest.rsplit(".", 1)[1], {})[part] = value
                continue
            old = next((o for o in _BAMBA_RENAMES if rest.startswith(o)), None)
            out[prefix + (_BAMBA_RENAMES[old] + rest[len(old):] if old else rest)] = value
        else:
            out[key] = value
    for key, parts in fused.items():
        order = ("q_proj", "k_proj", "v_proj") if ".mixer." in key else ("up_proj", "gate_proj")
        missing = [p for p in order if p not in parts]
        if missing:
            raise ValueError(f"checkpoint lacks {missing} for {key}")
        out[key] = torch.cat([parts[p] for p in order], dim=0)
    return out
