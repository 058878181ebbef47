"""Reading weights: a state_dict from safetensors or torch files, with nothing in them executed.

Below both the models (`from_pretrained`) and the export tool, which read checkpoints through it.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Reads a .safetensors file (8-byte header length, JSON header, raw little-endian data)
    without the safetensors package; nothing in it is executed."""
    if sys.byteorder != "little":
        raise ValueError("safetensors data is little-endian; this machine is not")
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path} is not a safetensors file: {len(data)} bytes")
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        raise ValueError(f"{path} is not a safetensors file: header of {header_len} bytes past its end")
    header = json.loads(data[8 : 8 + header_len])
    body = memoryview(data)[8 + header_len :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        flat = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    return tensors


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A state_dict from `.safetensors` or a torch `.pt`/`.pth`/`.bin` file, loaded with
    `weights_only=True` (no pickled code runs); a {"state_dict": ...} or {"model": ...}
    wrapper is unwrapped."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state_dict")
    return state
