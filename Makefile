# One-command set-up: every target that needs Python depends on .venv/.installed,
# which creates the venv and installs the pinned CPU torch before everything else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: install test test-gpu serve loadtest soak lint format clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml $(wildcard proto/*.proto) $(wildcard common/native/*.cpp common/native/*.h) | $(BIN)/python
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python proto/build.py
	$(BIN)/python -m common.native.library
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

# The tests marked `gpu` (CUDA kernels, the engine on GPUs); each skips with its reason
# where no CUDA device is visible, as it does in `make test`.
test-gpu: install
	$(BIN)/python -m pytest -q -m gpu -rs tests

# The whole stack on the embedded defaults: demo model, embedded Redis, CPU, decode tp=2 r=2.
serve: install
	OMP_NUM_THREADS=1 $(BIN)/tpla serve

# Locust headless against LOADTEST_HOST; starts `tpla serve` first if nothing answers /ready there.
# Reports in loadtest/results/. e.g. make loadtest LOADTEST_ARGS="--users 16 --run-time 5m"
LOADTEST_HOST ?= http://127.0.0.1:8000
LOADTEST_ARGS ?=
loadtest: install
	OMP_NUM_THREADS=1 $(BIN)/python loadtest/run.py --host $(LOADTEST_HOST) $(LOADTEST_ARGS)

# 10 minutes of mixed load with a kill -9 every minute; report in benchmarks/soak.{md,json}.
SOAK_ARGS ?=
soak: install
	OMP_NUM_THREADS=1 $(BIN)/python loadtest/soak.py $(SOAK_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
