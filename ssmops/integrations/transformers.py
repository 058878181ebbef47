"""transformers' own Mamba-family models with their SSM mixers on ssmops.

    import ssmops
    ssmops.enable_transformers()        # then, as usual:
    model = AutoModelForCausalLM.from_pretrained("state-spaces/mamba-130m-hf")

The model stays transformers' model (same class, parameters, state_dict, cache, `generate`,
tokenizer, PEFT and Trainer); only each mixer's forward changes: its conv, scan, decoding step
and gated norm are ssmops' (`causal_conv1d`, `selective_scan_fn` / `mamba_chunk_scan_combined`,
`selective_state_update`, `rmsnorm_fn`), so they run natively on CPU, on Triton on CUDA, in
pure PyTorch elsewhere, and compile (`fullgraph=True`) and export as operators.

How: transformers' class-replacement registry (`transformers.monkey_patching.register_patch_mapping`,
which `from_pretrained`, `from_config` and `apply_patches()` apply while they build a model) maps
each supported mixer class name to a subclass of transformers' own mixer that overrides `forward`
alone. Nothing of transformers is modified: `disable_transformers()` (or leaving the `with` block)
unregisters the mapping, and models built before or after are transformers' as shipped. A model
built otherwise (`MambaForCausalLM(config)`) switches with `to_ssmops(model)` and back with
`from_ssmops(model)`. `to_ssmops` also makes the output head's decoding token stream its weights
once (`DecodingHead`: a third of a 130m model's reads per token); the registry cannot reach the
head, which the model builds from torch's own nn.Linear, so for the fastest decoding call
`to_ssmops(model)` on a model `from_pretrained` built as well (it keeps mixers already switched).

Families (model_type): the Mamba-1 mixers of mamba, falcon_mamba, jamba and zamba, the Mamba-2 mixers
of mamba2, bamba, zamba2, granitemoehybrid (Granite 4.0), nemotron_h and falcon_h1; attention, MLPs and
experts stay transformers'. transformers itself is imported only when one of these functions is called.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._registry import operator_for
from ..layernorm_gated import rmsnorm_fn
from ..causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from ..ops.mamba_step.packing import FUSED_STEP_MAX_BATCH, fused_step_serves, step_arguments
from ..selective_scan import selective_scan_fn
from ..linear import weight_only_linear
from ..modules.decay import decay_rates
from ..ssd_combined import mamba_chunk_scan_combined
from ..state_update import selective_state_update

# The transformers releases whose mixers these forwards were written against and tested with
# (the Cache methods `get_conv_state`, `update_conv_state`, `get_recurrent_state`,
# `update_recurrent_state`, `is_recording_past`, and the patch registry).
SUPPORTED_TRANSFORMERS = (">=5.24", "<6")
_MIN_VERSION, _MAX_VERSION = (5, 24), (6, 0)


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers, or the model family asked for, is not one this integration supports."""


def _apply_mask(hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Zero the padding positions (transformers' mixers do the same, before in_proj and after the conv)."""
    if attention_mask is None:
        return hidden_states
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def _states(mixer: nn.Module, cache) -> tuple[Tensor | None, Tensor | None]:
    if cache is None:
        return None, None
    return (cache.get_conv_state(mixer.layer_idx, state_idx=0),
            cache.get_recurrent_state(mixer.layer_idx, state_idx=0))


def _conv(mixer: nn.Module, x: Tensor, cache, conv_state: Tensor | None, seq_idx: Tensor | None = None) -> Tensor:
    """The mixer's depthwise causal conv + silu on x (batch, dim, seqlen), with transformers' cache:
    one token updates the conv window in place; a prompt (or a chunk while the cache records its
    past) goes through `update_conv_state`, which returns the window's left context and the new inputs
    (the context counts as sequence 0 of a `seq_idx`, as the scan's initial state does)."""
    seq_len = x.shape[-1]
    weight, bias = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias
    if conv_state is not None and seq_len == 1 and not cache.is_recording_past(mixer.layer_idx):
        return causal_conv1d_update(x[..., 0], conv_state, weight, bias, activation="silu").unsqueeze(-1)
    if cache is None:
        return causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    x = cache.update_conv_state(x, mixer.layer_idx, conv_kernel_size=mixer.conv_kernel_size)
    if seq_idx is not None:
        seq_idx = F.pad(seq_idx, (x.shape[-1] - seq_len, 0), value=0)
    return causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")[..., -seq_len:]


def _packed_seq_idx(kwargs: dict, batch: int, seq_len: int, device: torch.device) -> Tensor | None:
    """The packing of a row as `seq_idx` (batch, seqlen) int32: transformers' `seq_idx` keyword
    (DataCollatorWithFlattening(return_seq_idx=True)), or one made from its `cu_seq_lens_q`
    (return_flash_attn_kwargs=True: the cumulative lengths of the sequences packed in a batch-1 row)."""
    seq_idx = kwargs.get("seq_idx")
    if seq_idx is not None:
        if not isinstance(seq_idx, Tensor) or tuple(seq_idx.shape) != (batch, seq_len):
            raise ValueError(f"seq_idx must be a tensor of shape ({batch}, {seq_len}) (batch, seqlen), got "
                             f"{tuple(seq_idx.shape) if isinstance(seq_idx, Tensor) else type(seq_idx).__name__}")
        return seq_idx.to(torch.int32)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return None
    if batch != 1 or not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, Tensor) else repr(cu_seqlens)
        raise ValueError(f"cu_seq_lens_q packs sequences into one row: it needs batch 1 and a 1-D tensor, got batch "
                         f"{batch} and {got}")
    positions = torch.arange(seq_len, device=device)
    return torch.searchsorted(cu_seqlens[1:].to(device), positions, right=True).to(torch.int32)[None]


def _refuse_packing(mixer: nn.Module, kwargs: dict) -> None:
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError(f"seq_idx / cu_seq_lens_q: {type(mixer).__name__} is a Mamba-1 mixer, whose selective scan "
                         "cannot restart its state inside a row (mamba_ssm's cannot either); run packed sequences "
                         "as separate rows with an attention_mask")


def _selective_scan(mixer: nn.Module, cache, ssm_state: Tensor | None, x: Tensor, dt: Tensor, A: Tensor,
                    B: Tensor, C: Tensor, D: Tensor, gate: Tensor, dt_bias: Tensor | None,
                    state_shape: tuple[int, ...]) -> Tensor:
    """Mamba-1's scan over a prompt, or its decoding step for one token with a cached state, the
    final state stored in the cache as `state_shape`. x, dt (without its bias), gate: (batch, dim,
    seqlen); A: (dim, dstate); B, C: (batch, dstate, seqlen) or (batch, groups, dstate, seqlen);
    D, dt_bias: (dim,). Returns y (batch, dim, seqlen)."""
    batch, dim, seq_len = x.shape
    if ssm_state is not None and seq_len == 1:
        state = ssm_state.view(batch, dim, A.shape[-1])  # a view: the step updates the cache's tensor in place
        return selective_state_update(state, x[..., 0], dt[..., 0], A, B[..., 0], C[..., 0], D, gate[..., 0],
                                      dt_bias, dt_softplus=True).unsqueeze(-1)
    initial_state = ssm_state.float().reshape(batch, dim, -1) if ssm_state is not None else None
    y = selective_scan_fn(x, dt, A, B, C, D, gate, dt_bias, delta_softplus=True,
                          return_last_state=cache is not None, initial_state=initial_state)
    if cache is None:
        return y
    y, last_state = y
    cache.update_recurrent_state(last_state.view(state_shape), mixer.layer_idx)
    return y


def _plain_linear(layer: nn.Module) -> bool:
    """Whether calling `layer` is exactly F.linear with its weight and bias: an nn.Linear itself (or
    the `DecodingHead` below; not PEFT's LoRA wrapper or a quantized layer) without hooks (accelerate's
    offloading, ...), so that its weight may be read without calling it."""
    return type(layer) in (nn.Linear, DecodingHead) and not (layer._forward_hooks or layer._forward_pre_hooks)


def _weight_only_serves(layer: nn.Module, x: Tensor) -> bool:
    """Whether `layer(x)` runs as ssmops' `weight_only_linear`: a decoding token (up to
    FUSED_STEP_MAX_BATCH rows) on CPU in float32 without autograd through a plain linear layer. It
    streams the weight once: about twice aten's matrix-vector product at in_proj's shape on one core,
    1.7x at the output head's (50280 x 768) on two; a token's time is these reads."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # before the size test: no guard on it
        return False
    return (x.device.type == "cpu" and x.numel() <= FUSED_STEP_MAX_BATCH * x.shape[-1] and _plain_linear(layer)
            and x.dtype == layer.weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)))


def _linear(layer: nn.Module, x: Tensor) -> Tensor:
    """`layer(x)`, on `weight_only_linear` where `_weight_only_serves`."""
    if _weight_only_serves(layer, x):
        return weight_only_linear(x, layer.weight, None, layer.bias)
    return layer(x)


class DecodingHead(nn.Linear):
    """The output head (transformers' `lm_head`, an nn.Linear) of a model `to_ssmops` switched: the
    same layer, whose decoding token runs on `weight_only_linear` (the head's 154 MB of float32
    weights at the 130m models' vocabulary are a third of a token's reads)."""

    def forward(self, x: Tensor) -> Tensor:
        if _weight_only_serves(self, x):
            return weight_only_linear(x, self.weight, None, self.bias)
        return super().forward(x)


def _fused_step_args(mixer: nn.Module, hidden_states: Tensor, cache, conv_state: Tensor | None,
                     ssm_state: Tensor | None, attention_mask: Tensor | None) -> tuple | None:
    """The arguments after the token of the one `ssmops::mamba_step` call a decoding token of a plain
    Mamba-1 mixer runs as (what `ssmops.modules.Mamba.step` does), or None where that call does not
    serve. It serves eager on CPU, float32 activations, states and parameters, up to
    FUSED_STEP_MAX_BATCH rows, no autograd, no padding mask (transformers passes none to a decoding
    token), no norms on dt, B, C and no quantized or wrapped projection. A token is ~7 operator calls and
    matrix-vector products a layer otherwise, each a dispatch and a wake-up of the threads; as one call
    the projections stream their weights once (1.5x at mamba-130m's shape on 1 core). Submodules and
    parameters are read from the modules' own dicts: through nn.Module.__getattr__ these checks cost
    ~6 ms of a 43 ms token at mamba-130m."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # graphs get the operators it fuses
        return None
    if conv_state is None or ssm_state is None or hidden_states.shape[1] != 1 or attention_mask is not None:
        return None
    modules = mixer._modules
    if "b_layernorm" in modules or hasattr(mixer.config, "_is_quantized"):
        return None
    projections = [modules[name] for name in ("in_proj", "x_proj", "dt_proj", "out_proj")]
    if not all(_plain_linear(layer) for layer in projections):
        return None  # PEFT's LoRA, a quantized or hooked projection: called as modules
    if cache.is_recording_past(mixer.layer_idx):
        return None
    in_proj, x_proj, dt_proj, out_proj = ((p["weight"], None, p.get("bias")) for p in
                                          (layer._parameters for layer in projections))
    conv, own = modules["conv1d"]._parameters, mixer._parameters
    # (every parameter float32 here: transformers' projections have no weight formats)
    small = (conv["weight"], conv.get("bias"), own["A_log"], own["D"], *in_proj, *x_proj, *dt_proj, *out_proj)
    if not fused_step_serves(hidden_states, (conv_state, ssm_state), small, mixer.parameters()):
        return None
    return (conv_state, ssm_state, *step_arguments(in_proj, conv["weight"].squeeze(1), conv.get("bias"), x_proj,
                                                   dt_proj, own["A_log"], own["D"], out_proj))


def _mamba_forward(self, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """Mamba-1's mixer on ssmops, and Falcon-Mamba's and Jamba's (RMS norms on dt, B and C)."""
    cache = kwargs.pop("cache_params", cache)  # the keyword's name before transformers 5.40
    _refuse_packing(self, kwargs)
    dtype = hidden_states.dtype
    conv_state, ssm_state = _states(self, cache)
    fused = _fused_step_args(self, hidden_states, cache, conv_state, ssm_state, attention_mask)
    if fused is not None:
        return operator_for("mamba_step", hidden_states)(hidden_states[:, 0], *fused).unsqueeze(1)

    hidden_states = _apply_mask(hidden_states, attention_mask)
    x, gate = _linear(self.in_proj, hidden_states).transpose(1, 2).chunk(2, dim=1)  # (batch, d_inner, seqlen) each
    x = _apply_mask(_conv(self, x, cache, conv_state).transpose(1, 2), attention_mask)  # (batch, seqlen, d_inner)
    dt, B, C = torch.split(_linear(self.x_proj, x), [self.time_step_rank, self.ssm_state_size, self.ssm_state_size],
                           dim=-1)
    if hasattr(self, "b_layernorm"):  # Falcon-Mamba, Jamba
        dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
    if hasattr(self.config, "_is_quantized"):  # a quantized dt_proj is only callable as a module
        dt = (self.dt_proj(dt) - self.dt_proj.bias).transpose(1, 2)
    else:
        dt = self.dt_proj.weight @ dt.transpose(1, 2)  # (batch, d_inner, seqlen); the bias goes to the scan
    dt_bias = self.dt_proj.bias.float() if self.dt_proj.bias is not None else None
    A = decay_rates(self, self.A_log)
    y = _selective_scan(self, cache, ssm_state, x.transpose(1, 2), dt, A, B.transpose(1, 2), C.transpose(1, 2),
                        self.D.float(), gate, dt_bias, state_shape=(x.shape[0], *A.shape))
    return _linear(self.out_proj, y.transpose(1, 2).to(dtype))


def _zamba_forward(self, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """Zamba's mixer on ssmops: Mamba-1 split into heads, each with its own x_proj and dt_proj (one
    grouped scan: the heads are B/C's groups), in_proj's outputs interleaving x and the gate."""
    cache = kwargs.pop("cache_params", cache)
    _refuse_packing(self, kwargs)
    batch, seq_len, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim, rank, dstate = self.n_mamba_heads, self.mamba_head_dim, self.time_step_rank, self.ssm_state_size
    conv_state, ssm_state = _states(self, cache)

    hidden_states = _apply_mask(hidden_states, attention_mask)
    xz = _linear(self.in_proj, hidden_states).transpose(1, 2).reshape(batch, -1, 2, seq_len)  # 2c: x, 2c + 1: gate
    x, gate = xz[:, :, 0].contiguous(), xz[:, :, 1]  # (batch, d_inner, seqlen) each
    x = _apply_mask(_conv(self, x, cache, conv_state).transpose(1, 2), attention_mask).transpose(1, 2)
    x_heads = x.reshape(batch, heads, head_dim, seq_len)
    dt, B, C = torch.einsum("hpd,bhdl->bhpl", self.x_proj_weight, x_heads).split([rank, dstate, dstate], dim=2)
    dt = torch.einsum("hdr,bhrl->bhdl", self.dt_proj_weight, dt).reshape(batch, -1, seq_len)
    dt_bias = self.dt_proj_bias.float().reshape(-1) if self.dt_proj_bias is not None else None
    A = decay_rates(self, self.A_log)  # (heads, head_dim, dstate)
    y = _selective_scan(self, cache, ssm_state, x_heads.reshape(batch, -1, seq_len), dt, A.reshape(-1, dstate),
                        B, C, self.D.float().reshape(-1), gate, dt_bias, state_shape=(batch, *A.shape))
    return _linear(self.out_proj, y.transpose(1, 2).to(dtype))


def _mamba2_forward(self, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """Mamba-2's mixer on ssmops, and the same layer in Bamba, Zamba2, Granite 4.0 and NemotronH
    (a gated RMS norm per group of heads), and in Falcon-H1 (mup multipliers on in_proj's input and
    outputs; the gated norm optional, before or after the gate). Packed sequences (transformers'
    `seq_idx` or `cu_seq_lens_q` keywords) stay apart in the conv and the scan."""
    cache = kwargs.pop("cache_params", cache)
    batch, seq_len, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, headdim, groups, dstate = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    seq_idx = _packed_seq_idx(kwargs, batch, seq_len, hidden_states.device)
    conv_state, ssm_state = _states(self, cache)

    hidden_states = _apply_mask(hidden_states, attention_mask)
    if hasattr(self, "mup_vector"):  # Falcon-H1
        zxbcdt = _linear(self.in_proj, hidden_states * self.ssm_in_multiplier) * self.mup_vector
    else:
        zxbcdt = _linear(self.in_proj, hidden_states)
    gate, xBC, dt = zxbcdt.split([self.intermediate_size, self.conv_dim, heads], dim=-1)
    xBC = _conv(self, xBC.transpose(1, 2), cache, conv_state, seq_idx)
    xBC = _apply_mask(xBC.transpose(1, 2), attention_mask)
    x, B, C = xBC.split([self.intermediate_size, groups * dstate, groups * dstate], dim=-1)
    A = decay_rates(self, self.A_log)
    gated_norm = getattr(self, "mamba_rms_norm", True)  # Falcon-H1 may gate without a norm: in the scan
    z = None if gated_norm else gate

    if ssm_state is not None and seq_len == 1:
        y = selective_state_update(ssm_state, x.view(batch, heads, headdim), dt[:, 0], A,
                                   B.view(batch, groups, dstate), C.view(batch, groups, dstate), self.D,
                                   None if z is None else z.view(batch, heads, headdim), self.dt_bias, dt_softplus=True)
    else:
        y = mamba_chunk_scan_combined(
            x.view(batch, seq_len, heads, headdim), dt, A, B.view(batch, seq_len, groups, dstate),
            C.view(batch, seq_len, groups, dstate), self.chunk_size, D=self.D,
            z=None if z is None else z.view(batch, seq_len, heads, headdim), dt_bias=self.dt_bias,
            initial_states=ssm_state, seq_idx=seq_idx, dt_softplus=True,
            dt_limit=_dt_limit(self.time_step_limit), return_final_states=cache is not None)
        if cache is not None:
            y, final_state = y
            cache.update_recurrent_state(final_state, layer_idx=self.layer_idx)
    y = y.reshape(batch, seq_len, -1)
    if gated_norm:
        y = rmsnorm_fn(y, self.norm.weight, None, z=gate, eps=self.norm.variance_epsilon,
                       group_size=self.intermediate_size // groups,
                       norm_before_gate=getattr(self.norm, "norm_before_gate", False))
    return _linear(self.out_proj, y.to(dtype))


def _dt_limit(limit) -> tuple[float, float]:
    return (0.0, float("inf")) if limit is None else (float(limit[0]), float(limit[1]))


class _MixerFamily(NamedTuple):
    module: str  # transformers' modeling module
    mixer: str  # its SSM mixer class
    forward: object  # the ssmops forward
    hooked: tuple[str, ...]  # the forward's children whose accelerate hooks must fire first (weights read directly)
    # The class that builds the mixer through a table of its own (NemotronH's MIXER_TYPES, which the
    # patch registry's renaming never reaches): its ssmops subclass switches the mixer after __init__.
    builder: str | None = None


_MODEL_TYPES = {
    "mamba": _MixerFamily("transformers.models.mamba.modeling_mamba", "MambaMixer", _mamba_forward,
                          ("conv1d", "dt_proj")),
    "falcon_mamba": _MixerFamily("transformers.models.falcon_mamba.modeling_falcon_mamba", "FalconMambaMixer",
                            _mamba_forward, ("conv1d", "dt_proj")),
    "mamba2": _MixerFamily("transformers.models.mamba2.modeling_mamba2", "Mamba2Mixer", _mamba2_forward, ("conv1d",)),
    "bamba": _MixerFamily("transformers.models.bamba.modeling_bamba", "BambaMixer", _mamba2_forward, ("conv1d",)),
    "jamba": _MixerFamily("transformers.models.jamba.modeling_jamba", "JambaMambaMixer", _mamba_forward,
                     ("conv1d", "dt_proj")),
    "zamba": _MixerFamily("transformers.models.zamba.modeling_zamba", "ZambaMambaMixer", _zamba_forward, ("conv1d",)),
    "zamba2": _MixerFamily("transformers.models.zamba2.modeling_zamba2", "Zamba2MambaMixer", _mamba2_forward,
                      ("conv1d",)),
    "falcon_h1": _MixerFamily("transformers.models.falcon_h1.modeling_falcon_h1", "FalconH1Mixer", _mamba2_forward,
                         ("conv1d",)),
    "granitemoehybrid": _MixerFamily("transformers.models.granitemoehybrid.modeling_granitemoehybrid",
                                "GraniteMoeHybridMambaLayer", _mamba2_forward, ("conv1d",)),
    "nemotron_h": _MixerFamily("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer",
                          _mamba2_forward, ("conv1d",), builder="NemotronHBlock"),
}
MODEL_TYPES = tuple(_MODEL_TYPES)

_mixer_classes: dict[str, type] = {}  # model_type -> the ssmops subclass, built once per process
_builder_classes: dict[str, type] = {}  # model_type -> the ssmops subclass of its builder, where it has one
_registered: list[str] = []  # the patch-mapping keys this module registered


def _transformers():
    """transformers, checked to be a release this integration supports."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError("ssmops.enable_transformers needs transformers (pip install 'transformers"
                          f"{','.join(SUPPORTED_TRANSFORMERS)}')") from error
    version = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if not (_MIN_VERSION <= version < _MAX_VERSION):
        raise UnsupportedTransformersError(
            f"transformers {transformers.__version__} is not supported by ssmops' transformers integration "
            f"(supported: transformers{','.join(SUPPORTED_TRANSFORMERS)}); use ssmops.models.MambaLMHeadModel.from_hf "
            "to convert the model instead")
    return transformers


def _check_families(families) -> list[str]:
    families = list(MODEL_TYPES if families is None else ([families] if isinstance(families, str) else families))
    unknown = [f for f in families if f not in _MODEL_TYPES]
    if unknown:
        raise UnsupportedTransformersError(
            f"model_type {', '.join(map(repr, unknown))} is not supported by ssmops' transformers integration; "
            f"supported: {', '.join(MODEL_TYPES)}")
    return families


def mixer_class(model_type: str) -> type:
    """The ssmops mixer class for `model_type`: a subclass of transformers' mixer of that family
    (same name, parameters and __init__) whose forward runs on ssmops."""
    _transformers()
    (model_type,) = _check_families(model_type)
    if model_type not in _mixer_classes:
        family = _MODEL_TYPES[model_type]
        module = importlib.import_module(family.module)
        base, forward = getattr(module, family.mixer), family.forward
        try:  # fire accelerate's hooks (offloading) of the children whose weights the forward reads directly
            from transformers.integrations.accelerate import force_accelerate_hooks
            forward = force_accelerate_hooks(list(family.hooked))(forward)
        except ImportError:
            pass

        def __init__(self, config, *args, **kwargs):
            base.__init__(self, config, *args, **kwargs)
            _check_config(self)

        namespace = {"__init__": __init__, "forward": forward, "__module__": __name__,
                     "__doc__": f"transformers' {family.mixer} whose forward runs on ssmops' operators."}
        # the same __name__ as transformers' class: accelerate's `_no_split_modules` and similar lists go by name
        _mixer_classes[model_type] = type(family.mixer, (base,), namespace)
        if family.builder is not None:
            _builder_classes[model_type] = _builder_class(getattr(module, family.builder), _mixer_classes[model_type])
    return _mixer_classes[model_type]


def _builder_class(base: type, mixer: type) -> type:
    """A subclass of `base` (same name) whose __init__ makes each of its mixers of transformers' class
    the ssmops subclass `mixer`: for the classes that look their mixer up in a table of their own."""
    original = mixer.__mro__[1]

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        for module in self.modules():
            if type(module) is original:
                _check_config(module)
                module.__class__ = mixer

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__,
                                         "__doc__": f"transformers' {base.__name__} with its mixers on ssmops."})


def __getattr__(name: str) -> type:
    """The mixer classes by name (`ssmops.integrations.transformers.MambaMixer`, ...), built on first
    use: where pickle (`torch.save(model)`) looks for them, in this process or a fresh one."""
    for model_type, family in _MODEL_TYPES.items():
        if name == family.mixer:
            return mixer_class(model_type)
        if name == family.builder:
            mixer_class(model_type)
            return _builder_classes[model_type]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_config(mixer: nn.Module) -> None:
    if mixer.activation not in ("silu", "swish"):
        raise UnsupportedTransformersError(
            f"{type(mixer).__name__} has hidden_act={mixer.activation!r}; ssmops' causal conv applies silu only")


def enable_transformers(families=None) -> "_Enabled":
    """From now on, every model transformers builds (`from_pretrained`, `from_config`,
    `AutoModel*`, or inside `transformers.monkey_patching.apply_patches()`) of these families runs
    its SSM mixers on ssmops. `families`: model_types among `MODEL_TYPES` (default: all).

    Returns a handle; `with ssmops.enable_transformers(): ...` disables on leaving the block.
    Raises ImportError without transformers, UnsupportedTransformersError for a transformers
    release or a family this integration does not support."""
    _transformers()
    from transformers.monkey_patching import register_patch_mapping

    mapping = {}
    for model_type in _check_families(families):
        mapping[f"^{_MODEL_TYPES[model_type].mixer}$"] = mixer_class(model_type)
        if model_type in _builder_classes:
            mapping[f"^{_MODEL_TYPES[model_type].builder}$"] = _builder_classes[model_type]
    register_patch_mapping(mapping, overwrite=True)
    _registered.extend(key for key in mapping if key not in _registered)
    return _Enabled()


def disable_transformers() -> None:
    """Undo `enable_transformers`: models built afterwards are transformers' as shipped. Models
    already built keep their mixers (`from_ssmops(model)` switches one back)."""
    if not _registered:
        return
    from transformers.monkey_patching import get_patch_mapping, unregister_patch_mapping

    present = get_patch_mapping()
    unregister_patch_mapping([key for key in _registered if key in present])
    _registered.clear()


class _Enabled:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        disable_transformers()


def to_ssmops(model: nn.Module, families=None) -> nn.Module:
    """Switch an already built transformers model in place: each mixer of a supported family
    becomes the ssmops subclass of its own class, and a plain nn.Linear output head (`lm_head`) a
    `DecodingHead` (parameters, tied weights, buffers and hooks untouched). Returns the model.
    Raises UnsupportedTransformersError if the model has no such mixer."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if families is None and model_type in _MODEL_TYPES:
        families = [model_type]  # import only the modeling module it needs
    families = _check_families(families)
    switched = 0
    for family in families:
        cls = mixer_class(family)
        base = cls.__mro__[1]
        for module in model.modules():
            if type(module) is base:
                _check_config(module)
                module.__class__ = cls
                switched += 1
            elif type(module) is cls:
                switched += 1
    if not switched:
        model_type = model_type or type(model).__name__
        raise UnsupportedTransformersError(
            f"{type(model).__name__} (model_type {model_type!r}) has no mixer that ssmops' transformers integration "
            f"supports; supported model types: {', '.join(MODEL_TYPES)}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is nn.Linear:
        head.__class__ = DecodingHead
    return model


def from_ssmops(model: nn.Module) -> nn.Module:
    """Undo `to_ssmops` (or `enable_transformers` at build time) on one model, in place: its mixers
    and its output head are transformers' classes again."""
    ssmops_classes = set(_mixer_classes.values()) | set(_builder_classes.values()) | {DecodingHead}
    for module in model.modules():
        if type(module) in ssmops_classes:
            module.__class__ = type(module).__mro__[1]
    return model


def uses_ssmops(model: nn.Module) -> bool:
    """Whether any mixer of `model` runs on ssmops."""
    ssmops_classes = set(_mixer_classes.values())
    return any(type(module) in ssmops_classes for module in model.modules())
