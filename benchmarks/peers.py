"""Peers' published code, fetched from the package registry at benchmark time and run as published.

Nothing here is committed code of theirs: `mamba_ssm_module` downloads mamba-ssm's source
distribution with pip (the CUDA build skipped: only its Python files are read) into
build/peers/ and loads one of its modules by path.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import types
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parents[1] / "build" / "peers"
MAMBA_SSM_VERSION = "2.3.2.post1"  # the published sdist (2.3.2 itself is not on the index)


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


def mamba_ssm_module(relative_path: str, stubs: dict[str, tuple[str, ...]]) -> types.ModuleType:
    """One module of mamba-ssm's sdist loaded by path; `stubs` maps the modules it imports that need
    a GPU (Triton kernels) to the names it takes from them, given as None stand-ins. Needs einops
    (`pip install einops`)."""
    for name, attributes in stubs.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        for attribute in attributes:
            setattr(sys.modules[name], attribute, None)
    path = mamba_ssm_source() / relative_path
    spec = importlib.util.spec_from_file_location(f"peer_{path.stem}", path)
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
