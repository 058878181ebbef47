# `make demo` and `make test` do all their own set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Torch is installed only when the venv has none; override e.g. TORCH_SPEC='torch>=2.10'.
TORCH_SPEC ?= torch==2.13.0
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: install demo test test-quick bench clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard ssmops/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q "setuptools>=70" wheel numpy pytest hypothesis
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) examples/demo.py

test: install
	$(PYTEST) tests

# The quick subset: everything but the checks marked slow.
test-quick: install
	$(PYTEST) -m "not slow" tests

bench: install
	$(PY) benchmarks/default.py

clean:
	rm -rf build ssmops/_C*.so *.egg-info $(VENV)
