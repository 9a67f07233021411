# Set-up and the two everyday commands. `make quickstart` and `make test` create .venv on first use:
# a virtual environment that reuses an installed torch (GPU users keep theirs) and otherwise
# installs torch 2.13.0 (the build pip picks: on Linux x86-64 from PyPI, the CUDA one), then installs tango-lm with its test, eval, hf, triton, gdn, serve,
# tensorboard, wandb and cluster extras (so every optional feature's tests run).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup quickstart test test-gpu-versions bench lint gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install torch==2.13.0 || $(BIN)/python -m pip install torch
	$(BIN)/python -m pip install -e '.[test,eval,hf,triton,gdn,serve,tensorboard,wandb,cluster]'
	touch $@

quickstart: setup
	$(BIN)/tango-lm quickstart

# One pytest-xdist worker per logical core, at most 4 (each holds torch and a compile cache in memory); a
# test file's tests stay in one worker, in order, so module fixtures run once.
test: setup
	$(BIN)/python -m pytest -n logical --maxprocesses 4 --dist loadfile

# The same tests under the GPU machine's torch 2.11 and triton 3.6, on this CPU, in .venv-gpu-versions
# (tools/test_gpu_versions.sh; about 3 GB: torch's CUDA build from PyPI).
test-gpu-versions:
	tools/test_gpu_versions.sh

bench: setup
	$(BIN)/tango-lm bench

# On a machine with a CUDA GPU (no network needed, no install: it runs the sources with PYTHONPATH=src).
gpu-check:
	bash tools/gpu_check.sh

lint: setup
	$(BIN)/ruff check src tests tools
	$(BIN)/ruff format --check src tests tools

clean:
	rm -rf $(VENV) .venv-gpu-versions .venv-torch-* runs
