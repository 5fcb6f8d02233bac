# Two commands on a fresh machine: `make bench` (the main job) and `make test` (the suite).
# Both create .venv when it is missing and install the package with its pinned dev dependencies.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The stamp also tells tests/test_bench_contenders.py that the peers extra was meant to be here.
STAMP := $(VENV)/.nostall-installed
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: bench test test-perf test-frameworks test-cuda bench-cuda gpu-check gpu-triage lint typecheck check clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned, so that nothing later can pull a newer (CUDA, multi-GB) build.
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,peers,plot,frameworks,bench]'
	touch $(STAMP)

bench: $(STAMP)
	mkdir -p out
	$(VENV)/bin/nostall bench --json out/bench.json --plot out/bench.png

# Two pytest-xdist workers, a test file each at a time (a module's fixtures are made once), the
# longest files handed out first (tests/conftest.py's SLOWEST_FIRST, in collection order).
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# Timing claims, on a quiet machine.
test-perf: $(STAMP)
	$(PY) -m pytest -m perf

# Every scenario inside the frameworks (make test runs one small run of each).
test-frameworks: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -m frameworks

# On a machine with a GPU (the simulated-CUDA tests run in `make test` everywhere).
test-cuda: $(STAMP)
	$(PY) -m pytest -m cuda

bench-cuda: $(STAMP)
	mkdir -p out
	$(VENV)/bin/nostall bench --device cuda --json out/bench-cuda.json --plot out/bench-cuda.png
	$(PY) benchmarks/h2d.py
	$(PY) benchmarks/gpu_transforms.py --device cuda

# The first thing to run on a GPU machine (offline, torch there; py-spy used when installed):
# where each batch's time goes, in a few minutes, figures in GPU_TRIAGE_OUT. Without a GPU it
# runs the CPU parts (the hand-off on the CPU, the GIL convoy) and exits 0; where PYTHON has
# no torch, the project's virtual environment is made and used.
GPU_TRIAGE_OUT ?= out/gpu-triage
gpu-triage:
	@if $(PYTHON) -c 'import torch' 2>/dev/null; then py=$(PYTHON); \
	else $(MAKE) --no-print-directory $(STAMP) && py=$(PY); fi; \
	echo "PYTHONPATH=src $$py benchmarks/gpu_triage.py --out $(GPU_TRIAGE_OUT)"; \
	PYTHONPATH=src $$py benchmarks/gpu_triage.py --out $(GPU_TRIAGE_OUT)

# On a GPU machine as it is (offline, torch already installed): no venv made, nothing installed.
# The CUDA tests, the simulated suite, the GPU benchmarks and the suite, figures in GPU_CHECK_OUT;
# without a GPU it runs what it can and skips the rest.
GPU_CHECK_OUT ?= out/gpu-check
gpu-check:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck test

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
