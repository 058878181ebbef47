"""The Mamba block (mamba_ssm's `Mamba`, "Mamba-1") on the ssmops operators.

Same constructor arguments, parameter names, shapes and initialisation as
`mamba_ssm.modules.mamba_simple.Mamba`, so its state_dicts load as they are. The
sequence path runs the scan operator (it compiles with `fullgraph=True` and exports);
decoding runs `selective_state_update`, one token at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from .. import distributed
from .._registry import operator_for
from ..causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from ..distributed._exchange import as_process_group
from ..mamba_inner import mamba_inner_fn
from ..ops.mamba_step.packing import fused_step_serves, step_arguments
from ..selective_scan import selective_scan_fn
from ..state_update import selective_state_update
from .decay import decay_rates
from .linear import Linear, linear


class Mamba(nn.Module):
    """Mamba mixer: (batch, seqlen, d_model) -> (batch, seqlen, d_model).

    Parameters (mamba_ssm's names): `in_proj` (d_model -> 2 * d_inner), `conv1d`
    (depthwise, width d_conv), `x_proj` (d_inner -> dt_rank + 2 * d_state), `dt_proj`
    (dt_rank -> d_inner), `A_log` (d_inner, d_state) float32, `D` (d_inner,) float32,
    `out_proj` (d_inner -> d_model), with d_inner = expand * d_model and
    dt_rank = ceil(d_model / 16) when "auto".

    `use_fast_path` selects `mamba_inner_fn` (one function from in_proj's output to
    out_proj) over the unrolled path; both run the same operators here.

    `context_parallel_group` (a torch.distributed process group or 1-D DeviceMesh) makes the forward take this
    rank's shard of the sequence (see ssmops.distributed): the conv gets its halo from the
    previous rank and the scan its initial state; decoding is single-process.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        conv_bias: bool = True,
        bias: bool = False,
        use_fast_path: bool = True,
        layer_idx: int | None = None,
        device=None,
        dtype=None,
        *,
        context_parallel_group: ProcessGroup | DeviceMesh | None = None,
    ):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx
        self.context_parallel_group = as_process_group(context_parallel_group)

        self.in_proj = Linear(d_model, self.d_inner * 2, bias=bias, **factory)
        self.conv1d = nn.Conv1d(
            self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner, padding=d_conv - 1,
            bias=conv_bias, **factory,
        )
        self.activation = "silu"
        self.act = nn.SiLU()
        self.x_proj = Linear(self.d_inner, self.dt_rank + d_state * 2, bias=False, **factory)
        self.dt_proj = Linear(self.dt_rank, self.d_inner, bias=True, **factory)

        # dt_proj: weights around dt_rank**-0.5 * dt_scale; the bias is softplus^-1 of a dt
        # sampled log-uniformly in [dt_min, dt_max], so softplus(bias) starts in that range.
        dt_init_std = self.dt_rank**-0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, dt_init_std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -dt_init_std, dt_init_std)
        else:
            raise ValueError(f"dt_init must be 'constant' or 'random', got {dt_init!r}")
        dt = torch.exp(
            torch.rand(self.d_inner, **factory) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        ).clamp(min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
        with torch.no_grad():
            self.dt_proj.bias.copy_(inv_dt)
        self.dt_proj.bias._no_reinit = True  # the LM's weight init leaves it alone

        # S4D-real initialisation: A = -(1, 2, ..., d_state) for every channel; float32 always.
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True

        self.out_proj = Linear(self.d_inner, d_model, bias=bias, **factory)

    def forward(self, hidden_states: Tensor, inference_params=None) -> Tensor:
        """hidden_states: (batch, seqlen, d_model). With `inference_params` (mamba_ssm's
        InferenceParams, see ssmops.models.generation) the conv and ssm states of this layer are
        filled from the whole sequence at `seqlen_offset == 0` (prefill, through the scan's
        last state) and advanced by one token per call after that."""
        batch, seqlen, _ = hidden_states.shape
        group = self.context_parallel_group
        if group is not None and inference_params is not None:
            raise ValueError("a Mamba with a context_parallel_group runs whole shards: inference_params "
                             "(decoding) needs one process")
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = self._get_states_from_cache(inference_params, batch)
            if inference_params.seqlen_offset > 0:
                if seqlen != 1:
                    raise ValueError(
                        f"after the prompt, Mamba decodes one token per call; got seqlen {seqlen} "
                        f"at seqlen_offset {inference_params.seqlen_offset}"
                    )
                out, _, _ = self.step(hidden_states, conv_state, ssm_state)
                return out

        xz = self.in_proj(hidden_states).transpose(1, 2)  # (batch, 2 * d_inner, seqlen)
        A = -torch.exp(self.A_log.float())
        if (self.use_fast_path and inference_params is None and self.out_proj.converted_from is None
                and group is None):
            return mamba_inner_fn(
                xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                self.out_proj.weight, self.out_proj.bias, A, None, None, self.D.float(),
                delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
            )
        x, z = xz.chunk(2, dim=1)
        if conv_state is not None:
            # the last d_conv inputs of the conv (zero-padded on the left when seqlen < d_conv)
            conv_state.copy_(F.pad(x, (self.d_conv - seqlen, 0)))
        conv, scan, sharding = causal_conv1d_fn, selective_scan_fn, {}
        if group is not None:
            conv, scan, sharding = distributed.causal_conv1d, distributed.selective_scan_fn, {"group": group}
        x = conv(x, self.conv1d.weight, self.conv1d.bias, activation="silu", **sharding)
        x_dbl = self.x_proj(x.transpose(1, 2))  # (batch, seqlen, dt_rank + 2 * d_state)
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = linear(dt, self.dt_proj, bias=False).transpose(1, 2)  # the bias goes in as delta_bias
        y = scan(
            x, dt, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float(), z=z,
            delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
            return_last_state=ssm_state is not None, **sharding,
        )
        if ssm_state is not None:
            y, last_state = y
            ssm_state.copy_(last_state)
        return self.out_proj(y.transpose(1, 2))

    def step(self, hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor):
        """One token: hidden_states (batch, 1, d_model); conv_state (batch, d_inner, d_conv) and
        ssm_state (batch, d_inner, d_state), in any float dtype, are updated in place. Returns
        (out (batch, 1, d_model), conv_state, ssm_state)."""
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError(f"step takes one token, (batch, 1, d_model); got {tuple(hidden_states.shape)}")
        if self.fused_step_serves(hidden_states, conv_state, ssm_state):
            step = operator_for("mamba_step", hidden_states)
            out = step(hidden_states.squeeze(1), conv_state, ssm_state, *self.step_parameters())
            return out.unsqueeze(1), conv_state, ssm_state
        xz = self.in_proj(hidden_states.squeeze(1))  # (batch, 2 * d_inner)
        x, z = xz.chunk(2, dim=-1)
        x = causal_conv1d_update(x, conv_state, self.conv1d.weight, self.conv1d.bias, activation="silu")
        dt, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = linear(dt, self.dt_proj, bias=False)
        A = decay_rates(self, self.A_log)
        y = selective_state_update(
            ssm_state, x, dt, A, B, C, self.D.float(), z=z, dt_bias=self.dt_proj.bias, dt_softplus=True
        )
        return self.out_proj(y).unsqueeze(1), conv_state, ssm_state

    def step_parameters(self) -> tuple:
        """The block's parameters as `torch.ops.ssmops.mamba_step` takes them after the states."""
        return step_arguments(_projection(self.in_proj), self.conv1d.weight.squeeze(1), self.conv1d.bias,
                              _projection(self.x_proj), _projection(self.dt_proj), self.A_log.float(), self.D.float(),
                              _projection(self.out_proj))

    def fused_step_serves(self, hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor) -> bool:
        """Whether `step` runs as one `mamba_step` call (ops/mamba_step/packing.fused_step_serves)."""
        small = (self.conv1d.weight, self.conv1d.bias, self.in_proj.bias, self.dt_proj.bias, self.out_proj.bias,
                 self.D)
        return fused_step_serves(hidden_states, (conv_state, ssm_state), small, self.parameters())

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, ssm_state_dtype=None,
                                 **kwargs):
        """Zeroed (conv_state (batch, d_inner, d_conv), ssm_state (batch, d_inner, d_state)), in the
        weights' dtype (before any weight format's conversion) or `dtype` as mamba_ssm allocates them;
        `ssm_state_dtype` overrides the ssm state's (float32 keeps a low-precision model's recurrence
        state in float32). The decoding step computes in float32 and writes the state back in its dtype."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device, dtype=conv_dtype)
        ssm_dtype = ssm_state_dtype or (self.dt_proj.compute_dtype if dtype is None else dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size: int, initialize_states: bool = False):
        return states_from_cache(self, inference_params, batch_size, initialize_states)


def _projection(layer: nn.Linear) -> tuple:
    """A projection as `mamba_step` takes it: (weight, int8 scale or None, bias or None)."""
    return layer.weight, getattr(layer, "weight_scale", None), layer.bias


def states_from_cache(mixer: nn.Module, inference_params, batch_size: int, initialize_states: bool = False):
    """The mixer's decoding states in `inference_params`, allocated (zeroed) on first use."""
    if mixer.layer_idx is None:
        raise ValueError(f"a {type(mixer).__name__} block needs a layer_idx to use inference_params")
    cache = inference_params.key_value_memory_dict
    if mixer.layer_idx not in cache:
        cache[mixer.layer_idx] = mixer.allocate_inference_cache(
            batch_size, inference_params.max_seqlen, ssm_state_dtype=inference_params.ssm_state_dtype)
    states = cache[mixer.layer_idx]
    if initialize_states:
        for state in states:
            state.zero_()
    return states
