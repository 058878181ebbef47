"""`MambaLMHeadModel`: mamba_ssm's Mamba language model (Mamba-1, Mamba-2, hybrids with attention)
on the ssmops operators.

Same state_dict layout as `mamba_ssm.models.mixer_seq_simple.MambaLMHeadModel`
(`backbone.embedding.weight`, `backbone.layers.{i}.mixer.*`, `backbone.layers.{i}.norm.weight`,
`backbone.norm_f.weight`, `lm_head.weight` tied to the embedding), so mamba_ssm
checkpoints load as they are; Hugging Face transformers `MambaForCausalLM`,
`Mamba2ForCausalLM` and `BambaForCausalLM` checkpoints load through `convert_hf_config` /
`convert_hf_state_dict` (transformers itself is never imported).

    model = MambaLMHeadModel.from_pretrained("path/to/checkpoint_dir")   # either format
    out = model.generate(input_ids, max_length=64)                        # greedy
"""

from __future__ import annotations

import json
import math
from collections import namedtuple
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from .._registry import operator_for
from ..checkpoint import load_state_dict
from ..layernorm_gated import rmsnorm_fn
from ..modules.linear import WEIGHT_FORMATS, Linear
from ..modules.mamba import Mamba
from ..modules.mlp import GatedMLP
from .config_mamba import MambaConfig
from .convert_hf import convert_hf_config, convert_hf_state_dict, is_hf_config
from .generation import GenerationOutput, InferenceParams, decode


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rmsnorm_fn(x, self.weight, eps=self.eps)


class Block(nn.Module):
    """Pre-norm residual block: residual += hidden; hidden = mixer(norm(residual)), then, with an
    MLP, residual += hidden; hidden = mlp(norm2(residual)).

    Returns (hidden_states, residual) like mamba_ssm's Block; the residual stream is
    kept in float32 when `residual_in_fp32`."""

    def __init__(self, dim: int, mixer: nn.Module, norm: nn.Module, residual_in_fp32: bool = False,
                 mlp: nn.Module | None = None, norm2: nn.Module | None = None):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.mixer = mixer
        self.norm = norm
        if mlp is not None:
            self.norm2 = norm2
        self.mlp = mlp

    def _add_norm(self, hidden_states: Tensor, residual: Tensor | None, norm: nn.Module) -> tuple[Tensor, Tensor]:
        residual = hidden_states + residual if residual is not None else hidden_states
        hidden_states = norm(residual.to(norm.weight.dtype))
        return hidden_states, residual.float() if self.residual_in_fp32 else residual

    def forward(self, hidden_states: Tensor, residual: Tensor | None = None, inference_params=None,
                **mixer_kwargs):
        hidden_states, residual = self._add_norm(hidden_states, residual, self.norm)
        hidden_states = self.mixer(hidden_states, inference_params=inference_params, **mixer_kwargs)
        if self.mlp is not None:
            hidden_states, residual = self._add_norm(hidden_states, residual, self.norm2)
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)


def _norm(config: MambaConfig, device, dtype) -> nn.Module:
    if config.rms_norm:
        return RMSNorm(config.d_model, eps=config.norm_epsilon, device=device, dtype=dtype)
    return nn.LayerNorm(config.d_model, eps=config.norm_epsilon, device=device, dtype=dtype)


class MixerModel(nn.Module):
    def __init__(self, config: MambaConfig, device=None, dtype=None, *,
                 context_parallel_group: ProcessGroup | DeviceMesh | None = None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.residual_in_fp32 = config.residual_in_fp32
        self.embedding = nn.Embedding(config.padded_vocab_size, config.d_model, **factory)
        self.layers = nn.ModuleList(
            Block(
                config.d_model,
                config.mixer(i, device, dtype, context_parallel_group),
                _norm(config, device, dtype),
                residual_in_fp32=config.residual_in_fp32,
                mlp=GatedMLP(config.d_model, hidden_features=config.d_intermediate, out_features=config.d_model,
                             **factory) if config.d_intermediate > 0 else None,
                norm2=_norm(config, device, dtype) if config.d_intermediate > 0 else None,
            )
            for i in range(config.n_layer)
        )
        self.norm_f = _norm(config, device, dtype)

    def forward(self, input_ids: Tensor, inference_params=None, **mixer_kwargs) -> Tensor:
        hidden_states = self.embedding(input_ids)
        residual = None
        layers_step = self._layers_step_arguments(hidden_states, inference_params, mixer_kwargs)
        if layers_step is not None:
            return self._layers_step(*layers_step).unsqueeze(1)
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, inference_params=inference_params,
                                            **mixer_kwargs)
        return self._final_norm(hidden_states, residual)

    def _final_norm(self, hidden_states: Tensor, residual: Tensor | None) -> Tensor:
        residual = hidden_states + residual if residual is not None else hidden_states
        return self.norm_f(residual.to(self.norm_f.weight.dtype))

    def _layers_step(self, hidden_states: Tensor, *arguments) -> Tensor:
        """One token (batch, d_model) through every layer by one `mamba_layers_step` call with the rest
        of `_layers_step_arguments`, and norm_f: the normed output, (batch, d_model)."""
        hidden_states, residual = operator_for("mamba_layers_step", hidden_states)(hidden_states, *arguments)
        if arguments[-1] is not None:  # final_norm_weight: norm_f applied by the operator
            return hidden_states
        return self._final_norm(hidden_states, residual)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        return {
            i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
            for i, layer in enumerate(self.layers)
        }

    def _layers_step_arguments(self, hidden_states: Tensor, inference_params, mixer_kwargs: dict) -> list | None:
        """`mamba_layers_step`'s arguments for one decoding token through every layer, or None where it
        does not serve: a layer that is not a Mamba-1 block with RMSNorm and no MLP, or whose mixer's
        `step` would not be one `mamba_step` call (CPU, float32 activations and states, no autograd),
        or norms of different eps. The last argument, final_norm_weight, is norm_f's weight where the
        operator can apply norm_f too (RMSNorm of the same eps, float32), else None."""
        if (inference_params is None or inference_params.seqlen_offset == 0 or mixer_kwargs
                or hidden_states.shape[1] != 1 or len(self.layers) == 0):
            return None
        eps = self.layers[0].norm.eps if isinstance(self.layers[0].norm, RMSNorm) else None
        conv_states, ssm_states, norm_weights, mixers = [], [], [], []
        for layer in self.layers:
            mixer, norm = layer.mixer, layer.norm
            if (layer.mlp is not None or not isinstance(mixer, Mamba) or not isinstance(norm, RMSNorm)
                    or norm.eps != eps or norm.weight.dtype != torch.float32):
                return None
            conv_state, ssm_state = mixer._get_states_from_cache(inference_params, hidden_states.shape[0])
            if not mixer.fused_step_serves(hidden_states, conv_state, ssm_state):
                return None
            conv_states.append(conv_state)
            ssm_states.append(ssm_state)
            norm_weights.append(norm.weight)
            mixers.append(mixer.step_parameters())
        norm_f = self.norm_f
        fuses_norm_f = isinstance(norm_f, RMSNorm) and norm_f.eps == eps and norm_f.weight.dtype == torch.float32
        return [hidden_states.squeeze(1), None, conv_states, ssm_states, norm_weights, eps,
                *map(list, zip(*mixers, strict=True)), norm_f.weight if fuses_norm_f else None]


CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])


def _init_weights(module: nn.Module, n_layer: int, initializer_range: float = 0.02,
                  rescale_prenorm_residual: bool = True, n_residuals_per_layer: int = 1) -> None:
    """mamba_ssm's initialisation: zero Linear biases (but dt_proj's), N(0, 0.02) embeddings,
    and out_proj scaled by 1/sqrt(n_layer) (GPT-2's residual rescaling)."""
    if isinstance(module, nn.Linear):
        if module.bias is not None and not getattr(module.bias, "_no_reinit", False):
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                with torch.no_grad():
                    p /= math.sqrt(n_residuals_per_layer * n_layer)


class MambaLMHeadModel(nn.Module):
    """Mamba language model: input_ids (batch, seqlen) -> CausalLMOutput(logits (batch, seqlen, vocab)).

    `vocab` is the padded vocabulary size. The forward runs the scan operator, so the
    model trains under `torch.compile(fullgraph=True)` and exports; `generate` decodes
    with the recurrent state.

    With `context_parallel_group` (a torch.distributed process group or 1-D DeviceMesh) each rank's forward takes
    its shard of the sequence, input_ids (batch, shard length), and returns its shard's logits
    (see ssmops.distributed and docs/distributed.md); attention layers are then refused."""

    def __init__(self, config: MambaConfig, initializer_cfg: dict | None = None, device=None, dtype=None, *,
                 context_parallel_group: ProcessGroup | DeviceMesh | None = None):
        super().__init__()
        self.config = config
        self.backbone = MixerModel(config, device=device, dtype=dtype, context_parallel_group=context_parallel_group)
        self.lm_head = Linear(config.d_model, config.padded_vocab_size, bias=False, device=device, dtype=dtype)
        self.apply(partial(_init_weights, n_layer=config.n_layer, **(initializer_cfg or {}),
                           n_residuals_per_layer=1 if config.d_intermediate == 0 else 2))
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        return self.backbone.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def decoding_step(self, memory: dict, batch_size: int) -> Callable[[Tensor], Tensor] | None:
        """A one-token step for the tokens after a prompt, input_ids (batch, 1) -> logits (batch, vocab),
        advancing the caches `memory` (InferenceParams.key_value_memory_dict) in place, with every
        layer's arguments to one `mamba_layers_step` call gathered once, here: None where that
        operator does not serve every layer (see MixerModel._layers_step_arguments). It reads the
        parameters and caches it was made with, so it serves one generation.

        Measured on CPU at mamba-130m's shape (docs/limits.md): ~1.05x (fp32) and ~1.12x (int8) the
        speed of `step_logits` compiled into one graph, whose per-token work outside the operators
        (dynamo, the graph's wrapper, ~400 tensors passed in) this leaves out."""
        backbone = self.backbone
        params = InferenceParams(max_seqlen=0, max_batch_size=batch_size, seqlen_offset=1,
                                 key_value_memory_dict=memory)
        like = backbone.embedding.weight.new_empty(batch_size, 1, self.config.d_model)
        arguments = backbone._layers_step_arguments(like, params, {})
        if arguments is None:
            return None
        layer_arguments = arguments[1:]

        def step(input_ids: Tensor) -> Tensor:
            return self.lm_head(backbone._layers_step(backbone.embedding(input_ids[:, -1]), *layer_arguments))

        return step

    @torch.no_grad()
    def convert_weights(self, weights: str, keep_float: Iterable[str] = ()) -> MambaLMHeadModel:
        """Stores the weights of the linear layers (mixers' projections, Mamba's x_proj and dt_proj
        included, MLPs, the output head) in `weights` format for inference: "fp32", "bf16", "fp16"
        or "int8" (symmetric, a float32 scale per output feature). Activations, norms, the scan and
        its state keep the model's dtype, and so does the embedding (one row read a token). A tied
        output head gets its own converted copy. `keep_float` names linear layers that keep the
        model's dtype: a module name (`"lm_head"`) or its last parts (`"x_proj"`, `"mixer.dt_proj"`:
        every layer's). In place; returns the model. The converted model is for inference:
        training needs float weights."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        if isinstance(keep_float, str):
            keep_float = (keep_float,)
        kept = set()
        for pattern in keep_float:
            matches = {name for name in linears if name == pattern or name.endswith("." + pattern)}
            if not matches:
                raise ValueError(f"keep_float names no linear layer of the model: {pattern!r} "
                                 f"(its linear layers: {', '.join(sorted(linears)[:4])}, ...)")
            kept |= matches
        tied = self.lm_head.weight is self.backbone.embedding.weight
        if tied and "lm_head" not in kept and self.lm_head.weight.dtype != WEIGHT_FORMATS[weights]:
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.detach().clone())
        for name, module in linears.items():
            if name not in kept:
                module.convert_weight(weights)
        return self

    def forward(self, input_ids: Tensor, position_ids=None, inference_params=None, num_last_tokens: int = 0,
                **mixer_kwargs) -> CausalLMOutput:
        """`num_last_tokens > 0` computes logits for the last that many positions only.
        `mixer_kwargs` go to every mixer: `seq_idx` (batch, seqlen) int32 for packed sequences
        (Mamba2 and attention layers)."""
        hidden_states = self.backbone(input_ids, inference_params=inference_params, **mixer_kwargs)
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        return CausalLMOutput(logits=self.lm_head(hidden_states))

    def generate(
        self,
        input_ids: Tensor,
        max_length: int,
        top_k: int = 1,
        top_p: float = 0.0,
        min_p: float = 0.0,
        temperature: float = 1.0,
        return_dict_in_generate: bool = False,
        output_scores: bool = False,
        **kwargs,
    ) -> Tensor | GenerationOutput:
        """mamba_ssm's `generate`: `max_length` tokens in all (prompt included); greedy when
        top_k == 1, else sampling (see `ssmops.models.generation.sample`). Other keyword
        arguments go to `ssmops.models.generation.decode` (eos_token_id, vocab_size,
        repetition_penalty, streamer, and `cg=True`, mamba_ssm's CUDA-graph flag: the one-token step
        captured in a CUDA graph on CUDA, compiled into one graph elsewhere); mamba_ssm's
        `enable_timing` is accepted and ignored. Returns the sequences, or a GenerationOutput
        when `return_dict_in_generate`."""
        kwargs.pop("enable_timing", None)
        out = decode(
            input_ids, self, max_length, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature,
            output_scores=output_scores, **kwargs,
        )
        return out if return_dict_in_generate else out.sequences

    # --- loading ----------------------------------------------------------------------

    @classmethod
    def from_state_dict(cls, config: MambaConfig | dict, state_dict: dict, device=None, dtype=None,
                        weights: str | None = None):
        """A model with `config` (a MambaConfig or mamba_ssm's config dict) holding
        `state_dict` (mamba_ssm's key names; `lm_head.weight` may be absent when tied), its
        linear layers' weights converted to `weights` format when given (see convert_weights)."""
        if isinstance(config, dict):
            config = MambaConfig.from_dict(config)
        converted = sorted(k for k in state_dict if k.endswith(".weight_scale"))
        if converted:
            raise ValueError(f"the state_dict holds int8 weights written after convert_weights ({converted[0]}, ...): "
                             "load the float checkpoint with weights='int8' instead")
        model = cls(config, device=device, dtype=dtype)
        state_dict = dict(state_dict)
        if config.tie_embeddings and "lm_head.weight" not in state_dict:
            state_dict["lm_head.weight"] = state_dict.get("backbone.embedding.weight")
        model.load_state_dict(state_dict, strict=True)
        return model.convert_weights(weights) if weights is not None else model

    @classmethod
    def from_pretrained(cls, path: str | Path, device=None, dtype=None, weights: str | None = None):
        """Loads a local checkpoint directory (nothing is downloaded): mamba_ssm's
        (config.json with d_model/n_layer/... + pytorch_model.bin or model.safetensors) or
        transformers' (config.json with model_type mamba, mamba2 or bamba, hidden_size, ...
        + model.safetensors, sharded or not, or pytorch_model.bin), told apart by config.json.
        `weights="bf16"` / `"int8"` / ... converts the linear layers for decoding (convert_weights)."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        state_dict = _load_checkpoint_dir(path)
        if is_hf_config(config):
            config, state_dict = convert_hf_config(config), convert_hf_state_dict(state_dict)
        return cls.from_state_dict(config, state_dict, device=device, dtype=dtype, weights=weights)

    @classmethod
    def from_hf(cls, hf_model, device=None, dtype=None, weights: str | None = None):
        """From a live transformers Mamba/Mamba2/BambaForCausalLM (duck-typed: `.config` and `.state_dict()`)."""
        return cls.from_state_dict(
            convert_hf_config(hf_model.config), convert_hf_state_dict(hf_model.state_dict()), device=device,
            dtype=dtype, weights=weights,
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Writes config.json + pytorch_model.bin in mamba_ssm's layout."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        torch.save(self.state_dict(), path / "pytorch_model.bin")


_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth")


def _load_checkpoint_dir(path: Path) -> dict:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state_dict = {}
            for shard in shards:
                state_dict.update(load_state_dict(path / shard))
            return state_dict
    for name in _WEIGHT_FILES:
        if (path / name).exists():
            return load_state_dict(path / name)
    raise FileNotFoundError(f"no weights in {path}: expected one of {', '.join(_WEIGHT_FILES)} or a shard index")
