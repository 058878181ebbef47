"""The operators' fake kernels against their real outputs' strides, for the input layouts the blocks and
front ends pass: views of one projection's output, transposes and stride-0 expansions. A compiled graph
asserts each custom operator's output strides against its fake's, and lays out what follows by them, so
a fake that described another layout than a backend writes would fail or miscompute there. Every backend
that takes CPU tensors: Triton's under the interpreter (tests/test_triton.py runs this file so).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ssmops
from conftest import backend_params

BACKENDS = backend_params(names=("cpu", "default", "triton"))


def significant_strides(t: torch.Tensor) -> tuple:
    """The strides that address memory: those of dimensions longer than 1 (the others are free)."""
    return tuple(s for n, s in zip(t.shape, t.stride()) if n > 1)


def assert_fake_strides_match(backend, op, args: tuple) -> None:
    with ssmops.use_backend(backend):
        real = op(*args)
    mode = FakeTensorMode()
    with mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real, fake = (r if isinstance(r, tuple) else (r,) for r in (real, fake))
    for i, (r, f) in enumerate(zip(real, fake, strict=True)):
        assert r.shape == f.shape, f"{op} output {i}: shape {tuple(r.shape)}, fake {tuple(f.shape)}"
        if r.numel():
            assert significant_strides(r) == significant_strides(f), \
                f"{op} output {i}: strides {r.stride()}, fake {f.stride()} (shape {tuple(r.shape)})"


def split_projection(batch: int, seqlen: int, widths: list[int], channel_first: bool = False) -> list:
    """Views of one (batch, seqlen, sum(widths)) projection's output, split along features; with
    `channel_first`, each transposed to (batch, width, seqlen) as Mamba-1's mixer reads them."""
    gen = torch.Generator().manual_seed(sum(widths) + seqlen)
    proj = torch.randn(batch, seqlen, sum(widths), generator=gen)
    parts = torch.split(proj, widths, dim=-1)
    return [p.transpose(1, 2) for p in parts] if channel_first else list(parts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_scan_fakes_match_views_of_a_projection(backend):
    """mamba_chunk_scan_combined as Mamba2's unrolled path calls it: x, z, B, C, dt views of in_proj's
    output (and the conv's, transposed back), D per head, forward and backward."""
    batch, seqlen, nheads, headdim, ngroups, dstate = 2, 21, 4, 4, 2, 3
    x, z, B, C, dt = split_projection(batch, seqlen, [nheads * headdim] * 2 + [ngroups * dstate] * 2 + [nheads])
    conv_out = torch.randn(batch, nheads * headdim, seqlen).transpose(1, 2)  # stride 1 along time
    A, D, dt_bias = -torch.rand(nheads), torch.rand(nheads), torch.rand(nheads)
    for x_view in (x, conv_out):
        args = (x_view.unflatten(-1, (nheads, headdim)), dt, A, B.unflatten(-1, (ngroups, dstate)),
                C.unflatten(-1, (ngroups, dstate)), D, z.unflatten(-1, (nheads, headdim)), dt_bias, None, None,
                None, 16, True, [])
        args = (*args, True)  # (the output before the gate kept, as autograd asks)
        assert_fake_strides_match(backend, torch.ops.ssmops.ssd_scan_fwd.default, args)
        out, _, chunk_states, _, ungated = torch.ops.ssmops.ssd_scan_fwd(*args)
        dout = torch.randn(batch, seqlen, nheads, 2 * headdim)[..., :headdim]  # a non-contiguous gradient
        assert_fake_strides_match(backend, torch.ops.ssmops.ssd_scan_bwd.default,
                                  (*args[:-1], dout, chunk_states, torch.randn(batch, nheads, headdim, dstate), None,
                                   ungated))


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_scan_fakes_match_transposed_views(backend):
    """selective_scan_fn as mamba_inner_fn calls it: delta, B, C and z transposed views of projections'
    outputs (stride 1 along features, not time), grouped B/C, forward and backward."""
    batch, seqlen, dim, dstate = 2, 19, 6, 4
    u, z = split_projection(batch, seqlen, [dim, dim], channel_first=True)
    delta, B, C = split_projection(batch, seqlen, [dim, dstate, dstate], channel_first=True)
    A, D, delta_bias = -torch.rand(dim, dstate), torch.rand(dim), torch.rand(dim)
    args = (u, delta, A, B.unsqueeze(1), C.unsqueeze(1), D, z, delta_bias, None, True)
    assert_fake_strides_match(backend, torch.ops.ssmops.selective_scan_fwd.default, args)
    _, scan_intermediates, _, _ = torch.ops.ssmops.selective_scan_fwd(*args)
    dout = torch.randn(batch, seqlen, dim).transpose(1, 2)
    assert_fake_strides_match(backend, torch.ops.ssmops.selective_scan_bwd.default,
                              (*args[:9], dout, scan_intermediates, torch.randn(batch, dim, dstate), True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_update_fakes_match_views_and_expansions(backend):
    """The decoding steps as Mamba.step and Mamba2.step call them: x, z, B, C, dt views of one token's
    projection; Mamba-2's dt, A and dt_bias per head as stride-0 expansions over headdim."""
    batch, dim, dstate = 3, 6, 4
    x, z, dt, B, C = (t[:, 0] for t in split_projection(batch, 1, [dim, dim, dim, dstate, dstate]))
    state = torch.randn(batch, dim, dstate)
    args = (state, x, dt, -torch.rand(dim, dstate), B, C, torch.rand(dim), z, torch.rand(dim), True)
    assert_fake_strides_match(backend, torch.ops.ssmops.selective_state_update.default, args)

    nheads, headdim, ngroups = 2, 3, 1
    x, z, B, C, dt = (t[:, 0] for t in split_projection(batch, 1, [dim, dim, dstate, dstate, nheads]))
    heads = (nheads, headdim)
    args = (torch.randn(batch, nheads, headdim, dstate), x.unflatten(-1, heads), dt[..., None].expand(-1, *heads),
            (-torch.rand(nheads))[:, None, None].expand(*heads, dstate), B.unflatten(-1, (ngroups, dstate)),
            C.unflatten(-1, (ngroups, dstate)), torch.rand(nheads)[:, None].expand(heads), z.unflatten(-1, heads),
            torch.rand(nheads)[:, None].expand(heads), None, True)
    assert_fake_strides_match(backend, torch.ops.ssmops.multihead_state_update.default, args)
