"""Launch knobs tuned per shape (ssmops/ops/_tuning.py): the search, what is kept and read back, and the SSD
launcher's key. (The SSD scan tuned under the interpreter: tests/test_triton.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from ssmops.ops import _tuning

CPU = torch.device("cpu")
SPACE = {"TILE": (16, 32, 64), "WARPS": (4, 8), "STAGES": (1, 2, 3)}
DEFAULTS = {"TILE": 64, "WARPS": 8, "STAGES": 2}
# seconds a launch takes with each (TILE, WARPS, STAGES): fastest at (32, 4, 2); TILE 16 beats the default 64
COST = {(tile, warps, stages): 1.0 + {16: 0.5, 32: 0.0, 64: 1.0}[tile] + 0.5 * (warps != 4) + 0.25 * (stages == 3)
        + 0.1 * (stages == 1) for tile in SPACE["TILE"] for warps in SPACE["WARPS"] for stages in SPACE["STAGES"]}


class Launches:
    """A launcher stand-in: records the knobs of each call; its time (the patched `measure`) is COST's."""

    def __init__(self, fail: dict | None = None):
        self.calls, self.fail = [], fail or {}

    def __call__(self, knobs: dict) -> tuple:
        for name, (value, error) in self.fail.items():
            if knobs[name] == value:
                raise error
        self.calls.append(dict(knobs))
        return knobs["TILE"], knobs["WARPS"], knobs["STAGES"]


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """SSMOPS_AUTOTUNE=1, choices kept in tmp_path, a launch timed by COST."""
    monkeypatch.setenv(_tuning.AUTOTUNE_ENV, "1")
    monkeypatch.setenv(_tuning.CACHE_ENV, str(tmp_path / "tuning.json"))
    monkeypatch.setattr(_tuning, "measure", lambda run, device: COST[run()])
    return tmp_path / "tuning.json"


def _tuner() -> _tuning.Tuner:
    return _tuning.Tuner("test", lambda: dict(DEFAULTS), SPACE)


def test_each_knob_in_turn_keeps_the_faster_value_and_the_choice_is_kept(tuning):
    tuner, launches = _tuner(), Launches()
    assert tuner.tune("layer", CPU, "forward", ("TILE", "WARPS", "STAGES"), launches)
    # from the defaults: TILE's values (64 kept until 32 is faster), then WARPS', then STAGES' from there on
    assert [tuple(c.values()) for c in launches.calls] == [(64, 8, 2), (16, 8, 2), (32, 8, 2), (32, 4, 2),
                                                           (32, 4, 1), (32, 4, 3)]
    assert tuner.knobs("layer", CPU) == {"TILE": 32, "WARPS": 4, "STAGES": 2}
    assert tuner.knobs("another layer", CPU) == DEFAULTS
    # tuned once per key and phase, kept for the process and in the file, which another process reads
    assert not tuner.tune("layer", CPU, "forward", ("TILE",), launches) and len(launches.calls) == 6
    saved = json.loads(tuning.read_text())
    assert saved == {_tuning.device_name(CPU): {"test": {"layer": {"forward": {"TILE": 32, "WARPS": 4, "STAGES": 2}}}}}
    assert _tuner().knobs("layer", CPU) == {"TILE": 32, "WARPS": 4, "STAGES": 2}


def test_phases_are_tuned_apart_and_the_file_keeps_other_entries(tuning):
    tuning.write_text(json.dumps({"Some GPU, triton 9": {"test": {"layer": {"forward": {"TILE": 16}}}},
                                  _tuning.device_name(CPU): {"other": {"k": {"forward": {"X": 1}}}}}))
    tuner = _tuner()
    assert tuner.knobs("layer", CPU) == DEFAULTS  # (another device's choice)
    tuner.tune("layer", CPU, "forward", ("TILE",), Launches())
    tuner.tune("layer", CPU, "backward", ("STAGES",), Launches())
    assert tuner.knobs("layer", CPU) == {"TILE": 32, "WARPS": 8, "STAGES": 2}
    saved = json.loads(tuning.read_text())
    assert saved["Some GPU, triton 9"] == {"test": {"layer": {"forward": {"TILE": 16}}}}
    assert saved[_tuning.device_name(CPU)] == {"other": {"k": {"forward": {"X": 1}}}, "test": {
        "layer": {"forward": {"TILE": 32}, "backward": {"STAGES": 2}}}}


def test_choices_outside_the_space_are_not_used(tuning):
    """The file is read, not trusted: a knob or a value the space does not list leaves that phase's defaults."""
    device = _tuning.device_name(CPU)
    tuning.write_text(json.dumps({device: {"test": {
        "a": {"forward": {"TILE": 4096}}, "b": {"forward": {"TILE": "64; rm"}}, "c": {"forward": {"num_ctas": 2}},
        "d": {"forward": {"TILE": 16}, "backward": {"WARPS": 3}}, "e": ["not", "a", "dict"]}}}))
    tuner = _tuner()
    for key in "abce":
        assert tuner.knobs(key, CPU) == DEFAULTS, key
    assert tuner.knobs("d", CPU) == {**DEFAULTS, "TILE": 16}
    for garbage in ("{not json", '{"%s": {"test": ["d"]}}' % device, '{"%s": "test"}' % device, "[]"):
        tuning.write_text(garbage)
        assert _tuner().knobs("d", CPU) == DEFAULTS, garbage
    _tuner().tune("d", CPU, "forward", ("TILE",), Launches())  # (and writes over it)
    assert json.loads(tuning.read_text()) == {device: {"test": {"d": {"forward": {"TILE": 32}}}}}


def test_a_value_within_the_margin_does_not_replace_the_kept_one(tuning, monkeypatch):
    """The clock's noise must not move a knob: a value is taken only when MARGIN faster than the one kept."""
    times = {64: 1.0, 16: 1.0 - _tuning.MARGIN / 2, 32: 1.0 - 2 * _tuning.MARGIN}
    monkeypatch.setattr(_tuning, "measure", lambda run, device: times[run()[0]])
    tuner = _tuner()
    tuner.tune("layer", CPU, "forward", ("TILE",), Launches())
    assert tuner.knobs("layer", CPU)["TILE"] == 32
    times[32] = 1.0 - _tuning.MARGIN / 2
    tuner.tune("other", CPU, "forward", ("TILE",), Launches())
    assert tuner.knobs("other", CPU)["TILE"] == 64


def test_a_value_that_fails_to_launch_is_passed_over_and_other_errors_raise(tuning):
    OutOfResources = type("OutOfResources", (Exception,), {})
    tuner = _tuner()
    tuner.tune("layer", CPU, "forward", ("TILE", "WARPS"), Launches(fail={"TILE": (32, OutOfResources("smem"))}))
    assert tuner.knobs("layer", CPU) == {**DEFAULTS, "TILE": 16, "WARPS": 4}  # (16 is COST's next best)
    with pytest.raises(ValueError, match="bad"):
        tuner.tune("other", CPU, "forward", ("TILE",), Launches(fail={"TILE": (16, ValueError("bad"))}))


def test_nothing_is_tuned_without_the_variable_under_a_tracer_deterministic_or_without_a_key(tuning, monkeypatch):
    tuner, launches = _tuner(), Launches()
    monkeypatch.setattr(_tuning, "traced", lambda: True)
    assert not tuner.tune("layer", CPU, "forward", ("TILE",), launches)
    monkeypatch.setattr(_tuning, "traced", lambda: False)
    assert not tuner.tune(None, CPU, "forward", ("TILE",), launches)
    torch.use_deterministic_algorithms(True)
    try:  # (the knobs set the order of some sums: chosen by the clock, the bits could change from run to run)
        assert not tuner.tune("layer", CPU, "forward", ("TILE",), launches)
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv(_tuning.AUTOTUNE_ENV, "0")
    assert not tuner.tune("layer", CPU, "forward", ("TILE",), launches)
    assert launches.calls == [] and not tuning.exists() and tuner.knobs("layer", CPU) == DEFAULTS


def _ssd_launch(batch=2, seqlen=40, nheads=4, headdim=8, ngroups=2, dstate=16, dtype=torch.float32, **optional):
    from ssmops.ops.ssd.triton import _Launch

    x = torch.randn(batch, seqlen, nheads, headdim, dtype=dtype)
    dt = torch.rand(batch, seqlen, nheads, dtype=dtype)
    B = torch.randn(batch, seqlen, ngroups, dstate, dtype=dtype)
    D, z = optional.get("D"), optional.get("z")
    return _Launch(x, dt, -torch.rand(nheads), B, B.clone(), D, z, None, None, None, None, 16, True, [])


def test_the_ssd_key_is_the_layer_not_the_batch_or_length():
    """A compiled graph keeps batch and seqlen dynamic: the knobs must not depend on them (a guard on each)."""
    pytest.importorskip("triton")
    key = _ssd_launch().key
    assert key == _ssd_launch(batch=3, seqlen=100).key
    assert "heads 4 groups 2 headdim 8 dstate 16 chunk 16 torch.float32" in key
    for other in (dict(nheads=8), dict(headdim=16), dict(ngroups=1), dict(dstate=32), dict(dtype=torch.bfloat16),
                  dict(D=torch.ones(4)), dict(z=torch.randn(2, 40, 4, 8))):
        assert _ssd_launch(**other).key != key, other
