"""The benchmarks' peers, behind the benchmarks' signature, compute the same scan as the reference,
and the scripts run. The peers are fetched from the package registry on first use (benchmarks/peers.py);
where that cannot be done here (no network, no einops for mamba_ssm's code), their checks are skipped."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch

import ssmops
from conftest import REPO, assert_close

sys.path.insert(0, str(REPO / "benchmarks"))
from _common import scan_inputs  # noqa: E402
from baselines import mamba_ssm_ref, mambapy_pscan  # noqa: E402


@pytest.fixture
def no_stand_ins_left():
    """Loading mamba_ssm's code puts empty stand-ins for its GPU modules (and packages) in sys.modules;
    later tests must not take them for an installed mamba_ssm."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("mamba_ssm", "selective_scan_cuda"):
            del sys.modules[name]


@pytest.mark.parametrize("peer", [mamba_ssm_ref, mambapy_pscan], ids=["mamba_ssm-ref", "mambapy-pscan"])
@pytest.mark.parametrize("seqlen", [1, 37, 64])
def test_peer_matches_reference(peer, seqlen, no_stand_ins_left):
    try:
        baseline = peer()
    except (subprocess.CalledProcessError, SystemExit) as err:  # pip could not fetch it; einops missing
        pytest.skip(f"the peer is not available here: {err}")
    kw = scan_inputs(2, 8, seqlen, 4, requires_grad=True)
    y = baseline(**kw)
    y_ref = ssmops.selective_scan_ref(**kw, delta_softplus=True)
    assert_close(y, y_ref, 1e-5, "out")
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
    grads = torch.autograd.grad((y * weights).sum(), list(kw.values()))
    grads_ref = torch.autograd.grad((y_ref * weights).sum(), list(kw.values()))
    for name, g, g_ref in zip(kw, grads, grads_ref):
        assert_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.slow
def test_default_benchmark_runs():
    pytest.importorskip("einops", reason="the benchmark's mamba_ssm peer needs einops (make bench-deps installs it)")
    out = subprocess.run([sys.executable, "benchmarks/default.py", "--quick"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "goals:" in out.stdout and "peak memory" in out.stdout


def test_gguf_file_holds_the_model(tmp_path):
    """The files benchmarks/decode.py gives llama.cpp hold the model's weights under llama.cpp's names
    and layouts (read back with gguf, llama.cpp's own reader): f32 exactly; q8_0 within its rounding,
    its matrices in 32-weight blocks but dt_proj's short rows (f16) and the conv (f32)."""
    import peers

    from ssmops.models import MambaConfig, MambaLMHeadModel

    try:
        gguf = peers.gguf()
    except subprocess.CalledProcessError as err:
        pytest.skip(f"gguf is not available here: {err}")
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=64, n_layer=2, vocab_size=96, ssm_cfg={"layer": "Mamba1"}))
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    expected = {"token_embd.weight": sd["backbone.embedding.weight"],
                "output_norm.weight": sd["backbone.norm_f.weight"]}
    for i in range(2):
        mixer = f"backbone.layers.{i}.mixer."
        expected |= {
            f"blk.{i}.attn_norm.weight": sd[f"backbone.layers.{i}.norm.weight"],
            f"blk.{i}.ssm_in.weight": sd[mixer + "in_proj.weight"],
            f"blk.{i}.ssm_conv1d.weight": sd[mixer + "conv1d.weight"][:, 0],
            f"blk.{i}.ssm_conv1d.bias": sd[mixer + "conv1d.bias"],
            f"blk.{i}.ssm_x.weight": sd[mixer + "x_proj.weight"],
            f"blk.{i}.ssm_dt.weight": sd[mixer + "dt_proj.weight"],
            f"blk.{i}.ssm_dt.bias": sd[mixer + "dt_proj.bias"],
            f"blk.{i}.ssm_a": -torch.exp(model.state_dict()[mixer + "A_log"]).numpy(),
            f"blk.{i}.ssm_d": sd[mixer + "D"],
            f"blk.{i}.ssm_out.weight": sd[mixer + "out_proj.weight"],
        }
    for weights in ("f32", "q8_0"):
        path = tmp_path / f"{weights}.gguf"
        weight_bytes = peers.write_gguf(gguf, model, path, weights)
        reader = gguf.GGUFReader(path)
        fields = {name: reader.fields[f"mamba.{name}"].contents() for name in (
            "embedding_length", "block_count", "vocab_size", "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size",
            "ssm.time_step_rank")}
        assert reader.fields["general.architecture"].contents() == "mamba"
        assert fields == {"embedding_length": 64, "block_count": 2, "vocab_size": 96, "ssm.conv_kernel": 4,
                          "ssm.inner_size": 128, "ssm.state_size": 16, "ssm.time_step_rank": 4}
        tensors = {t.name: t for t in reader.tensors}
        assert set(tensors) == set(expected)
        assert weight_bytes == sum(t.n_bytes for t in reader.tensors)
        for name, want in expected.items():
            t = tensors[name]
            got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
            if weights == "f32" or t.tensor_type.name == "F32":
                # A = -exp(A_log): numpy's exp and torch's may differ in the last bit
                rtol = 1e-6 if name.endswith("ssm_a") else 0
                assert t.tensor_type.name == "F32" and np.allclose(got, want, rtol=rtol, atol=0), name
                continue
            short_rows = name.endswith("ssm_dt.weight")
            assert weights == "q8_0" and t.tensor_type.name == ("F16" if short_rows else "Q8_0"), name
            assert "conv1d" not in name and want.ndim == 2, name
            error = np.abs(got - want)
            if short_rows:  # float16: a relative 2**-11
                tolerance = np.abs(want) * 2**-11 + 3e-8
            else:
                # q8_0: a block's scale is its largest |w| / 127 as a float16 (relative error <= 2**-11), each
                # weight a multiple of it up to 127: off by at most half a step plus 127 times the scale's error
                error = error.reshape(-1, 32)
                tolerance = np.abs(want.reshape(-1, 32)).max(1, keepdims=True) / 127 * (0.5 + 127 * 2**-11) + 1e-7
            assert (error <= tolerance).all(), name


def test_torchao_int8_layer_is_the_same_product_as_ssmops(no_stand_ins_left):
    """benchmarks/linear.py times torchao's int8 weight-only layer (as published) against ssmops'
    int8 `weight_only_linear`: both give the layer's float product within int8's rounding (their
    grids differ by a level here and there: ~0.7% apart here)."""
    import peers

    from ssmops.modules.linear import quantize_int8

    try:
        torchao = peers.torchao()
    except (subprocess.CalledProcessError, ImportError) as err:
        pytest.skip(f"torchao is not available here: {err}")
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(96, 40, bias=False)
    x = torch.randn(3, 96, generator=gen)
    with torch.inference_mode():
        expected = layer(x)
        int8, scale = quantize_int8(layer.weight.detach())
        # set_inductor_config=False: its default would retune inductor for the rest of this test process
        torchao.quantization.quantize_(layer, torchao.quantization.Int8WeightOnlyConfig(set_inductor_config=False))
        assert_close(layer(x), expected, 2e-2, "torchao")
        assert_close(torch.ops.ssmops.weight_only_linear(x, int8, scale, None), expected, 2e-2, "ssmops")
        assert_close(layer(x), torch.ops.ssmops.weight_only_linear(x, int8, scale, None), 2e-2, "torchao vs ssmops")


@pytest.mark.slow
def test_linear_benchmark_runs():
    out = subprocess.run([sys.executable, "benchmarks/linear.py", "--quick"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0 and "torchao" in out.stderr and "pip" in out.stderr:
        pytest.skip(f"torchao could not be installed here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr
    assert "torchao int8 (compiled)" in out.stdout and "torchao's int8 layers take up to" in out.stdout


@pytest.mark.slow
def test_decode_benchmark_runs():
    """benchmarks/decode.py at its smallest (d_model 256, 4 layers, batch 1, no llama.cpp): every format's
    row and the summary, with the shares of both bounds."""
    pytest.importorskip("transformers", reason="benchmarks/decode.py compares with transformers")
    out = subprocess.run([sys.executable, "benchmarks/decode.py", "--quick", "--batches", "1", "--no-compile",
                          "--no-llama-cpp", "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for row in ("transformers (fp32)", "ssmops fp32 eager", "ssmops bf16 eager", "ssmops int8 eager"):
        assert row in out.stdout, row
    assert "of its sustained bound" in out.stdout and "of its peak bound" in out.stdout
    assert "read bandwidth, measured now" in out.stdout and "x transformers" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(ssmops.available_backends()["cpu"] != "available", reason="times the native cpu backend")
def test_frontend_benchmark_runs():
    """benchmarks/frontend.py at its smallest: a row for every decoding front end and block."""
    out = subprocess.run([sys.executable, "benchmarks/frontend.py", "--quick"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for row in ("Mamba-1 layout", "Mamba-1, bf16 cache + indices", "Mamba-2, tied (Mamba2.step)",
                "Mamba-2, per channel", "Mamba-2, tied, cache + indices", "Mamba.step", "Mamba2.step"):
        assert row in out.stdout, row
    assert "overhead us" in out.stdout


@pytest.mark.slow  # ~7 s of timing
@pytest.mark.skipif(ssmops.available_backends()["cpu"] != "available", reason="times the native cpu backend")
def test_conv_benchmark_runs():
    """benchmarks/conv.py at its smallest: the cpu, default and F.conv1d columns for both mixers' convs."""
    out = subprocess.run([sys.executable, "benchmarks/conv.py", "--quick"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for row in ("mamba-130m x       forward ", "mamba-130m x       forward+backward", "mamba2-780m xBC    forward ",
                "mamba2-780m xBC    forward+backward"):
        assert row in out.stdout, row
    assert out.stdout.count("x, ") == 4  # a pair of ratios per row


def test_context_parallel_benchmark_counts_constant_state_passing_traffic():
    """benchmarks/context_parallel.py --quick: the bytes its gloo ranks count for the state passing are
    the same for both shard lengths and equal the computed ones; all-to-all's grow with the shard."""
    out = subprocess.run([sys.executable, "benchmarks/context_parallel.py", "--quick"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    measured, computed = out.stdout.split("measured with gloo")[1].split("computed state passing for world 2: ")
    rows = [line.split() for line in measured.splitlines() if line.split() and line.split()[0].isdigit()]
    computed = computed.splitlines()[0]
    assert len(rows) == 2 and {" ".join(r[1:3]) for r in rows} == {computed}, out.stdout
    assert float(rows[1][3]) > 2 * float(rows[0][3]), out.stdout


def test_gpu_benchmark_generate_rows_run_on_any_device():
    """benchmarks/gpu.py's whole-model decoding rows at a tiny shape on the CPU: the LMs it builds (both mixers)
    generate, and decode_rate gives a rate, eager (cg=True captures the token in a CUDA graph: its GPU run times
    that)."""
    import gpu

    for layer in ("Mamba1", "Mamba2"):
        model = gpu.lm(layer, 64, 2, torch.float32, "cpu")
        assert model.config.ssm_cfg["layer"] == layer and model.config.n_layer == 2
        with torch.inference_mode():
            rate = gpu.decode_rate(model, torch.randint(0, 100, (1, 4)), new_tokens=3, cg=False, repeats=1)
        assert 0 < rate < float("inf")


def test_gpu_benchmark_kernel_table_sums_each_kernel(capsys):
    """benchmarks/gpu.py's per-kernel table (`--parts kernels`), on the CPU profiler's events: each kernel's time
    a call, largest first, the calls of one kernel summed (two matmuls a call here, one row)."""
    import gpu

    a, b = torch.randn(256, 256), torch.randn(256, 8)
    seconds = gpu.kernel_table("two products", lambda: (a @ a, (a + 1) @ b), repeats=3, activity="CPU")
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert "aten::mm" in seconds and all(t > 0 for t in seconds.values())
    assert [row[0] for row in rows] == sorted(seconds, key=lambda name: -seconds[name])
    assert sum(row[0] == "aten::mm" for row in rows) == 1


def test_gpu_benchmark_sweep_rows_set_their_knobs_and_restore_them():
    """benchmarks/gpu.py's sweep rows (`--sweep-values`): each knob's other values by default; asked rows, a
    "+" joining knobs that one row sets together, rows naming a knob outside the space left out; every knob a row
    set is back to its chosen value after it, even when the row's timing fails."""
    import types

    import gpu

    space, chosen = {"TILE": (32, 64), "WARPS": (4, 8)}, {"TILE": 64, "WARPS": 4}
    assert gpu.knob_values(space, chosen, "") == [(("TILE", 32),), (("WARPS", 8),)]
    rows = gpu.knob_values(space, chosen, "TILE=32+WARPS=8,OTHER=1,WARPS=8")
    assert rows == [(("TILE", 32), ("WARPS", 8)), (("WARPS", 8),)]
    module = types.SimpleNamespace(**chosen)
    with pytest.raises(RuntimeError), gpu.knobs_set(module, rows[0]) as label:
        assert label == "TILE 32 + WARPS 8" and (module.TILE, module.WARPS) == (32, 8)
        raise RuntimeError("out of resources")
    assert vars(module) == chosen


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="times the Triton launchers")
def test_decode_overhead_benchmark_runs():
    """benchmarks/decode_overhead.py at its smallest (without a GPU: CPU tensors on the GPU route, the launch a
    no-op): every stage of each layout, and one launch a front-end call."""
    out = subprocess.run([sys.executable, "benchmarks/decode_overhead.py", "--calls", "20", "--repeats", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for row in ("launch", "launcher", "triton operator", "front end", "Mamba-1, dim 5120", "Mamba-2, 80 x 64 heads",
                "per head (ssmops' Mamba2.step)", "causal conv step"):
        assert row in out.stdout, row
    assert out.stdout.count("one front-end call: 1 launch(es); aten allocations and copies: aten::empty 1") == 4
