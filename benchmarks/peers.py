"""Peers' published code, fetched from the package registry at benchmark time and run as published.

Nothing here is committed code of theirs: `mamba_ssm_module` downloads mamba-ssm's source
distribution with pip (the CUDA build skipped: only its Python files are read) into
build/peers/ and loads one of its modules by path; `mambapy` installs mambapy (pure PyTorch)
with `pip install --no-deps --target build/peers/...` and imports it from there; `llama_cpp`
installs llama-cpp-python the same way (built from its source distribution, so for this CPU:
a few minutes, once), and `gguf` llama.cpp's own writer and reader of model files, which
`write_gguf` uses to write an ssmops model for it; `torchao` installs PyTorch's quantization
library the same way, for its int8 weight-only linear layers.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import numpy as np

PEERS_DIR = Path(__file__).resolve().parents[1] / "build" / "peers"
MAMBA_SSM_VERSION = "2.3.2.post1"  # the published sdist (2.3.2 itself is not on the index)
MAMBAPY_VERSION = "1.2.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# built from source (for this CPU), with what its Python side imports beyond numpy and typing_extensions
LLAMA_CPP_PIP_ARGS = ("--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                      "diskcache==5.6.3", "jinja2==3.1.6", "markupsafe==3.0.3")
GGUF_VERSION = "0.19.0"  # llama.cpp's writer and reader of its model files (pure Python; numpy, yaml)
TORCHAO_VERSION = "0.18.0"


def mamba_ssm_source(version: str = MAMBA_SSM_VERSION) -> Path:
    """The unpacked sdist of mamba-ssm `version`, downloaded once."""
    root = PEERS_DIR / f"mamba_ssm-{version}"
    if not root.exists():
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "--no-build-isolation", f"mamba-ssm=={version}", "-d", str(PEERS_DIR)],
            check=True, env={**os.environ, "MAMBA_SKIP_CUDA_BUILD": "TRUE"},  # metadata without nvcc
        )
        with tarfile.open(PEERS_DIR / f"mamba_ssm-{version}.tar.gz") as sdist:
            sdist.extractall(PEERS_DIR, filter="data")
    return root


def _with_parents(name: str) -> None:
    """Empty stand-ins for `name`'s packages (and itself) where none is imported: mamba_ssm's
    package __init__ imports its CUDA kernels, so it is never run."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))


def mamba_ssm_module(relative_path: str, stubs: dict[str, tuple[str, ...]],
                     published: tuple[str, ...] = ()) -> types.ModuleType:
    """One module of mamba-ssm's sdist loaded by path; `stubs` maps the modules it imports that need
    a GPU (CUDA extensions, Triton kernels) to the names it takes from them, given as None stand-ins;
    `published` names the modules it imports that run on CPU, loaded from the sdist as they are.
    Needs einops (`pip install einops`)."""
    for name, attributes in stubs.items():
        _with_parents(name)
        for attribute in attributes:
            setattr(sys.modules[name], attribute, None)
    for name in published:
        if name not in sys.modules:
            _with_parents(name)  # its packages; its own stand-in is replaced at once
            sys.modules[name] = _load(mamba_ssm_source() / (name.replace(".", "/") + ".py"), name)
    return _load(mamba_ssm_source() / relative_path, f"peer_{Path(relative_path).stem}")


def mamba_ssm_triton(module: str) -> types.ModuleType:
    """mamba_ssm's Triton module `module` (e.g. "ssd_combined") from an sdist already in build/peers (a GPU
    machine without the index gets it carried there: docs/deployment.md), imported as published under its
    own package names. Its packages are stand-ins whose path is the sdist's folders, so that their
    __init__, which loads mamba_ssm's CUDA extension, never runs. Needs einops and packaging."""
    root = PEERS_DIR / f"mamba_ssm-{MAMBA_SSM_VERSION}"
    if not root.exists():
        raise ImportError(f"no mamba_ssm sdist in {root} (make bench-deps fetches it)")
    for package in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.utils"):
        if package not in sys.modules:
            sys.modules[package] = types.ModuleType(package)
            sys.modules[package].__path__ = [str(root / package.replace(".", "/"))]
    return importlib.import_module(f"mamba_ssm.ops.triton.{module}")


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        if "einops" in str(err):
            raise SystemExit("mamba_ssm's code needs einops: pip install einops") from err
        raise
    return module


def ssd_minimal_discrete():
    """mamba_ssm's pure-PyTorch SSD (`mamba_ssm/modules/ssd_minimal.py`), whose one Triton import
    (the fused kernel it is compared with in its own test) is stubbed."""
    stubs = {"mamba_ssm.ops.triton.ssd_combined": ("mamba_chunk_scan_combined",)}
    module = mamba_ssm_module("mamba_ssm/modules/ssd_minimal.py", stubs)
    return module.ssd_minimal_discrete


def selective_scan_ref():
    """mamba_ssm's `selective_scan_ref` (mamba_ssm/ops/selective_scan_interface.py): a Python step per
    timestep over materialised (batch, dim, seqlen, dstate) tensors, autograd as its backward. The
    CUDA extension and the Triton layer norm its module imports (for the fused paths) are stubbed;
    its autocast decorators (mamba_ssm/utils/torch.py) are loaded as published."""
    stubs = {"selective_scan_cuda": (), "mamba_ssm.ops.triton.layer_norm": ("_layer_norm_fwd",)}
    module = mamba_ssm_module("mamba_ssm/ops/selective_scan_interface.py", stubs, published=("mamba_ssm.utils.torch",))
    return module.selective_scan_ref


def mambapy(version: str = MAMBAPY_VERSION) -> types.ModuleType:
    """mambapy's `mamba` module: the installed package if it is `version` (the bench extra installs it),
    else `version` installed once without dependencies (it needs only torch) into
    build/peers/mambapy-VERSION and imported from there."""
    try:
        if importlib.metadata.version("mambapy") == version:
            return importlib.import_module("mambapy.mamba")
    except importlib.metadata.PackageNotFoundError:
        pass
    return _installed("mambapy.mamba", f"mambapy-{version}", (f"mambapy=={version}",))


def llama_cpp() -> types.ModuleType:
    """llama-cpp-python `LLAMA_CPP_PYTHON_VERSION`, built once from its source distribution with
    llama.cpp's defaults (GGML_NATIVE: for the CPU it is built on) into build/peers/llama_cpp-VERSION."""
    return _installed("llama_cpp", f"llama_cpp-{LLAMA_CPP_PYTHON_VERSION}", LLAMA_CPP_PIP_ARGS,
                      f"building llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (once; minutes)")


def gguf() -> types.ModuleType:
    """The gguf package `GGUF_VERSION`, installed once into build/peers/gguf-VERSION."""
    return _installed("gguf", f"gguf-{GGUF_VERSION}", (f"gguf=={GGUF_VERSION}",))


def torchao() -> types.ModuleType:
    """torchao `TORCHAO_VERSION` (its wheel: its CPU paths are Python over aten), installed once into
    build/peers/torchao-VERSION; its CUDA-only libraries fail to load on a CPU machine, which it
    reports and survives."""
    return _installed("torchao", f"torchao-{TORCHAO_VERSION}", (f"torchao=={TORCHAO_VERSION}",))


def _installed(name: str, folder: str, pip_args: tuple[str, ...], announce: str | None = None) -> types.ModuleType:
    """Module `name` from build/peers/`folder`, where `pip install --no-deps --target` puts `pip_args`
    (the packages, and options such as --no-binary) on the first call."""
    target = PEERS_DIR / folder
    if not (target / name.split(".")[0]).exists():
        if announce:
            print(f"{announce}: {target}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--no-deps", "--target",
                        str(target), *pip_args], check=True)
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    return importlib.import_module(name)


# llama.cpp's names for a Mamba-1 block's tensors (gguf's MODEL_TENSOR names), from ssmops' mixer's
LLAMA_CPP_MIXER = {"in_proj.weight": "ssm_in.weight", "conv1d.weight": "ssm_conv1d.weight",
                   "conv1d.bias": "ssm_conv1d.bias", "x_proj.weight": "ssm_x.weight", "dt_proj.weight": "ssm_dt.weight",
                   "dt_proj.bias": "ssm_dt.bias", "A_log": "ssm_a", "D": "ssm_d", "out_proj.weight": "ssm_out.weight"}


def write_gguf(gguf: types.ModuleType, model, path: Path, weights: str) -> int:
    """Writes a Mamba-1 `MambaLMHeadModel` (tied embeddings, float32) as llama.cpp's
    convert_hf_to_gguf.py would with --outtype f32 or q8_0, and returns the bytes a decoding token
    reads (every tensor once). Its choices, as facts of the format: A is stored as -exp(A_log), the
    conv's weight as (d_inner, d_conv); q8_0 quantizes the matrices named *.weight but the conv's and
    the norms, and stores those whose rows are not a multiple of its 32-weight blocks (dt_proj's) as
    f16. No tokenizer: the vocabulary is its size ("none")."""
    if not model.config.tie_embeddings:
        raise ValueError("write_gguf writes tied embeddings only (llama.cpp's head is then token_embd)")
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    d_inner, d_model = sd["backbone.layers.0.mixer.in_proj.weight"].shape
    d_inner //= 2
    d_state = sd["backbone.layers.0.mixer.A_log"].shape[1]
    tensors = {"token_embd.weight": sd["backbone.embedding.weight"], "output_norm.weight": sd["backbone.norm_f.weight"]}
    for i in range(model.config.n_layer):
        prefix = f"backbone.layers.{i}."
        tensors[f"blk.{i}.attn_norm.weight"] = sd[prefix + "norm.weight"]
        for ours, theirs in LLAMA_CPP_MIXER.items():
            tensors[f"blk.{i}.{theirs}"] = sd[prefix + "mixer." + ours]
        tensors[f"blk.{i}.ssm_a"] = -np.exp(tensors[f"blk.{i}.ssm_a"])
        tensors[f"blk.{i}.ssm_conv1d.weight"] = tensors[f"blk.{i}.ssm_conv1d.weight"].reshape(d_inner, -1)
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_context_length(2**20)
    writer.add_embedding_length(d_model)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(model.config.n_layer)
    writer.add_ssm_conv_kernel(tensors["blk.0.ssm_conv1d.weight"].shape[1])
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(tensors["blk.0.ssm_dt.weight"].shape[1])
    writer.add_layer_norm_rms_eps(model.config.norm_epsilon)
    writer.add_ssm_dt_b_c_rms(False)
    writer.add_tokenizer_model("none")
    writer.add_vocab_size(model.config.vocab_size)
    q8 = weights == "q8_0"
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    total = 0
    for name, data in tensors.items():
        qtype = gguf.GGMLQuantizationType.F32
        if q8 and data.ndim == 2 and name.endswith(".weight") and "conv1d" not in name:
            qtype = gguf.GGMLQuantizationType.Q8_0 if data.shape[1] % 32 == 0 else gguf.GGMLQuantizationType.F16
        data = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
        total += data.nbytes
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total
