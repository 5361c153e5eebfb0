# Two entry points: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
# Installed before the project so the range in pyproject.toml is already satisfied
# and pip never fetches a CUDA build on a CPU machine. Override: make TORCH=torch==2.14.1
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

# The reference TOPLOC (C++ extension) in a venv of its own, built from its sdist against the same
# torch, for the interoperability test (tests/test_proofs_interop.py skips without it).
TOPLOC ?= toploc==0.1.6
TOPLOC_VENV ?= .toploc-venv

.PHONY: demo test test-slow interop bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[ml,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/swarm-node demo $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

interop: $(STAMP) $(TOPLOC_VENV)/.installed
	TOPLOC_PYTHON=$(TOPLOC_VENV)/bin/python $(BIN)/python -m pytest -q -rs tests/test_proofs_interop.py $(PYTEST_ARGS)

$(TOPLOC_VENV)/.installed:
	$(PYTHON) -m venv $(TOPLOC_VENV)
	$(TOPLOC_VENV)/bin/python -m pip install -q --upgrade pip
	$(TOPLOC_VENV)/bin/python -m pip install -q $(TORCH) numpy setuptools wheel
	$(TOPLOC_VENV)/bin/python -m pip download -q --no-binary :all: --no-deps --no-build-isolation -d $(TOPLOC_VENV)/sdist $(TOPLOC)
	$(TOPLOC_VENV)/bin/python -m pip install -q --no-build-isolation $(TOPLOC_VENV)/sdist/*.tar.gz
	touch $@

clean:
	rm -rf $(VENV) $(TOPLOC_VENV) build *.egg-info
