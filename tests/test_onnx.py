"""ONNX export (ssmops.onnx): onnxruntime runs the exported graphs, standard operators only, and
gives eager's results at sequence lengths other than the exported one.

Exports are slow (torch.export, then torch.onnx's own decomposition and translation): each test
exports one module that calls a whole grid of an operator family (one export, not one per case), and
the model-sized ones are marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ssmops
import ssmops.layernorm_gated
import ssmops.mamba_inner
import ssmops.export as sx

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
import ssmops.onnx as so  # noqa: E402  (after the skips: it needs torch.onnx's dependencies)

RTOL, ATOL = 1e-4, 1e-5


def _session(program, path):
    program.save(str(path))
    model = onnx.load(str(path))
    domains = {node.domain for node in model.graph.node} | {
        node.domain for graph in _subgraphs(model.graph) for node in graph.node}
    assert domains <= {"", "ai.onnx"}, f"non-standard operator domains {domains}"
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]), model


def _subgraphs(graph):
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield attr.g
                yield from _subgraphs(attr.g)


def _run(session, inputs):
    feed = {i.name: (t.numpy() if isinstance(t, torch.Tensor) else t) for i, t in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in session.run(None, feed)]


def _assert_matches(session, module, inputs):
    with torch.no_grad():
        expected = module(*inputs)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    got = _run(session, inputs)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"output {i}: {m}")


# --- Mamba-1: the selective scan (every B/C layout and option), mamba_inner_fn, conv, gated norm ---


class Mamba1Ops(nn.Module):
    """u (batch, dim, seqlen) -> the selective scan with every option (variable B/C, D, z, delta_bias,
    softplus, initial and last state), with a constant B against a grouped C, with constant B and C and
    no option, and with grouped B and C; mamba_inner_fn, the causal conv and the gated RMSNorm."""

    def __init__(self, dim=8, dstate=4, groups=2, d_conv=4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.dim, self.dstate, self.groups = dim, dstate, groups
        self.A = nn.Parameter(-torch.rand(dim, dstate, generator=g) - 0.1)
        self.B_const = nn.Parameter(torch.randn(dim, dstate, generator=g))
        self.C_const = nn.Parameter(torch.randn(dim, dstate, generator=g))
        self.D = nn.Parameter(torch.randn(dim, generator=g))
        self.bias = nn.Parameter(torch.randn(dim, generator=g) * 0.5)
        self.h0 = nn.Parameter(torch.randn(2, dim, dstate, generator=g) * 0.1)
        self.proj = nn.Linear(dim, dim + 2 * groups * dstate)
        # mamba_inner_fn's weights (d_model = dim, d_inner = dim, dt_rank = 2)
        self.conv_w = nn.Parameter(torch.randn(dim, 1, d_conv, generator=g) * 0.3)
        self.conv_b = nn.Parameter(torch.randn(dim, generator=g) * 0.1)
        self.x_proj = nn.Parameter(torch.randn(2 + 2 * dstate, dim, generator=g) * 0.3)
        self.dt_proj = nn.Parameter(torch.randn(dim, 2, generator=g) * 0.3)
        self.out_proj = nn.Parameter(torch.randn(dim, dim, generator=g) * 0.3)
        self.in_proj = nn.Linear(dim, 2 * dim)
        self.norm_w = nn.Parameter(torch.rand(dim, generator=g) + 0.5)

    def forward(self, u):
        batch, dim, seqlen = u.shape
        delta, BC = self.proj(u.transpose(1, 2)).transpose(1, 2).split([dim, 2 * self.groups * self.dstate], 1)
        B4, C4 = BC.reshape(batch, 2, self.groups, self.dstate, seqlen).unbind(1)
        B3, C3 = B4[:, 0], C4[:, 1]
        z = u.flip(-1)
        outs = [
            *ssmops.selective_scan_fn(u, delta, self.A, B3, C3, self.D, z, self.bias, True, return_last_state=True,
                                      initial_state=self.h0[:batch]),
            ssmops.selective_scan_fn(u, delta, self.A, self.B_const, C4, None, z, None, True),
            ssmops.selective_scan_fn(u, delta.sigmoid(), self.A, self.B_const, self.C_const),
            *ssmops.selective_scan_fn(u, delta, self.A, B4, C4, self.D, None, self.bias, True, return_last_state=True),
        ]
        xz = self.in_proj(u.transpose(1, 2)).transpose(1, 2)
        outs.append(ssmops.mamba_inner_fn(xz, self.conv_w, self.conv_b, self.x_proj, self.dt_proj, self.out_proj,
                                          None, self.A, D=self.D, delta_bias=self.bias))
        outs.append(ssmops.causal_conv1d_fn(u, self.conv_w, self.conv_b, activation="silu"))
        outs.append(ssmops.layernorm_gated.rmsnorm_fn(u.transpose(1, 2), self.norm_w, z=z.transpose(1, 2),
                                                      group_size=dim // 2))
        return tuple(outs)


def test_mamba1_ops_export_and_match_eager(tmp_path):
    module = Mamba1Ops().eval()
    seqlen = torch.export.Dim("seqlen", min=2, max=4096)
    program = so.export(module, (torch.randn(2, 8, 21),), dynamic_shapes=({2: seqlen},), optimize=False)
    session, model = _session(program, tmp_path / "mamba1.onnx")
    assert any(node.op_type == "Scan" for node in model.graph.node)  # the recurrence is a loop, not unrolled
    for length in (21, 3, 4, 5, 50):  # around the scan's 4-step blocks too
        _assert_matches(session, module, (torch.randn(2, 8, length, generator=torch.Generator().manual_seed(length)),))


# --- Mamba-2: the SSD scan -------------------------------------------------------------------------


class SsdOps(nn.Module):
    """(x, seq_idx) -> the SSD scan with every option (D per channel, z, dt_bias, softplus, dt_limit,
    initial and final states), with packed sequences (seq_idx, D per head) and with no option."""

    def __init__(self, nheads=4, headdim=4, ngroups=2, dstate=4, chunk_size=8):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.shape = (nheads, headdim, ngroups, dstate)
        self.chunk_size = chunk_size
        self.proj = nn.Linear(nheads * headdim, 2 * nheads * headdim + 2 * ngroups * dstate + nheads)
        self.A = nn.Parameter(-torch.rand(nheads, generator=g) - 0.2)
        self.D = nn.Parameter(torch.randn(nheads, headdim, generator=g))
        self.D_head = nn.Parameter(torch.randn(nheads, generator=g))
        self.dt_bias = nn.Parameter(torch.randn(nheads, generator=g) * 0.5)
        self.h0 = nn.Parameter(torch.randn(1, nheads, headdim, dstate, generator=g) * 0.1)

    def forward(self, x, seq_idx):
        nheads, headdim, ngroups, dstate = self.shape
        batch, seqlen, _ = x.shape
        d_inner, gn = nheads * headdim, ngroups * dstate
        xs, z, B, C, dt = self.proj(x).split([d_inner, d_inner, gn, gn, nheads], dim=-1)
        xs, z = xs.reshape(batch, seqlen, nheads, headdim), z.reshape(batch, seqlen, nheads, headdim)
        B, C = B.reshape(batch, seqlen, ngroups, dstate), C.reshape(batch, seqlen, ngroups, dstate)
        cs = self.chunk_size
        full, final = ssmops.mamba_chunk_scan_combined(
            xs, dt, self.A, B, C, cs, D=self.D, z=z, dt_bias=self.dt_bias,
            initial_states=self.h0.expand(batch, -1, -1, -1), dt_softplus=True, dt_limit=(0.0, 0.5),
            return_final_states=True)
        packed, packed_final = ssmops.mamba_chunk_scan_combined(
            xs, dt, self.A, B, C, cs, D=self.D_head, dt_bias=self.dt_bias, dt_softplus=True, seq_idx=seq_idx,
            initial_states=self.h0.expand(batch, -1, -1, -1), return_final_states=True)
        plain = ssmops.mamba_chunk_scan_combined(xs, dt.sigmoid(), self.A, B, C, cs, D=self.D_head)
        return full, final, packed, packed_final, plain


def _seq_idx(length: int) -> torch.Tensor:
    """Three packed sequences in one row (batch 1), boundaries inside and at the chunks' edges."""
    cuts = torch.tensor([length // 3, length // 3 + length // 4])
    return (torch.arange(length)[:, None] >= cuts).sum(1, dtype=torch.int32)[None]


def test_ssd_export_and_matches_eager(tmp_path):
    module = SsdOps().eval()
    seqlen = torch.export.Dim("seqlen", min=2, max=4096)
    program = so.export(module, (torch.randn(1, 19, 16), _seq_idx(19)), dynamic_shapes=({1: seqlen}, {1: seqlen}),
                        optimize=False)
    session, model = _session(program, tmp_path / "ssd.onnx")
    assert any(node.op_type == "Scan" for node in model.graph.node)
    for length in (19, 8, 16, 45):  # around the 8-token chunks too
        x = torch.randn(1, length, 16, generator=torch.Generator().manual_seed(length))
        _assert_matches(session, module, (x, _seq_idx(length)))


# --- the decoding steps (Mamba-1's and Mamba-2's layouts) -------------------------------------------


class Steps(nn.Module):
    """One token of each decoding step, the states returned (the steps update them in place)."""

    def forward(self, state1, x1, dt1, A1, B1, C1, D1, state2, x2, dt2, A2, B2, C2, D2, dt_bias2, z2):
        state1, state2 = state1.clone(), state2.clone()
        y1 = ssmops.selective_state_update(state1, x1, dt1, A1, B1, C1, D1, z=x1.flip(-1), dt_bias=D1,
                                           dt_softplus=True)
        y2 = ssmops.selective_state_update(state2, x2, dt2, A2, B2, C2, D2, z=z2, dt_bias=dt_bias2, dt_softplus=True)
        return y1, state1, y2, state2


def _step_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    batch, dim, dstate, nheads, headdim, ngroups = 2, 6, 4, 4, 3, 2

    def r(*shape):
        return torch.randn(*shape, generator=g)

    mamba1 = [r(batch, dim, dstate), r(batch, dim), r(batch, dim), -r(dim, dstate).abs(), r(batch, dstate),
              r(batch, dstate), r(dim)]
    A2 = -r(nheads).abs()
    mamba2 = [r(batch, nheads, headdim, dstate), r(batch, nheads, headdim),
              r(batch, nheads)[..., None].expand(batch, nheads, headdim),
              A2[:, None, None].expand(nheads, headdim, dstate), r(batch, ngroups, dstate), r(batch, ngroups, dstate),
              r(nheads)[:, None].expand(nheads, headdim), r(nheads)[:, None].expand(nheads, headdim),
              r(batch, nheads, headdim)]
    return [t.contiguous() for t in mamba1 + mamba2]


def test_decoding_steps_export_and_match_eager(tmp_path):
    module = Steps()
    program = so.export(module, tuple(_step_inputs(0)), optimize=False)
    session, _ = _session(program, tmp_path / "steps.onnx")
    for seed in (1, 2):
        _assert_matches(session, module, _step_inputs(seed))


class CacheStep(nn.Module):
    """Mamba-2's step on rows of a cache larger than the batch (state_batch_indices; -1: a padding row)."""

    def forward(self, cache, x, dt, A, B, C, indices):
        cache = cache.clone()
        y = ssmops.selective_state_update(cache, x, dt, A, B, C, dt_softplus=True, state_batch_indices=indices)
        return y, cache


def test_decoding_step_on_cache_rows_exports_and_matches_eager(tmp_path):
    g = torch.Generator().manual_seed(0)
    cache, x = torch.randn(5, 4, 3, 6, generator=g), torch.randn(2, 4, 3, generator=g)
    dt = torch.randn(2, 4, generator=g)[..., None].expand(2, 4, 3).contiguous()
    A = (-torch.rand(4, generator=g))[:, None, None].expand(4, 3, 6).contiguous()
    B, C = torch.randn(2, 2, 6, generator=g), torch.randn(2, 2, 6, generator=g)
    inputs = [cache, x, dt, A, B, C, torch.tensor([3, 1], dtype=torch.int32)]
    session, _ = _session(so.export(CacheStep(), tuple(inputs), optimize=False), tmp_path / "cache_step.onnx")
    for rows in ([0, 4], [2, -1]):
        inputs[-1] = torch.tensor(rows, dtype=torch.int32)
        _assert_matches(session, CacheStep(), inputs)


# --- models -----------------------------------------------------------------------------------------


class TinyVisionMamba(nn.Module):
    """A VMamba-style 2-D selective scan: a patch grid read in four directions (rows and columns,
    each forwards and backwards) by one scan with four times the channels, merged back per pixel."""

    def __init__(self, channels=4, dim=8, dstate=4, classes=5):
        super().__init__()
        self.dim, self.dstate = dim, dstate
        self.patch = nn.Conv2d(channels, dim, 2, stride=2)
        self.x_proj = nn.Linear(dim, 4 * (1 + 2 * dstate))
        self.dt_proj = nn.Parameter(torch.randn(4 * dim) * 0.1)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, dstate + 1).float()).repeat(4 * dim, 1))
        self.D = nn.Parameter(torch.ones(4 * dim))
        self.dt_bias = nn.Parameter(torch.full((4 * dim,), -1.0))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch(images)  # (batch, dim, H, W)
        batch, dim, H, W = x.shape
        rows, cols = x.flatten(2), x.transpose(2, 3).flatten(2)
        xs = torch.stack([rows, cols, rows.flip(-1), cols.flip(-1)], 1)  # (batch, 4, dim, L)
        L = H * W
        proj = self.x_proj(x.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(batch, 4, 1 + 2 * self.dstate, L)
        dts = proj[:, :, :1] * self.dt_proj.reshape(4, dim)[None, :, :, None]  # (batch, 4, dim, L)
        Bs, Cs = proj[:, :, 1:].split(self.dstate, 2)
        y = ssmops.selective_scan_fn(xs.reshape(batch, 4 * dim, L), dts.reshape(batch, 4 * dim, L),
                                     -torch.exp(self.A_log), Bs, Cs, self.D, delta_bias=self.dt_bias,
                                     delta_softplus=True).reshape(batch, 4, dim, L)
        # each direction back to row-major order
        to_rows = lambda t: t.reshape(batch, dim, W, H).transpose(2, 3).reshape(batch, dim, L)  # noqa: E731
        merged = y[:, 0] + to_rows(y[:, 1]) + y[:, 2].flip(-1) + to_rows(y[:, 3].flip(-1))
        return self.head(self.norm(merged.transpose(1, 2)).mean(1))


@pytest.mark.slow
def test_vision_model_scanning_four_ways_exports_and_matches_eager(tmp_path):
    torch.manual_seed(0)
    module = TinyVisionMamba().eval()
    H, W = torch.export.Dim("H", min=1, max=256), torch.export.Dim("W", min=1, max=256)
    program = so.export(module, (torch.randn(2, 4, 12, 8),), dynamic_shapes=({2: 2 * H, 3: 2 * W},), optimize=False)
    session, _ = _session(program, tmp_path / "vision.onnx")
    for hw in ((12, 8), (6, 10), (16, 16)):
        _assert_matches(session, module, (torch.randn(2, 4, *hw),))


def _greedy_through_onnx(prefill, step, prompt, steps):
    """Greedy tokens from the ONNX prefill and step (the caches fed back), and the step's logits."""
    logits, *caches = [t.numpy() for t in _run(prefill, [prompt])]
    tokens, all_logits = prompt, [torch.from_numpy(logits)]
    for _ in range(steps):
        token = torch.from_numpy(logits).argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, token], 1)
        positions = torch.full((prompt.shape[0],), tokens.shape[1] - 1, dtype=torch.long)
        logits, *caches = [t.numpy() for t in _run(step, [token, positions, *caches])]
        all_logits.append(torch.from_numpy(logits))
    return tokens, torch.stack(all_logits, 1)


def _greedy_eager(model, prompt, steps):
    tokens, all_logits = prompt, []
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = model(tokens).logits[:, -1]
            all_logits.append(logits)
            if len(all_logits) <= steps:
                tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    return tokens, torch.stack(all_logits, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mamba", "hybrid"])
def test_lm_prefill_and_step_greedy_tokens_equal_eager(name, tmp_path):
    """A tiny LM as two ONNX files: the prefill (exported at 16 tokens, run at 11) gives eager's
    logits, and greedy decoding through the step model gives eager's tokens and logits. The Mamba LM
    goes through the command line (`ssmops export-lm --format onnx` from a checkpoint directory); the
    hybrid holds a Mamba-2 LM's layer."""
    if name == "mamba":
        from test_models import tiny_model

        from ssmops.__main__ import main

        model = tiny_model()
        model.save_pretrained(tmp_path / "checkpoint")
        assert main(["export-lm", str(tmp_path / "checkpoint"), "--format", "onnx", "--out", str(tmp_path / "lm"),
                     "--batch-size", "2", "--max-seqlen", "32"]) == 0
        files = {what: tmp_path / "lm" / f"{what}.onnx" for what in ("prefill", "decode")}
    else:
        from test_models_mamba2 import HYBRID_PAIR, tiny_model

        # hybrid: a Mamba-2 layer and an attention layer with a KV cache, rotary, MLPs
        model = tiny_model(name, **HYBRID_PAIR)
        files = sx.lm_onnx(model, tmp_path, batch_size=2, max_seqlen=32, optimize=False)
    prefill, step = _session_from_file(files["prefill"]), _session_from_file(files["decode"])
    prompt = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(0))
    tokens, logits = _greedy_through_onnx(prefill, step, prompt, steps=4)
    tokens_ref, logits_ref = _greedy_eager(model, prompt, steps=4)
    assert torch.equal(tokens, tokens_ref)
    torch.testing.assert_close(logits, logits_ref, rtol=RTOL, atol=ATOL)


def tiny_mamba2_block() -> nn.Module:
    """The factory `ssmops export` builds in the CLI test: a small Mamba-2 block, fixed weights."""
    from ssmops.modules import Mamba2

    torch.manual_seed(0)
    block = Mamba2(d_model=16, d_state=8, headdim=8, ngroups=2, chunk_size=8).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return block


@pytest.mark.slow
def test_cli_exports_a_mamba2_block_to_onnx(tmp_path, monkeypatch):
    from ssmops.__main__ import main

    monkeypatch.chdir(Path(__file__).parent)
    assert main(["export", "test_onnx:tiny_mamba2_block", "--input", "2x20x16", "--format", "onnx",
                 "--out", str(tmp_path)]) == 0
    session = _session_from_file(tmp_path / "model.onnx")
    block = tiny_mamba2_block()
    for length in (20, 7, 33):
        _assert_matches(session, block, (torch.randn(2, length, 16),))


def _session_from_file(path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


# --- the command line and bad input ---------------------------------------------------------------


def test_export_rejects_what_onnx_cannot_hold():
    with pytest.raises(TypeError, match="model must be"):
        so.export("not a model", ())
    with pytest.raises(TypeError, match="args must be"):
        so.export(nn.Identity(), torch.zeros(1))
    u = torch.randn(1, 2, 5)
    A = torch.complex(-torch.rand(2, 3), torch.rand(2, 3))
    with so.standard_ops(), pytest.raises(NotImplementedError, match="complex A"):
        BC = torch.randn(2, 3, dtype=torch.complex64)
        ssmops.selective_scan_fn(u, u, A, BC, BC)
