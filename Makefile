# `make demo` and `make test` do all their own set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Torch is installed only when the venv has none; override e.g. TORCH_SPEC='torch>=2.10'.
TORCH_SPEC ?= torch==2.13.0
# pip without byte-compiling every module it installs (torch's alone takes 20 s of a 30-s install on
# 2 cores): Python compiles the modules that are imported, once, when they are first imported, and
# keeps them; so a PYTHONDONTWRITEBYTECODE=1 from the environment (as Docker images set it) is not passed
# on, else every process of the tests and the demo would compile torch's modules again (~5 s each).
PIP_INSTALL := $(PY) -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
# pytest-xdist's workers for make test and test-quick: the 2 cores of CI's machine, both used; tests
# handed out two at a time, the slow ones first (tests/conftest.py orders them), so both finish together;
# each worker runs on its share of the cores (conftest's pytest_configure sets the threads)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --maxschedchunk 2

.PHONY: install install-test demo test test-quick test-triton-interpreter test-gpu-torch bench-deps bench bench-cpu \
	bench-ssd sanitize gpu-check gpu-wheels clean

# A venv with torch, numpy, and setuptools and wheel for the C++ library's build.
$(VENV)/.base:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PIP_INSTALL) "setuptools>=70" wheel numpy
	touch $@

# The package with its C++ library (all `make demo` installs).
$(VENV)/.installed: pyproject.toml setup.py $(shell find ssmops/csrc -type f) | $(VENV)/.base
	$(PIP_INSTALL) --no-build-isolation --no-deps -e .
	touch $@

# What the tests need besides (pyproject's `test` extra).
$(VENV)/.test-installed: | $(VENV)/.base
	$(PIP_INSTALL) pytest pytest-xdist hypothesis transformers "triton; platform_system == 'Linux'" onnx onnxscript onnxruntime
	touch $@

install: $(VENV)/.installed

# The test packages install while the C++ library compiles (a minute each from a fresh clone).
install-test: $(VENV)/.base
	$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(VENV)/.test-installed

demo: install
	$(PY) examples/demo.py

# (tests/test_registry.py repeats the operator-level and deployment checks in a process of its own with
# the native library unloaded, so that `default` is what the dispatcher registers for CPU.)
test: install-test
	$(PYTEST) $(XDIST) --durations=15 tests

# Every Triton case under the interpreter, the slow ones included (make test runs those not marked
# slow there; on a GPU, make gpu-check runs them all natively).
test-triton-interpreter: install-test
	TRITON_INTERPRET=1 $(PYTEST) -k triton tests/ops tests/test_properties.py tests/test_nonfinite.py tests/test_triton.py

# The quick subset: everything but the checks marked slow.
test-quick: install-test
	$(PYTEST) $(XDIST) -m "not slow" tests

# The benchmarks time their peers as published, fetched at run time into build/peers
# (benchmarks/peers.py): mamba_ssm's sdist, whose code needs einops (installed here for that and
# nothing else), and mambapy, installed there with --no-deps (it needs only torch).
bench-deps: install-test
	$(PIP_INSTALL) einops
	$(PY) -c "import sys; sys.path.insert(0, 'benchmarks'); import peers; peers.mamba_ssm_source()"

# The scan's `default` and native `cpu` backends against mamba_ssm's selective_scan_ref and mambapy's pscan.
bench: bench-deps
	$(PY) benchmarks/default.py

bench-cpu: bench-deps
	$(PY) benchmarks/cpu.py

# Mamba-2's SSD scan against mamba_ssm's own pure-PyTorch SSD.
bench-ssd: bench-deps
	$(PY) benchmarks/ssd.py

# On a GPU machine whose Python already has a CUDA (or ROCm) torch, Triton, pytest, pytest-xdist and
# hypothesis, offline: the CUDA suite on several workers, then benchmarks/gpu.py against mamba_ssm's
# Triton kernels (its sdist fetched beforehand into build/peers by `make bench-deps`), and a report in
# build/gpu-check/report.md (benchmarks/gpu_check.py; docs/deployment.md says how to carry what it needs).
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py

# transformers and what it imports, as wheels for the GPU machine's Python (GPU_PYTHON), into
# build/gpu-wheels: gpu-check installs them for its tests where that machine's transformers is older
# than the integration's. The versions this venv runs the same tests with; numpy and torch are the
# GPU machine's own.
GPU_PYTHON ?= 3.12
GPU_WHEELS := transformers==5.24.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
	regex==2026.11.19 tqdm==4.70.1 filelock==4.3.1 fsspec==2026.9.0 hf-xet==1.8.0 httpx2==2.16.2 \
	httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 idna==3.20 typing_extensions==4.16.0 packaging==26.4 \
	pyyaml==6.0.4 typer==0.29.2 click==8.5.1 shellingham==1.5.4 annotated-doc==0.0.7 truststore==0.10.5
gpu-wheels: install
	$(PY) -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version $(GPU_PYTHON) \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d build/gpu-wheels $(GPU_WHEELS)

# The whole suite on the GPU machines' torch and Triton (GPU_TORCH_SPEC: PyPI's CUDA build, several GB with
# its CUDA libraries, which runs on the CPU without a GPU), in a venv of its own, with the C++ library built
# in $(VENV) against the default torch (it loads unchanged, as on the GPU machines). What fails only there
# fails here first: torch 2.11's export guards on Bamba's attention and the gated norm (docs/limits.md).
GPU_TORCH_VENV ?= .venv-gpu-torch
GPU_TORCH_SPEC ?= torch==2.11.0
test-gpu-torch: install
	test -x $(GPU_TORCH_VENV)/bin/python || $(PYTHON) -m venv $(GPU_TORCH_VENV)
	$(GPU_TORCH_VENV)/bin/python -m pip install -q --no-compile "$(GPU_TORCH_SPEC)" numpy pytest pytest-xdist \
		hypothesis transformers==5.24.0 onnx onnxscript onnxruntime
	PYTHONPATH=$(CURDIR) $(GPU_TORCH_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		$(XDIST) tests

clean:
	rm -rf build ssmops/_C*.so *.egg-info $(VENV) $(GPU_TORCH_VENV)

# The C++ library built with AddressSanitizer + UndefinedBehaviorSanitizer into
# build/sanitize, and the tests that reach it run there (Python itself is not
# instrumented, hence the preloaded runtime and no leak checking).
SANITIZE_ENV = LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
sanitize: install-test
	rm -rf build/sanitize build/sanitize-tmp
	SSMOPS_SANITIZE=1 MAX_JOBS=2 $(PY) setup.py -q build --build-base build/sanitize-tmp --build-lib build/sanitize
	cd build/sanitize && $(SANITIZE_ENV) ../../$(PY) -m pytest -q -p no:cacheprovider -x \
		../../tests/test_native.py ../../tests/test_hardening.py ../../tests/test_properties.py ../../tests/test_nonfinite.py \
		-k "(cpu or test_native) and not million"
	cd build/sanitize && $(SANITIZE_ENV) ../../$(PY) -m pytest -q -p no:cacheprovider -x \
		../../tests/ops/test_linear.py ../../tests/ops/test_state_update.py ../../tests/ops/test_mamba_step.py \
		../../tests/ops/test_causal_conv1d.py -k "cpu and not compile and not export"
