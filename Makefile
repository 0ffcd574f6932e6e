# One-command set-up: every target that needs Python depends on .venv/.installed,
# which creates the venv and installs the pinned CPU torch before everything else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: install test test-unit test-integration test-e2e test-fault test-deploy test-quick test-gpu gpu-check \
	serve loadtest soak lint format clean

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

# The whole suite, every kind (CI runs this; the gpu tests skip with their reason without CUDA).
test: install
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=25 tests

# One kind at a time, selected by the marker tests/conftest.py gives each test from its folder
# (docs/design.md §11); test-quick is everything but the slow tests (e2e, fault, deploy and the
# few marked slow).
PYTEST_KIND = OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests -m
test-unit: install
	$(PYTEST_KIND) unit
test-integration: install
	$(PYTEST_KIND) integration
test-e2e: install
	$(PYTEST_KIND) e2e
test-fault: install
	$(PYTEST_KIND) fault
test-deploy: install
	$(PYTEST_KIND) deploy
test-quick: install
	$(PYTEST_KIND) "not slow"

# The tests marked `gpu` (tests/gpu and any test marked so: CUDA kernels, the engine on GPUs);
# each skips with its reason where no CUDA device is visible, as it does in `make test`.
test-gpu: install
	$(BIN)/python -m pytest -q -m gpu -rs tests

# The one call to make when a GPU is lent: the gpu tests and the GPU benches that matter, each
# part in a child with its own time limit, results under benchmarks/ (tools/bench/gpu_check.py).
gpu-check: install
	$(BIN)/tpla bench gpu

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
