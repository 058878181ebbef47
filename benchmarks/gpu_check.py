"""`make gpu-check`: everything a GPU machine should prove, in one call, with a short report.

    python benchmarks/gpu_check.py [--report-dir build/gpu-check] [--workers 8]

On a machine with a CUDA (or ROCm) torch, Triton, pytest, pytest-xdist and hypothesis, and no network:
1. reuses the C++ library in ssmops/ (built on any machine: it is on the stable ABI) or builds it;
2. runs the CUDA suite on several workers: every family's grid on CUDA (triton and default), the
   property tests (drawn problems, non-finite inputs), the GPU tests of tests/test_triton.py, the
   training and export tests of tests/test_gpu_training.py, and transformers' models on ssmops;
3. runs benchmarks/gpu.py (ssmops against mamba_ssm's Triton kernels, timed as published from the
   sdist in build/peers, which `make bench-deps` fetches on a machine with the package index; the conv;
   generate at the 130m shapes; `gpu.py --sweep` and `--autotune` are for a lease of their own);
4. writes report.md (the machine, pass/fail/skip counts, each failure's last lines, the skip reasons,
   the benchmark table) beside the pytest log, results.jsonl (each outcome as it happened:
   gpu_check_results.py) and the benchmark's output.
Exits non-zero when a test failed or the suite did not finish. Sized to finish inside one 10-minute call on
a 16-core H100 or H200 machine (--test-seconds and --bench-seconds bound each part: 300 + 240 s).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the tests that run on a GPU: every family's module (tests/ops), then the cross-cutting ones; the selection keeps
# their CUDA and Triton cases (the CPU ones run in CI)
GPU_TESTS = [*sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "ops").glob("test_*.py")),
             "tests/test_nonfinite.py", "tests/test_properties.py", "tests/test_triton.py",
             "tests/test_gpu_training.py", "tests/test_transformers.py", "tests/test_compat.py",
             "tests/test_decoding.py"]
SELECTION = "(cuda or triton or gpu) and not interpreter_suite and not without_spilling"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report-dir", type=Path, default=REPO / "build" / "gpu-check")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--test-seconds", type=int, default=300)
    p.add_argument("--bench-seconds", type=int, default=240,
                   help="(an H200 took ~130 s to compile the scans' and one SSD shape's kernels from cold; mamba_ssm "
                        "autotunes at each SSD shape)")
    p.add_argument("--select", default=SELECTION, help="pytest's -k over the GPU tests, e.g. to rerun what failed")
    p.add_argument("--no-bench", action="store_true", help="the tests only")
    return p.parse_args(argv)


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    triton = importlib.util.find_spec("triton") and __import__("triton").__version__
    return (f"{gpu}; {os.cpu_count()} CPU cores; Python {platform.python_version()}, torch {torch.__version__}, "
            f"Triton {triton}")


def ensure_library() -> str:
    """'reused' when ssmops/_C*.so is there, else builds it in place."""
    if any((REPO / "ssmops").glob("_C*.so")):
        return "reused"
    env = {**os.environ, "MAX_JOBS": str(os.cpu_count() or 1)}
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=REPO, env=env, check=True)
    return "built"


def install_wheels(report_dir: Path) -> str | None:
    """The wheels `make gpu-wheels` put in build/gpu-wheels (transformers and what it imports, for this
    machine's Python), installed into a temporary folder for the tests (first on their path; not the report
    folder, which a lease brings back whole), so that tests/test_transformers.py runs where this machine's
    transformers is older; None where there are none or they do not install here (wheels for another Python:
    the tests then use the machine's own)."""
    wheels = sorted(str(w) for w in (REPO / "build" / "gpu-wheels").glob("*.whl"))
    if not wheels:
        return None
    target = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "site-packages"
    with (report_dir / "pip.log").open("w") as log:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--upgrade",
                               "--target", str(target), *wheels], stdout=log, stderr=subprocess.STDOUT)
    return str(target) if done.returncode == 0 else None


def run_tests(args, log: Path, results: Path, site: str | None) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check_results", "-rfEs",
           "--tb=short", "--durations=25", "-m", "slow or not slow", "-k", args.select, *GPU_TESTS]
    if importlib.util.find_spec("xdist") is not None and args.workers > 1:
        cmd += ["-n", str(args.workers)]
    results.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPU_CHECK_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "benchmarks"), site, os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    with log.open("w") as out:
        try:
            return subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.test_seconds).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n[gpu_check] the suite did not finish in {args.test_seconds} s\n")
            return 124


def summarize(results: Path) -> tuple[collections.Counter, list[str], collections.Counter]:
    """Counts by outcome, each failure's (and expected failure's) name and last lines, and the skip reasons
    with their counts, from what gpu_check_results.py wrote as the tests ended (so a suite stopped at its
    limit still reports)."""
    counts, failures, skips = collections.Counter(), [], collections.Counter()
    if not results.exists():
        return counts, failures, skips
    for line in results.read_text().splitlines():
        result = json.loads(line)
        counts[result["outcome"]] += 1
        if result["outcome"] in ("failed", "errors", "xfailed"):
            lines = [text.strip() for text in result["text"].strip().splitlines() if text.strip()][-6:]
            expected = "(expected to fail) " if result["outcome"] == "xfailed" else ""
            failures.append(f"{expected}{result['test']} ({result['seconds']} s): " + " | ".join(lines)[-900:])
        elif result["outcome"] == "skipped":
            skips[result["text"].split("\n")[0][:160]] += 1
    return counts, failures, skips


def run_benchmark(args, log: Path) -> int:
    cmd = [sys.executable, "benchmarks/gpu.py", "--skip-baselines", "--repeats", "10", "--lm-shapes", "130m"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # so that a timed-out run still leaves its finished tables
    env.pop("TRITON_INTERPRET", None)
    with log.open("w") as out:
        try:
            return subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.bench_seconds).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n[gpu_check] the benchmark did not finish in {args.bench_seconds} s\n")
            return 124


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("make gpu-check needs a CUDA (or ROCm) device; none is available here.", file=sys.stderr)
        return 2
    args.report_dir.mkdir(parents=True, exist_ok=True)
    library = ensure_library()
    tests_log, results, bench_log = (args.report_dir / name for name in ("pytest.log", "results.jsonl",
                                                                         "benchmark.log"))
    site = install_wheels(args.report_dir)
    tests_rc = run_tests(args, tests_log, results, site)
    counts, failures, skips = summarize(results)
    wheels = f"build/gpu-wheels, installed in {site}" if site else "this machine's own (pip.log says why)"
    report = [f"# make gpu-check\n\nMachine: {machine()}. C++ library: {library}. transformers: {wheels}.\n",
              f"## Tests ({' '.join(GPU_TESTS)}, -k '{args.select}', {args.workers} workers)\n",
              ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "errors", "skipped", "xfailed")) +
              ("" if tests_rc != 124 else f"; the suite did not finish in {args.test_seconds} s") + "\n"]
    report += ["### Failures\n", *(f"- {line}" for line in failures), ""] if failures else []
    report += ["### Skip reasons\n", *(f"- {n} x {reason}" for reason, n in skips.most_common()), ""]
    (args.report_dir / "report.md").write_text("\n".join(report) + "\n")  # written before the benchmark runs
    if not args.no_bench:
        bench_rc = run_benchmark(args, bench_log)
        report += [f"## benchmarks/gpu.py --skip-baselines (exit {bench_rc})\n", "```",
                   bench_log.read_text().strip(), "```"]
        (args.report_dir / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 0 if tests_rc == 0 and counts["failed"] == counts["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
