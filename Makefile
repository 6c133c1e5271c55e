# The commands of the README: `make demo`, `make test` and `make test-all`. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_ARGS ?= --duration 20
# Engines whose real modules the integration tests import. Each is its wheel alone (--no-deps), put
# in a folder of its own outside the venv's site-packages: pip never sees it, so its resolver and
# `pip check` do not report the engine's own (uninstalled) dependencies. tests/conftest.py puts
# the folder on sys.path and PYTHONPATH. Another engine is one more entry of ENGINE_WHEELS.
SGLANG_VERSION ?= 0.5.23
# The vLLM release the vLLM plugin's tests import (the wheel alone, --no-deps: docs/INTEGRATIONS.md).
VLLM_VERSION ?= 0.33.0
ENGINE_WHEELS ?= sglang==$(SGLANG_VERSION) vllm==$(VLLM_VERSION)
ENGINE_DIR := $(VENV)/engines
# The C extensions are rebuilt when their sources or the generated layout header change.
SOURCES := pyproject.toml setup.py $(wildcard dpboard/*/*.c) kernels/dpboard_layout.h

# pytest-xdist workers for `make test` and `make test-all` (auto: one per core), each taking whole
# files: a file's tests share its module fixtures, and tests/board/test_board.py's machine-wide
# `dpboard clean` never sweeps the dead boards another of its tests holds on purpose. Files go in
# the order tests/conftest.py collects them (the engines' long sessions first), not largest first.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: demo test test-all test-under-load lint bench clean-boards layout wheel

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# `make demo`: dpboard and its runtime dependencies only.
$(VENV)/.demo: $(SOURCES) | $(VENV)/bin/python
	$(PY) -m pip install -q -e .
	touch $@

# `make test`: dpboard with the [test] extra, then the engines' wheels (a separate step).
$(VENV)/.installed: $(SOURCES) $(VENV)/.engines | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[test]'
	touch $(VENV)/.demo $@

$(VENV)/.engines: Makefile | $(VENV)/bin/python
	rm -rf $(ENGINE_DIR)
	$(PY) -m pip install -q --no-deps --target $(ENGINE_DIR) $(ENGINE_WHEELS)
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/dpboard demo $(DEMO_ARGS)

# `make test`: every module, in minutes; the tests that need minutes by nature (marked `slow`: the
# soak, the sixteen-server vLLM session, `bench all`) and the real-serving suite (`serving`) wait for
# `make test-all`, which CI (.ci/run) runs.
test: $(VENV)/.installed
	$(VENV)/bin/ruff check dpboard tests tools examples
	$(PYTEST) -m "not slow and not serving"

test-all: $(VENV)/.installed
	$(VENV)/bin/ruff check dpboard tests tools examples
	$(PYTEST) -m "not serving"
	$(MAKE) test-serving

# `make test` while busy processes keep every core loaded (tools/cpu_hog.py): a test that waits for
# a fixed time instead of for what it needs shows here.
test-under-load: $(VENV)/.installed
	$(PY) tools/cpu_hog.py -- $(PYTEST) -m "not slow and not serving"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check dpboard tests tools examples

bench: $(VENV)/.installed
	PYTHONPATH=$(ENGINE_DIR) $(VENV)/bin/dpboard bench all

clean-boards: $(VENV)/.demo
	$(VENV)/bin/dpboard clean

# After a change to the layout in dpboard/snapshot.py: regenerate the C header, rebuild the extension.
layout:
	$(PYTHON) tools/gen_layout.py
	$(MAKE) $(VENV)/.installed

# A wheel in dist/ to install elsewhere: pip install dist/dpboard-*.whl (README, "Installing").
wheel: $(VENV)/bin/python
	$(PY) -m pip wheel -q --no-deps -w dist .
