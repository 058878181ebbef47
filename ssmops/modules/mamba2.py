"""The Mamba-2 block (mamba_ssm's `Mamba2`) on the ssmops operators.

Same constructor arguments, parameter names, shapes and initialisation as
`mamba_ssm.modules.mamba2.Mamba2` (without tensor parallelism), so its state_dicts load
with `strict=True`. The sequence path runs the SSD scan operator (packed sequences through
`seq_idx` / `cu_seqlens`); decoding runs the multi-head `selective_state_update`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from .. import distributed
from ..causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from ..distributed._exchange import as_process_group
from ..distributed.tensor_parallel import local
from ..layernorm_gated import RMSNorm as RMSNormGated
from ..layernorm_gated import rmsnorm_fn
from ..ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
from ..state_update import selective_state_update
from .decay import decay_rates
from .linear import Linear
from .mamba import states_from_cache


class Mamba2(nn.Module):
    """Mamba-2 mixer: (batch, seqlen, d_model) -> (batch, seqlen, d_model).

    Parameters (mamba_ssm's names): `in_proj` (d_model -> [z0, x0, z, x, B, C, dt], of widths
    d_mlp, d_mlp, d_ssm, d_ssm, ngroups * d_state twice, nheads), `conv1d` (depthwise over
    x, B, C), `dt_bias`, `A_log` (nheads,), `D` (nheads, or d_ssm with `D_has_hdim`), `norm`
    (gated RMSNorm over groups of d_ssm / ngroups, when `rmsnorm`), `out_proj`; d_inner =
    expand * d_model, nheads = d_ssm / headdim, d_ssm = d_inner unless given; the other
    d_mlp = (d_inner - d_ssm) / 2 channels are a gated MLP beside the SSM (silu(z0) * x0).

    `use_mem_eff_path` selects `mamba_split_conv1d_scan_combined` (one function from
    in_proj's output to out_proj) over the unrolled path; both run the same operators here.
    `process_group` / `sequence_parallel` are refused: tensor parallelism is
    `ssmops.distributed.parallelize_mamba2(block, mesh)` (DTensor). `rmsnorm_eps`
    (not in mamba_ssm, which fixes 1e-5) is the gated norm's epsilon, for transformers' layouts.

    `context_parallel_group` (a torch.distributed process group or 1-D DeviceMesh) makes the forward take this
    rank's shard of the sequence (see ssmops.distributed): the conv gets its halo from the
    previous rank and the scan its initial state; decoding and cu_seqlens are single-process.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 128,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        headdim: int = 64,
        d_ssm: int | None = None,
        ngroups: int = 1,
        A_init_range: tuple[float, float] = (1, 16),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        rmsnorm_eps: float = 1e-5,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 256,
        use_mem_eff_path: bool = True,
        layer_idx: int | None = None,
        process_group=None,
        sequence_parallel: bool = True,
        device=None,
        dtype=None,
        *,
        context_parallel_group: ProcessGroup | DeviceMesh | None = None,
    ):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if process_group is not None:
            raise ValueError("process_group is not taken by ssmops' Mamba2: for tensor parallelism build the block, "
                             "load its weights, then ssmops.distributed.parallelize_mamba2(block, mesh)")
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.conv_init = conv_init
        self.expand = expand
        self.d_inner = int(expand * d_model)
        self.headdim = headdim
        self.d_ssm = self.d_inner if d_ssm is None else d_ssm
        self.ngroups = ngroups
        if self.d_ssm % headdim:
            raise ValueError(f"d_ssm ({self.d_ssm}) must be a multiple of headdim ({headdim})")
        self.nheads = self.d_ssm // headdim
        if self.nheads % ngroups:
            raise ValueError(f"ngroups ({ngroups}) must divide the number of heads ({self.nheads})")
        self.D_has_hdim = D_has_hdim
        self.rmsnorm = rmsnorm
        self.norm_before_gate = norm_before_gate
        self.dt_limit = tuple(dt_limit)
        self.activation = "silu"
        self.chunk_size = chunk_size
        self.use_mem_eff_path = use_mem_eff_path
        self.layer_idx = layer_idx
        self.context_parallel_group = as_process_group(context_parallel_group)
        self.tensor_parallel_mesh = None  # set by ssmops.distributed.parallelize_mamba2

        d_in_proj = 2 * self.d_inner + 2 * ngroups * d_state + self.nheads
        self.in_proj = Linear(d_model, d_in_proj, bias=bias, **factory)
        self.conv_dim = self.d_ssm + 2 * ngroups * d_state
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=d_conv, groups=self.conv_dim,
                                padding=d_conv - 1, bias=conv_bias, **factory)
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.act = nn.SiLU()

        # dt_bias = softplus^-1 of a dt sampled log-uniformly in [dt_min, dt_max], one per head
        dt = torch.exp(
            torch.rand(self.nheads, **factory) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        ).clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True

        # A = -uniform(A_init_range) per head, stored as its log
        if not (A_init_range[0] > 0 and A_init_range[1] >= A_init_range[0]):
            raise ValueError(f"A_init_range must be 0 < low <= high, got {tuple(A_init_range)}")
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype=dtype))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_ssm if D_has_hdim else self.nheads, device=device))
        self.D._no_weight_decay = True

        if rmsnorm:
            self.norm = RMSNormGated(self.d_ssm, eps=rmsnorm_eps, norm_before_gate=norm_before_gate,
                                     group_size=self.d_ssm // ngroups, **factory)
        self.out_proj = Linear(self.d_inner, d_model, bias=bias, **factory)

    # --- sequence path ----------------------------------------------------------------

    def forward(self, u: Tensor, seqlen: int | None = None, seq_idx: Tensor | None = None,
                cu_seqlens: Tensor | None = None, inference_params=None) -> Tensor:
        """u: (batch, seqlen, d_model), or (batch * seqlen, d_model) with `seqlen` given.
        `seq_idx` (batch, seqlen) int32 marks packed sequences (the conv and the scan do not
        cross them); `cu_seqlens` (nseq + 1,) with batch 1 fills one decoding state per
        sequence. With `inference_params` (see ssmops.models.generation), the conv and ssm
        states are filled at `seqlen_offset == 0` and advanced one token per call after."""
        group = self.context_parallel_group
        if group is not None and (inference_params is not None or cu_seqlens is not None):
            raise ValueError("a Mamba2 with a context_parallel_group runs whole shards: inference_params and "
                             "cu_seqlens need one process (got "
                             f"{'inference_params' if inference_params is not None else 'cu_seqlens'})")
        if self.tensor_parallel_mesh is not None and inference_params is not None:
            raise ValueError("a tensor-parallel Mamba2 (parallelize_mamba2) runs training and prefill forwards: "
                             "inference_params (decoding) needs one process")
        flat = seqlen is not None
        if flat:
            u = u.unflatten(0, (-1, seqlen))
        batch = u.shape[0]
        conv_state = ssm_state = None
        if inference_params is not None:
            cache_batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else batch
            conv_state, ssm_state = self._get_states_from_cache(inference_params, cache_batch)
            if inference_params.seqlen_offset > 0:
                out, _, _ = self.step(u, conv_state, ssm_state)
                return out.flatten(0, 1) if flat else out

        zxbcdt = self.in_proj(u)
        A = -torch.exp(local(self.A_log).float())
        D = local(self.D).unflatten(0, (self.nheads, self.headdim)) if self.D_has_hdim else local(self.D)
        if (self.use_mem_eff_path and inference_params is None and self.out_proj.converted_from is None
                and group is None and self.tensor_parallel_mesh is None):
            out = mamba_split_conv1d_scan_combined(
                zxbcdt, self.conv1d.weight, self.conv1d.bias, self.dt_bias, A, D, self.chunk_size,
                seq_idx=seq_idx, dt_limit=self.dt_limit, activation=self.activation,
                rmsnorm_weight=self.norm.weight if self.rmsnorm else None,
                rmsnorm_eps=self.norm.eps if self.rmsnorm else 1e-6, outproj_weight=self.out_proj.weight,
                outproj_bias=self.out_proj.bias, headdim=None if self.D_has_hdim else self.headdim,
                ngroups=self.ngroups, norm_before_gate=self.norm_before_gate,
            )
            return out.flatten(0, 1) if flat else out

        z0, x0, z, xBC, dt = torch.split(zxbcdt, self._in_proj_split(zxbcdt.shape[-1]), dim=-1)
        if conv_state is not None:
            conv_state.copy_(self._conv_states(xBC, cu_seqlens))
        conv, scan, sharding = causal_conv1d_fn, mamba_chunk_scan_combined, {}
        if group is not None:
            conv, scan, sharding = distributed.causal_conv1d, distributed.mamba_chunk_scan_combined, {"group": group}
        # channel-last: the conv reads xBC (batch, seqlen, conv_dim) in place and writes that layout
        xBC = conv(xBC.mT, local(self.conv1d.weight), local(self.conv1d.bias), activation=self.activation,
                   seq_idx=seq_idx, **sharding).mT
        x, B, C = torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        want_varlen = cu_seqlens is not None and inference_params is not None
        # (the group where sharded; the varlen states where not: context parallelism refuses cu_seqlens)
        scan_options = sharding if group is not None else dict(cu_seqlens=cu_seqlens, return_varlen_states=want_varlen)
        scanned = scan(
            x.unflatten(-1, (self.nheads, self.headdim)), dt, A, B.unflatten(-1, (self.ngroups, self.d_state)),
            C.unflatten(-1, (self.ngroups, self.d_state)), self.chunk_size, D=D,
            z=None if self.rmsnorm else z.unflatten(-1, (self.nheads, self.headdim)), dt_bias=local(self.dt_bias),
            dt_softplus=True, seq_idx=seq_idx, dt_limit=self.dt_limit, return_final_states=ssm_state is not None,
            **scan_options,
        )
        if ssm_state is not None:
            y, last_state, *varlen = scanned
            ssm_state.copy_(varlen[0] if want_varlen else last_state)
        else:
            y = scanned
        out = self._finish(y.flatten(-2), z, z0, x0)
        return out.flatten(0, 1) if flat else out

    def _in_proj_split(self, width: int) -> list[int]:
        """Widths of [z0, x0, z, xBC, dt] in in_proj's output."""
        d_mlp = (width - 2 * self.d_ssm - 2 * self.ngroups * self.d_state - self.nheads) // 2
        return [d_mlp, d_mlp, self.d_ssm, self.conv_dim, self.nheads]

    def _finish(self, y: Tensor, z: Tensor, z0: Tensor, x0: Tensor) -> Tensor:
        """Gated norm, the MLP part beside the SSM, out_proj."""
        if self.rmsnorm:
            norm = self.norm
            y = rmsnorm_fn(y, local(norm.weight), local(norm.bias), z=z, eps=norm.eps, group_size=norm.group_size,
                           norm_before_gate=norm.norm_before_gate)
        if z0.shape[-1]:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y)

    def _conv_states(self, xBC: Tensor, cu_seqlens: Tensor | None) -> Tensor:
        """The last d_conv conv inputs of each sequence, zero where before its start:
        (batch, conv_dim, d_conv), or (nseq, conv_dim, d_conv) for packed `cu_seqlens`."""
        if cu_seqlens is None:
            return F.pad(xBC.transpose(1, 2), (self.d_conv - xBC.shape[1], 0))
        if xBC.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch 1 (packed sequences), got batch {xBC.shape[0]}")
        ends = cu_seqlens[1:].long().unsqueeze(1)
        positions = ends - self.d_conv + torch.arange(self.d_conv, device=xBC.device)  # (nseq, d_conv)
        inside = positions >= cu_seqlens[:-1].long().unsqueeze(1)
        window = xBC[0][positions.clamp(min=0)] * inside.unsqueeze(-1)  # (nseq, d_conv, conv_dim)
        return window.transpose(1, 2)

    # --- decoding -----------------------------------------------------------------------

    def step(self, hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor):
        """One token: hidden_states (batch, 1, d_model); conv_state (batch, conv_dim, d_conv)
        and ssm_state (batch, nheads, headdim, d_state), in any float dtype, are updated in
        place. Returns (out (batch, 1, d_model), conv_state, ssm_state)."""
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError(f"step takes one token, (batch, 1, d_model); got {tuple(hidden_states.shape)}")
        zxbcdt = self.in_proj(hidden_states.squeeze(1))
        z0, x0, z, xBC, dt = torch.split(zxbcdt, self._in_proj_split(zxbcdt.shape[-1]), dim=-1)
        xBC = causal_conv1d_update(xBC, conv_state, self.conv1d.weight, self.conv1d.bias, activation=self.activation)
        x, B, C = torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        heads = (self.nheads, self.headdim)
        # dt (batch, nheads), A, dt_bias and D per head as they are (the step's per-head forms: one decay per
        # head), not expanded over headdim as mamba_ssm's kernel needs them: no views to build per token
        A = decay_rates(self, self.A_log)
        D = self.D.unflatten(0, heads) if self.D_has_hdim else self.D
        dt_bias, softplus = self.dt_bias, True
        if self.dt_limit != (0.0, float("inf")):  # the scan clamps dt, so the step does too
            dt, dt_bias, softplus = F.softplus(dt.float() + dt_bias.float()).clamp(*self.dt_limit), None, False
        y = selective_state_update(
            ssm_state, x.unflatten(-1, heads), dt, A, B.unflatten(-1, (self.ngroups, self.d_state)),
            C.unflatten(-1, (self.ngroups, self.d_state)), D, z=None if self.rmsnorm else z.unflatten(-1, heads),
            dt_bias=dt_bias, dt_softplus=softplus,
        )
        return self._finish(y.flatten(-2), z, z0, x0).unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, ssm_state_dtype=None,
                                 **kwargs):
        """Zeroed (conv_state (batch, conv_dim, d_conv), ssm_state (batch, nheads, headdim,
        d_state)) in the weights' dtype or `dtype`, as mamba_ssm allocates them;
        `ssm_state_dtype` overrides the ssm state's."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.conv_dim, self.d_conv, device=device, dtype=conv_dtype)
        ssm_dtype = ssm_state_dtype or (self.in_proj.compute_dtype if dtype is None else dtype)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size: int, initialize_states: bool = False):
        return states_from_cache(self, inference_params, batch_size, initialize_states)
