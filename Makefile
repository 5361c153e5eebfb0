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

.PHONY: demo test test-slow bench venv clean

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

clean:
	rm -rf $(VENV) build *.egg-info
