"""A pytest plugin for benchmarks/gpu_check.py: one JSON line per test outcome, written as it happens.

pytest writes its junit file and its failure tracebacks only when the session ends; a suite stopped at
gpu_check's time limit would otherwise leave nothing but progress dots. Loaded with
`-p gpu_check_results`; the file is $GPU_CHECK_RESULTS."""

from __future__ import annotations

import json
import os

_path = None


def pytest_configure(config) -> None:
    global _path
    # under pytest-xdist the workers' reports reach the controller too: only it writes
    _path = None if hasattr(config, "workerinput") else os.environ.get("GPU_CHECK_RESULTS")


def pytest_runtest_logreport(report) -> None:
    if not _path or (report.when != "call" and report.passed):
        return
    outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    if outcome == "failed" and report.when != "call":
        outcome = "errors"
    text = ""
    if report.failed:
        text = report.longreprtext[-3000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]
    elif hasattr(report, "wasxfail"):  # the reason, and what the test raised (the next run's lead)
        text = f"{report.wasxfail}\n{report.longreprtext[-3000:]}"
    with open(_path, "a") as out:
        out.write(json.dumps({"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 2),
                              "text": text}) + "\n")
