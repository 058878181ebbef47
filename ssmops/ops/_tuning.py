"""Launch knobs (tiles, warps, pipelining stages) chosen per shape on the GPU at hand: measured once, kept.

A family's Triton launcher reads its knobs through its `Tuner`: the family module's constants (the defaults,
chosen for sm_90), overlaid with what was tuned for the call's key, the sizes that stay the same across the
calls of one model layer (heads, head and state sizes, chunk, dtypes, which optionals are given), never the
batch or the sequence length, which a compiled graph keeps dynamic and must not guard on.

With SSMOPS_AUTOTUNE=1 the first eager call on a key not yet tuned times the launcher with each value of each
of its phase's knobs in turn, from the defaults, keeping a value when it is MARGIN faster (one knob at a time: the
knobs mostly set different kernels' launches), on the call's own inputs. The choice is kept for the process
and written to a JSON file (SSMOPS_TUNING_CACHE, else ~/.cache/ssmops/tuning.json) under the device's name and
Triton's version; later processes read it whether or not they tune. Traced calls (torch.compile, export,
AOTInductor) and CUDA-graph captures only read: a graph keeps the knobs chosen when it was traced. So do calls
under `torch.use_deterministic_algorithms(True)`: the knobs set the order of some sums, and a choice by the clock
could differ from one run to the next. Values read from the file are used only where the family's space lists
them.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ._checks import capturing
from ._family import traced

AUTOTUNE_ENV = "SSMOPS_AUTOTUNE"
CACHE_ENV = "SSMOPS_TUNING_CACHE"
TIMED_RUNS = 5  # a candidate's time: the median of these, after a first run that compiles it
MARGIN = 0.03  # a value replaces the one kept only when this much faster: within the clock's noise, the kept stays


def autotuning() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "0").lower() in ("1", "true", "on", "yes")


def cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ssmops" / "tuning.json")


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The GPU's name (what a choice was measured on) and Triton's version (what compiled the kernels)."""
    import triton

    backend = getattr(torch, device.type, None)  # torch.cuda (ROCm's too), torch.xpu
    if device.type != "cpu" and backend is not None and backend.is_available():
        name = backend.get_device_name(device)
    else:  # (CPU tensors under the interpreter; fake CUDA ones on a machine without CUDA)
        name = f"{device.type} (interpreted)" if device.type == "cpu" else f"{device.type} (unavailable)"
    return f"{name}, triton {triton.__version__}"


def measure(run: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of `run` takes on the device: the median of TIMED_RUNS after a first run, each timed by
    events on CUDA, by the clock to a synchronize elsewhere; on the CPU (the interpreter) one run by the clock."""
    if device.type == "cpu":
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    backend = getattr(torch, device.type)
    run()
    times = []
    for _ in range(TIMED_RUNS):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            backend.synchronize(device)
            start = time.perf_counter()
            run()
            backend.synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class Tuner:
    """The knobs of one family's launcher: `defaults` reads the module constants named in `space` (so that
    benchmarks/gpu.py --sweep can set them), `space` lists each knob's values worth timing."""

    def __init__(self, family: str, defaults: Callable[[], dict], space: dict[str, tuple]):
        self.family, self.defaults, self.space = family, defaults, space
        self._chosen: dict[tuple[str, str], dict] = {}  # (device name, key) -> {phase: {knob: value}}
        self._loaded = False

    def knobs(self, key: str | None, device: torch.device) -> dict:
        """The knobs of a call: the defaults, with those tuned for key on this device (key None: defaults)."""
        knobs = self.defaults()
        self._load()
        if key is None or not self._chosen:  # (nothing tuned: not even the device's name is needed)
            return knobs
        for phase in self._chosen.get((device_name(device), key), {}).values():
            knobs.update(phase)
        return knobs

    def choices(self) -> dict:
        """{(device name, key): {phase: {knob: value}}}: what this process tuned or read from the file."""
        self._load()
        return {where: {phase: dict(knobs) for phase, knobs in entry.items()} for where, entry in self._chosen.items()}

    def choose(self, key: str | None, device: torch.device, phase: str, names: tuple[str, ...],
               run: Callable[[dict], object], knobs: dict | None = None) -> dict:
        """A launcher's knobs: `knobs` where the caller gives them (a candidate being timed), else the key's, tuned
        first where asked (`tune`)."""
        if knobs is not None:
            return knobs
        self.tune(key, device, phase, names, run)
        return self.knobs(key, device)

    def tune(self, key: str | None, device: torch.device, phase: str, names: tuple[str, ...],
             run: Callable[[dict], object]) -> bool:
        """With SSMOPS_AUTOTUNE=1, in an eager call, for a key whose phase is not tuned yet: `run(knobs)` timed
        with each value of each knob of `names` in turn, one MARGIN faster kept; then kept for the process and the file.
        A value that fails to launch (e.g. Triton's OutOfResources) is passed over. Whether it tuned."""
        if (key is None or not autotuning() or traced() or torch.are_deterministic_algorithms_enabled()
                or capturing(device)):
            return False
        entry = self._entry(key, device)
        if phase in entry:
            return False
        knobs = self.knobs(key, device)
        best = measure(lambda: run(knobs), device)
        for name in names:
            start = knobs[name]  # (timed already)
            for value in self.space[name]:
                if value == start:
                    continue
                candidate = dict(knobs, **{name: value})
                try:
                    seconds = measure(lambda: run(candidate), device)
                except Exception as error:  # noqa: BLE001 (any failure to compile or launch: not a candidate)
                    if type(error).__name__ not in ("OutOfResources", "CompilationError", "RuntimeError"):
                        raise
                    continue
                if seconds < best * (1 - MARGIN):
                    best, knobs = seconds, candidate
        entry[phase] = {name: knobs[name] for name in names}
        self._save(device)
        return True

    def _entry(self, key: str, device: torch.device) -> dict:
        self._load()
        return self._chosen.setdefault((device_name(device), key), {})

    def _load(self) -> None:
        """The file's choices for this family, those within the space."""
        if self._loaded:
            return
        self._loaded = True
        try:
            saved = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            return
        for device, families in _mapping(saved).items():
            for key, entry in _mapping(_mapping(families).get(self.family)).items():
                self._chosen[(device, key)] = {
                    phase: knobs for phase, knobs in _mapping(entry).items() if isinstance(knobs, dict) and
                    all(name in self.space and value in self.space[name] for name, value in knobs.items())}

    def _save(self, device: torch.device) -> None:
        """This process's choices on the device, merged into the file (written whole, then renamed into place)."""
        path = cache_path()
        try:
            saved = _mapping(json.loads(path.read_text()))
        except (OSError, ValueError):
            saved = {}
        name = device_name(device)
        families = saved[name] = _mapping(saved.get(name))
        chosen = families[self.family] = _mapping(families.get(self.family))
        chosen.update({key: entry for (dev, key), entry in self._chosen.items() if dev == name and entry})
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(saved, indent=1, sort_keys=True))
        os.replace(partial, path)


def _mapping(value) -> dict:
    """value where it is a JSON object, else an empty one (the file is read, not trusted)."""
    return value if isinstance(value, dict) else {}
