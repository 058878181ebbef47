# `make demo` and `make test` do all their own set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Torch is installed only when the venv has none; override e.g. TORCH_SPEC='torch>=2.10'.
TORCH_SPEC ?= torch==2.13.0
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: install demo test test-quick test-triton-interpreter bench-deps bench bench-cpu bench-ssd sanitize gpu-check clean

$(VENV)/.installed: pyproject.toml setup.py $(shell find ssmops/csrc -type f)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q "setuptools>=70" wheel numpy pytest hypothesis transformers "triton; platform_system == 'Linux'"
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) examples/demo.py

# The second run repeats the operator-level and deployment checks with the native
# library unloaded, so that `default` is what the dispatcher registers for CPU.
test: install
	$(PYTEST) --durations=15 tests
	SSMOPS_BACKEND=default $(PYTEST) tests/ops tests/test_compile_export.py -k "opcheck or compile or export or aoti"

# Every Triton case under the interpreter, the slow ones included (make test runs those not marked
# slow there; on a GPU, make gpu-check runs them all natively).
test-triton-interpreter: install
	TRITON_INTERPRET=1 $(PYTEST) -k triton tests/ops tests/test_properties.py tests/test_nonfinite.py tests/test_triton.py

# The quick subset: everything but the checks marked slow.
test-quick: install
	$(PYTEST) -m "not slow" tests

# The benchmarks time their peers as published, fetched at run time into build/peers
# (benchmarks/peers.py): mamba_ssm's sdist, whose code needs einops (installed here for that and
# nothing else), and mambapy, installed there with --no-deps (it needs only torch).
bench-deps: install
	$(PY) -m pip install -q einops

# The scan's `default` and native `cpu` backends against mamba_ssm's selective_scan_ref and mambapy's pscan.
bench: bench-deps
	$(PY) benchmarks/default.py

bench-cpu: bench-deps
	$(PY) benchmarks/cpu.py

# Mamba-2's SSD scan against mamba_ssm's own pure-PyTorch SSD.
bench-ssd: bench-deps
	$(PY) benchmarks/ssd.py

# On a GPU machine whose Python already has a CUDA (or ROCm) torch, Triton, pytest and
# hypothesis: build against that torch, then run the GPU tests and the GPU benchmark.
gpu-check:
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	$(PYTHON) -m pytest -q -p no:cacheprovider -rs tests/test_triton.py tests/ops/test_selective_scan.py \
		tests/ops/test_ssd.py tests/ops/test_state_update.py tests/test_nonfinite.py -k "triton or cuda"
	$(PYTHON) benchmarks/gpu.py --sweep

clean:
	rm -rf build ssmops/_C*.so *.egg-info $(VENV)

# The C++ library built with AddressSanitizer + UndefinedBehaviorSanitizer into
# build/sanitize, and the tests that reach it run there (Python itself is not
# instrumented, hence the preloaded runtime and no leak checking).
SANITIZE_ENV = LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
sanitize: install
	rm -rf build/sanitize build/sanitize-tmp
	SSMOPS_SANITIZE=1 MAX_JOBS=2 $(PY) setup.py -q build --build-base build/sanitize-tmp --build-lib build/sanitize
	cd build/sanitize && $(SANITIZE_ENV) ../../$(PY) -m pytest -q -p no:cacheprovider -x \
		../../tests/test_native.py ../../tests/test_hardening.py ../../tests/test_properties.py \
		-k "(cpu or test_native) and not million"
	cd build/sanitize && $(SANITIZE_ENV) ../../$(PY) -m pytest -q -p no:cacheprovider -x \
		../../tests/ops/test_linear.py ../../tests/ops/test_state_update.py ../../tests/ops/test_mamba_step.py \
		-k "cpu and not compile"
