"""The SSD chunked scan's operators (Mamba-2): schemas, fake kernels and autograd.

Conventions that the schemas cannot express:
* `dt_limit` is `[]` for no clamp (mamba_ssm's default `(0.0, inf)`), else `[low, high]`
  with finite values: the front end writes an infinite bound as float32's largest value,
  which clamps nothing a float32 dt can hold, so no infinity travels through export;
* `chunk_states` is float32 `(batch, nchunks * nheads, headdim, dstate)` with
  `nchunks = ceil(seqlen / chunk_size)`: entry `[b, c * nheads + h]` is the state just before
  chunk c starts (the initial state, or zeros, for chunk 0), flattened over (chunk, head) so
  that no dimension is 1 for some seqlen and not others (export would then specialise it).
  The backward recomputes each chunk from it;
* an absent optional output (`varlen_states` without cu_seqlens, `dD` without D, ...) is an
  empty tensor (numel 0);
* `dout` of the backward is the gradient of `out` (gated by silu(z) when z is given);
* `keep_ungated` (the front end sets it where z is given and a backward may follow, not while exporting) asks
  the forward for `ungated`, the output before the silu(z) gate (x's shape and dtype), else empty; given to
  the backward, its dz and the gradient through the gate are read from it, where the Triton kernels would
  otherwise recompute the output (the C++ and PyTorch kernels recompute their chunks anyway, and ignore it).
  mamba_ssm keeps it too (`out_x`): one activation of x's size more per layer in training, none in inference.
"""

from __future__ import annotations

import torch

from .checks import check_ssd_grad_inputs, check_ssd_inputs, keeps_ungated, num_chunks

_INPUTS = (
    "Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, "
    "Tensor? initial_states, Tensor? seq_idx, Tensor? cu_seqlens, int chunk_size, bool dt_softplus, "
    "float[] dt_limit"
)
FWD_SCHEMA = (
    f"ssd_scan_fwd({_INPUTS}, bool keep_ungated=False) -> "
    "(Tensor out, Tensor final_states, Tensor chunk_states, Tensor varlen_states, Tensor ungated)"
)
BWD_SCHEMA = (
    f"ssd_scan_bwd({_INPUTS}, Tensor dout, Tensor chunk_states, Tensor? dfinal_states, "
    "Tensor? dvarlen_states, Tensor? ungated=None) -> (Tensor dx, Tensor ddt, Tensor dA, Tensor dB, Tensor dC, "
    "Tensor dD, Tensor dz, Tensor ddt_bias, Tensor dinitial_states)"
)


def _empty(like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)


def fwd_fake(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus,
             dt_limit, keep_ungated=False):
    batch, seqlen, nheads, headdim, _, dstate, nseq = check_ssd_inputs(
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_limit)
    f32 = dict(dtype=torch.float32)
    final_states = x.new_empty(batch, nheads, headdim, dstate, **f32)
    chunk_states = x.new_empty(batch, num_chunks(seqlen, chunk_size) * nheads, headdim, dstate, **f32)
    varlen_states = x.new_empty(nseq, nheads, headdim, dstate, **f32) if cu_seqlens is not None else _empty(x)
    ungated = x.new_empty(x.shape) if keeps_ungated(z, keep_ungated) else x.new_empty(0)
    return x.new_empty(x.shape), final_states, chunk_states, varlen_states, ungated


def bwd_fake(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus,
             dt_limit, dout, chunk_states, dfinal_states, dvarlen_states, ungated=None):
    dims = check_ssd_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size,
                            dt_limit)
    check_ssd_grad_inputs(dims, x, chunk_size, dout, chunk_states, dfinal_states, dvarlen_states, z, ungated)

    def like(t):
        return t.new_empty(t.shape) if t is not None else _empty(x)

    return like(x), like(dt), like(A), like(B), like(C), like(D), like(z), like(dt_bias), like(initial_states)


def autograd_for(bwd_op):
    """(backward, setup_context) for `ssd_scan_fwd` (or its Triton twin) whose backward is `bwd_op`.
    It saves the inputs, the chunk states and the output before the gate where the forward kept it;
    the gradient flows through out, final_states and varlen_states."""

    def setup_context(ctx, inputs, output):
        *tensors, chunk_size, dt_softplus, dt_limit, keep_ungated = inputs
        _, _, chunk_states, _, ungated = output
        ctx.save_for_backward(*tensors, chunk_states, ungated if keeps_ungated(tensors[6], keep_ungated) else None)
        ctx.options = (chunk_size, dt_softplus, dt_limit)
        ctx.mark_non_differentiable(chunk_states, ungated)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for unused outputs (chunk states)

    def backward(ctx, dout, dfinal_states, _dchunk_states, dvarlen_states, _dungated):
        *tensors, chunk_states, ungated = ctx.saved_tensors
        x = tensors[0]
        if dout is None:
            dout = torch.zeros_like(x)
        cu_seqlens = tensors[10]
        grads = bwd_op(*tensors, *ctx.options, dout, chunk_states, dfinal_states,
                       dvarlen_states if cu_seqlens is not None else None, ungated)
        # no gradient for an absent input, nor for seq_idx / cu_seqlens / the options
        grads = [g if t is not None else None for g, t in zip(grads, tensors[:9])]
        return (*grads, None, None, None, None, None, None)

    return backward, setup_context
