# Set-up is idempotent: .venv is created once (with system site packages, so a
# machine's installed torch, e.g. a CUDA build, is reused) and refreshed when
# pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: install train test test-fast clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev,hf]'
	touch $@

install: $(VENV)/.installed

train: install
	$(VENV)/bin/mct train $(ARGS)

# one pytest worker per core (pytest-xdist); each worker's torch uses one thread; long modules first,
# tests sharing a module fixture on one worker (tests/conftest.py, --dist loadgroup)
test: install
	$(PY) -m pytest -q -n auto --dist loadgroup $(PYTEST_ARGS)

# the inner loop: everything but the multi-rank (spawned gloo ranks) and CLI end-to-end tests
test-fast: install
	$(PY) -m pytest -q -n auto --dist loadgroup -m "not multirank and not cli and not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
