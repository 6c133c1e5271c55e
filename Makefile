# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_ARGS ?= --duration 20
# The SGLang release the plugin's tests import (the wheel alone, --no-deps: docs/INTEGRATIONS.md).
SGLANG_VERSION ?= 0.5.23
# The vLLM release the vLLM plugin's tests import (the wheel alone, --no-deps: docs/INTEGRATIONS.md).
VLLM_VERSION ?= 0.33.0

.PHONY: demo test lint bench clean-boards layout

# The C extensions are rebuilt when their sources or the generated layout header change.
$(VENV)/.installed: pyproject.toml $(wildcard dpboard/*/*.c) kernels/dpboard_layout.h
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps 'sglang==$(SGLANG_VERSION)'
	$(PY) -m pip install -q --no-deps 'vllm==$(VLLM_VERSION)'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/dpboard demo $(DEMO_ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/ruff check dpboard tests tools examples
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check dpboard tests tools examples

bench: $(VENV)/.installed
	$(VENV)/bin/dpboard bench all

clean-boards: $(VENV)/.installed
	$(VENV)/bin/dpboard clean

# After a change to the layout in dpboard/snapshot.py: regenerate the C header, rebuild the extension.
layout:
	$(PYTHON) tools/gen_layout.py
	$(MAKE) $(VENV)/.installed
