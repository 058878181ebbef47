"""From a model to files a C++ process runs: export helpers, the CLI, and examples/cpp.

The C++ runner is built with CMake against the installed libtorch and run as its own
process (no Python in it); its outputs are compared with eager PyTorch.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from torch import nn

import ssmops
import ssmops.export as sx
from conftest import REPO
from models import TinyScanModel

pytestmark = pytest.mark.skipif(
    ssmops.available_backends()["cpu"] != "available", reason="needs the native operator library"
)


def _run_cpp(runner, model_flag, model_path, inputs, tmp_path):
    inputs_file, outputs_file = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save(list(inputs), inputs_file)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(
        [runner, "--ops-library", ssmops.library_path(), model_flag, model_path, "--inputs", inputs_file,
         "--repeat", "2", "--save-outputs", outputs_file],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "time per run" in proc.stdout
    return torch.load(outputs_file, weights_only=True)


def _model(full):
    torch.manual_seed(0)
    return TinyScanModel(full=full).eval()


@pytest.mark.slow
def test_scan_and_ssd_model_packages_run_in_cpp_like_eager(cpp_runner, scan_and_ssd_package, tmp_path):
    """The models exported (batch and seqlen dynamic) at 37 tokens and packaged with AOTInductor give, in
    the C++ runner and loaded in Python, what they give in eager mode at other batches and lengths: past
    the Mamba-1 kernels' 2048-token chunk, and over many of SSD's 16-token chunks."""
    model, package = scan_and_ssd_package
    loaded = torch._inductor.aoti_load_package(str(package))
    for shape in [(2, 37, 8), (3, 2100, 8)]:
        x = torch.randn(shape)
        outputs = _run_cpp(cpp_runner, "--package", package, [x], tmp_path)
        with torch.no_grad():
            expected = model(x)
            for what, got in (("C++", outputs), ("Python", loaded(x))):
                for name, out, want in zip(model.OUTPUTS, got, expected, strict=True):
                    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}, {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("full", [True, False], ids=["all-optionals", "no-optionals"])
def test_torchscript_runs_in_cpp_like_eager(full, cpp_runner, tmp_path):
    model = _model(full)
    path = sx.torchscript(model, (torch.randn(2, 8, 37),), tmp_path / "model_ts.pt")
    for shape in [(2, 8, 37), (1, 8, 300)]:
        x = torch.randn(shape)
        (out,) = _run_cpp(cpp_runner, "--torchscript", path, [x], tmp_path)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_export_program_keeps_seqlen_and_batch_dynamic():
    ep = sx.export_program(_model(True), (torch.randn(2, 8, 37),), seq_dim=2)
    (dims,) = sx.dynamic_dims(ep)
    assert dims[1] == "8" and not dims[0].isdigit() and not dims[2].isdigit()


class _Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: not exportable
            return x
        return -x


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Identity(), _Gate())

    def forward(self, x):
        return self.blocks(x)


def test_export_error_names_the_module():
    with pytest.raises(sx.ExportError, match=r"cannot export _Net: blocks\.1 \(_Gate\) failed with"):
        sx.export_program(_Net(), (torch.randn(2, 8, 16),))


def _write_safetensors(path, tensors):
    """The safetensors layout, written by hand: u64 header length, JSON header, raw data."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        blob = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_load_state_dict_reads_safetensors_and_pt(tmp_path):
    state = {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16), "n": torch.arange(5)}
    _write_safetensors(tmp_path / "m.safetensors", state)
    torch.save({"state_dict": state}, tmp_path / "m.pt")
    for name in ("m.safetensors", "m.pt"):
        loaded = sx.load_state_dict(tmp_path / name)
        assert loaded.keys() == state.keys()
        for k in state:
            assert torch.equal(loaded[k], state[k])


@pytest.mark.slow  # an AOTInductor compile
def test_cli_exports_a_checkpoint(tmp_path):
    trained = _model(True)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5)
    _write_safetensors(tmp_path / "trained.safetensors", trained.state_dict())
    out = subprocess.run(
        [sys.executable, "-m", "ssmops", "export", "models:TinyScanModel", "--checkpoint",
         str(tmp_path / "trained.safetensors"), "--input", "2x8x37", "--seq-dim", "2", "--format", "pt2",
         "--format", "torchscript", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO / "tests", env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "[4/4] tracing with TorchScript" in out.stderr and "model.pt2" in out.stdout
    assert "input 0: shape (s" in out.stdout
    x = torch.randn(2, 8, 50)
    program = torch.export.load(tmp_path / "out" / "model.pt2").module()
    with torch.no_grad():
        torch.testing.assert_close(program(x), trained(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.jit.load(tmp_path / "out" / "model_ts.pt")(x), trained(x))


def test_cli_reports_a_bad_factory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ssmops", "export", "models:Nope", "--input", "2x8"],
                         capture_output=True, text=True, cwd=REPO / "tests",
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode != 0 and "cannot load models:Nope" in out.stderr


class _DecodeStep(nn.Module):
    """One decoding step: the state goes in and comes out updated."""

    def __init__(self, dim=8, dstate=4):
        super().__init__()
        self.A = nn.Parameter(-torch.rand(dim, dstate))
        self.D = nn.Parameter(torch.ones(dim))

    def forward(self, state, x, dt, B, C):
        state = state.clone()
        y = ssmops.selective_state_update(state, x, dt, self.A, B, C, self.D, None, None, True)
        return y, state


class _MultiheadDecodeStep(nn.Module):
    """Mamba-2's decoding step on a bfloat16 cache, dt/A/dt_bias tied per head as Mamba2 passes
    them, one batch row pointing at a cache row and one padding."""

    def __init__(self, nheads=4, headdim=3, dstate=5):
        super().__init__()
        self.headdim, self.dstate = headdim, dstate
        self.A_log = nn.Parameter(torch.rand(nheads))
        self.D = nn.Parameter(torch.ones(nheads))
        self.dt_bias = nn.Parameter(torch.rand(nheads))

    def forward(self, cache, x, dt, B, C, indices):
        cache = cache.clone()
        h, p, n = x.shape[1], self.headdim, self.dstate
        A = (-torch.exp(self.A_log))[:, None, None].expand(h, p, n)
        y = ssmops.selective_state_update(cache, x, dt[..., None].expand(-1, h, p), A, B, C, self.D, None,
                                          self.dt_bias[:, None].expand(h, p), True, indices)
        return y, cache


class _DecodeSteps(nn.Module):
    """Mamba-1's decoding step and the multi-head one side by side: one package for both."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mamba1, self.multihead = _DecodeStep(), _MultiheadDecodeStep()

    def forward(self, state, x, dt, B, C, cache, mh_x, mh_dt, mh_B, mh_C, indices):
        return self.mamba1(state, x, dt, B, C) + self.multihead(cache, mh_x, mh_dt, mh_B, mh_C, indices)


@pytest.mark.slow
def test_decode_step_packages_run_in_cpp(cpp_runner, tmp_path):
    """The steps' outputs and updated states in C++ are eager's; the multi-head step updates the cache
    row its index names and leaves the padding's (-1) alone."""
    steps = _DecodeSteps().eval()
    inputs = (torch.randn(2, 8, 4), torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 4), torch.randn(2, 4),
              torch.randn(3, 4, 3, 5).to(torch.bfloat16), torch.randn(2, 4, 3), torch.randn(2, 4),
              torch.randn(2, 2, 5), torch.randn(2, 2, 5), torch.tensor([2, -1]))
    package = sx.aoti_package(torch.export.export(steps, inputs), tmp_path / "steps.pt2")
    outputs = _run_cpp(cpp_runner, "--package", package, inputs, tmp_path)
    with torch.no_grad():
        expected = steps(*inputs)
    for name, got, want in zip(("y", "state", "multi-head y", "cache"), outputs, expected, strict=True):
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")
    cache, cache_in = outputs[3], inputs[5]
    assert not torch.equal(cache[2], cache_in[2]) and torch.equal(cache[:2], cache_in[:2])


@pytest.mark.slow
def test_lm_prefill_and_decode_packages_run_in_cpp_like_eager(cpp_runner, tmp_path):
    """A hybrid LM (a Mamba-2 layer, as a Mamba-2 LM repeats it, and attention with a KV cache) as two
    AOTInductor packages, written by the command line from a checkpoint directory (which calls
    `ssmops.export.lm_packages`): the prefill (prompt length dynamic) and the one-token step. In C++,
    the prefill's logits and caches are eager's, and the step on them gives the logits of the model
    over prompt + token."""
    from test_models_mamba2 import HYBRID_PAIR, tiny_model

    from ssmops.__main__ import main

    model = tiny_model("hybrid", **HYBRID_PAIR)
    model.save_pretrained(tmp_path / "checkpoint")
    assert main(["export-lm", str(tmp_path / "checkpoint"), "--out", str(tmp_path / "packages"),
                 "--batch-size", "2", "--max-seqlen", "32"]) == 0
    packages = {what: tmp_path / "packages" / f"{what}.pt2" for what in ("prefill", "decode")}
    prompt = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(0))
    logits, *caches = _run_cpp(cpp_runner, "--package", packages["prefill"], [prompt], tmp_path)
    with torch.no_grad():
        logits_ref, *caches_ref = sx.LMPrefill(model, 32)(prompt)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    for cache, cache_ref in zip(caches, caches_ref, strict=True):
        torch.testing.assert_close(cache, cache_ref, rtol=1e-5, atol=1e-5)
    token = logits.argmax(-1, keepdim=True)
    positions = torch.full((2,), 11)
    step_logits, *_ = _run_cpp(cpp_runner, "--package", packages["decode"], [token, positions, *caches], tmp_path)
    with torch.no_grad():
        expected = model(torch.cat([prompt, token], dim=1)).logits[:, -1]
    torch.testing.assert_close(step_logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_decoding_step_package_with_converted_weights_runs_in_cpp(weights, cpp_runner, tmp_path):
    """The one-token step of a Mamba LM whose projections are stored as bf16 / int8: the package
    carries them so, and C++ gives eager's logits and caches."""
    from test_models import tiny_model

    model = tiny_model(seed=1).convert_weights(weights)
    ep = sx.decoding_step_program(model, batch_size=2, max_seqlen=16)
    assert "weight_only_linear" in str(ep.graph)
    package = sx.aoti_package(ep, tmp_path / "decode.pt2")
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(t.shape, generator=gen) for states in model.allocate_inference_cache(2, 16).values()
              for t in states]
    inputs = [torch.tensor([[5], [7]]), torch.tensor([4, 9]), *caches]
    outputs = _run_cpp(cpp_runner, "--package", package, inputs, tmp_path)
    with torch.no_grad():
        expected = sx.LMDecodingStep(model, 2, 16)(*inputs)
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
