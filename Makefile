# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv if missing, install, run the guided demo
#   make test   - create .venv if missing, install, run the test suite
# torch is pinned and installed first: an unpinned torch would pull gigabytes of CUDA packages.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fourfold-installed
TORCH  ?= torch==2.13.0
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing $(TORCH) (CPU build), then fourfold[dev,viz,hf] into $(VENV) ..."
	@$(PIP) "$(TORCH)" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import torch" || { echo "torch failed to install"; exit 1; }
	@$(PIP) -e ".[dev,viz,hf]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import fourfold, pytest, matplotlib, transformers" || { echo "fourfold failed to install"; exit 1; }
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fourfold demo

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

clean:
	rm -rf runs .pytest_cache
