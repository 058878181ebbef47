"""mamba_ssm's attention layer (`MHA`) for hybrid models, on `scaled_dot_product_attention`.

Same constructor arguments and parameter names as `mamba_ssm.modules.mha.MHA` (grouped KV
heads, rotary embedding, optional in-block conv, optional gated MLP beside attention), with
no flash-attn: training and prefill run SDPA, decoding reads a KV cache of mamba_ssm's
layout (batch, max_seqlen, 2, num_heads_kv, head_dim).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from .linear import Linear


class RotaryEmbedding(nn.Module):
    """Rotary position embedding on the first `dim` features of each head: pairs (i, i + dim/2)
    (GPT-NeoX order), or (2i, 2i + 1) when `interleaved`, rotated by position * base^(-2i/dim).
    No parameters, no state_dict entries."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, device=None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary_emb_dim must be even, got {dim}")
        self.dim = dim
        self.interleaved = interleaved
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (batch, seqlen, heads, head_dim); positions: (batch, seqlen) or (seqlen,)."""
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # (..., seqlen, dim / 2)
        cos, sin = angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)  # broadcast over heads
        rotated, rest = x[..., : self.dim].float(), x[..., self.dim:]
        if self.interleaved:
            x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        else:
            x1, x2 = rotated.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([out.to(x.dtype), rest], dim=-1)


class MHA(nn.Module):
    """Self-attention: (batch, seqlen, embed_dim) -> (batch, seqlen, embed_dim).

    `in_proj` gives [q, k, v] (num_heads, num_heads_kv, num_heads_kv heads of head_dim), then
    `mlp_dim` channels of a gated MLP beside attention; `conv1d` (when d_conv > 0) is a causal
    depthwise conv over q, k, v; `out_proj` maps [attention, MLP] back. `causal` is False by
    default, as in mamba_ssm: language models pass causal=True in attn_cfg.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_heads_kv: int | None = None,
        head_dim: int | None = None,
        mlp_dim: int = 0,
        qkv_proj_bias: bool = True,
        out_proj_bias: bool = True,
        softmax_scale: float | None = None,
        causal: bool = False,
        layer_idx: int | None = None,
        d_conv: int = 0,
        rotary_emb_dim: int = 0,
        rotary_emb_base: float = 10000.0,
        rotary_emb_interleaved: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.layer_idx = layer_idx
        self.d_conv = d_conv
        self.rotary_emb_dim = rotary_emb_dim
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if num_heads % self.num_heads_kv:
            raise ValueError(f"num_heads_kv ({self.num_heads_kv}) must divide num_heads ({num_heads})")
        if head_dim is None and embed_dim % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide embed_dim ({embed_dim}) when head_dim is None")
        self.head_dim = head_dim if head_dim is not None else embed_dim // num_heads
        self.mlp_dim = math.ceil(mlp_dim / 256) * 256
        qkv_dim = self.head_dim * (num_heads + 2 * self.num_heads_kv)
        if rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base,
                                              interleaved=rotary_emb_interleaved, device=device)
        self.in_proj = Linear(embed_dim, qkv_dim + self.mlp_dim, bias=qkv_proj_bias, **factory)
        if d_conv > 0:
            self.conv1d = nn.Conv1d(qkv_dim, qkv_dim, kernel_size=d_conv, padding=d_conv - 1, groups=qkv_dim,
                                    **factory)
        self.out_proj = Linear(self.head_dim * num_heads + self.mlp_dim // 2, embed_dim, bias=out_proj_bias,
                                  **factory)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        """(kv_cache (batch, max_seqlen, 2, num_heads_kv, head_dim), conv_state (batch, qkv_dim,
        d_conv) or None), in the weights' dtype or `dtype`."""
        dtype = self.out_proj.compute_dtype if dtype is None else dtype
        device = self.out_proj.weight.device
        conv_state = None
        if self.d_conv > 0:
            conv_state = torch.zeros(batch_size, self.conv1d.weight.shape[0], self.d_conv, device=device, dtype=dtype)
        kv_cache = torch.zeros(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim, device=device, dtype=dtype)
        return kv_cache, conv_state

    def forward(self, x: Tensor, inference_params=None, seq_idx: Tensor | None = None) -> Tensor:
        """x: (batch, seqlen, embed_dim). `seq_idx` (batch, seqlen) keeps packed sequences from
        attending to each other. With `inference_params`, the prompt (seqlen_offset 0) fills
        this layer's KV cache and conv state; after it, each call decodes one token at
        position `lengths_per_sample` (per sample) or `seqlen_offset`."""
        cache = None
        if inference_params is not None:
            cache = inference_params.key_value_memory_dict.get(self.layer_idx)
            if cache is None:
                if self.layer_idx is None:
                    raise ValueError("an MHA layer needs a layer_idx to use inference_params")
                cache = self.allocate_inference_cache(x.shape[0], inference_params.max_seqlen, dtype=x.dtype)
                inference_params.key_value_memory_dict[self.layer_idx] = cache
            if inference_params.seqlen_offset > 0:
                positions = inference_params.lengths_per_sample
                if positions is None:
                    positions = torch.full((x.shape[0],), inference_params.seqlen_offset, device=x.device)
                return self.step(x, *cache, positions=positions)
        batch, seqlen, _ = x.shape
        qkv, x_mlp = self._project(x)
        if self.d_conv > 0:
            if cache is not None:
                cache[1].copy_(F.pad(qkv.transpose(1, 2), (self.d_conv - seqlen, 0)))
            qkv = causal_conv1d_fn(qkv.mT, self.conv1d.weight, self.conv1d.bias, seq_idx=seq_idx).mT
        q, k, v = self._heads(qkv, torch.arange(seqlen, device=x.device))
        if cache is not None:
            cache[0][:, :seqlen] = torch.stack([k, v], dim=2).to(cache[0].dtype)
        mask = None
        if seq_idx is not None:  # same sequence, and not ahead when causal
            mask = (seq_idx[:, :, None] == seq_idx[:, None, :]).unsqueeze(1)
            if self.causal:
                mask = mask & torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
        context = self._attend(q, k, v, mask, is_causal=self.causal and mask is None)
        return self._output(context, x_mlp)

    def step(self, x: Tensor, kv_cache: Tensor, conv_state: Tensor | None, positions: Tensor) -> Tensor:
        """One token per sample: x (batch, 1, embed_dim) at `positions` (batch,) int; writes its key
        and value there in kv_cache (and advances conv_state), both IN PLACE, and attends to
        the cache's positions 0..position. Returns (batch, 1, embed_dim)."""
        if x.dim() != 3 or x.shape[1] != 1:
            raise ValueError(f"step takes one token, (batch, 1, embed_dim); got {tuple(x.shape)}")
        qkv, x_mlp = self._project(x)
        if self.d_conv > 0:
            qkv = causal_conv1d_update(qkv.squeeze(1), conv_state, self.conv1d.weight, self.conv1d.bias).unsqueeze(1)
        positions = positions.to(device=x.device, dtype=torch.long)
        q, k, v = self._heads(qkv, positions[:, None])
        rows = torch.arange(x.shape[0], device=x.device)
        kv_cache[rows, positions] = torch.stack([k, v], dim=2)[:, 0].to(kv_cache.dtype)
        keys, values = kv_cache.unbind(dim=2)
        visible = torch.arange(kv_cache.shape[1], device=x.device) <= positions[:, None]  # (batch, max_seqlen)
        context = self._attend(q, keys.to(q.dtype), values.to(q.dtype), visible[:, None, None, :], is_causal=False)
        return self._output(context, x_mlp)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        qkv = self.in_proj(x)
        if self.mlp_dim == 0:
            return qkv, None
        qkv, x_mlp = qkv.split([qkv.shape[-1] - self.mlp_dim, self.mlp_dim], dim=-1)
        up, gate = x_mlp.chunk(2, dim=-1)
        return qkv, up * F.silu(gate)

    def _heads(self, qkv: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (batch, seqlen, num_heads, head_dim), k and v (..., num_heads_kv, head_dim), rotated."""
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_heads_kv * self.head_dim,
                             self.num_heads_kv * self.head_dim], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        if self.rotary_emb_dim > 0:
            q, k = self.rotary_emb(q, positions), self.rotary_emb(k, positions)
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        repeat = self.num_heads // self.num_heads_kv
        k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
        context = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale)
        return context.transpose(1, 2).flatten(-2)

    def _output(self, context: Tensor, x_mlp: Tensor | None) -> Tensor:
        if x_mlp is not None:
            context = torch.cat([context, x_mlp], dim=-1)
        return self.out_proj(context)
