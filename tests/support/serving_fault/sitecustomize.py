"""A fault in dpboard's pick, for the serving tests (tests/support/session_server.py puts this folder
on the server's PYTHONPATH): while the file ``DPBOARD_TEST_FAULT_FILE`` names exists, every pick of
dpboard's dispatch in the engine named by ``DPBOARD_TEST_FAULT_TARGET`` raises, as a bug in it would.

- ``vllm``: ``ClientDispatch.pick`` of dpboard's vLLM plugin (in vLLM's API servers);
- ``sglang``: the ``Dispatcher`` the SGLang plugin gives SGLang's DataParallelController.

Python imports ``sitecustomize`` at the start of every process of the server; the wrap is added
once the plugin's dispatch module has run (only the processes that dispatch import it)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

FAULT_FILE = os.environ.get("DPBOARD_TEST_FAULT_FILE")
TARGET = os.environ.get("DPBOARD_TEST_FAULT_TARGET", "vllm")
MODULES = {"vllm": "dpboard.integrations.vllm.dispatch", "sglang": "dpboard.integrations.sglang.dispatch"}


def _raise_while_the_file_exists(pick):
    def faulty(*args, **kwargs):
        if FAULT_FILE and os.path.exists(FAULT_FILE):
            raise RuntimeError("fault injected by the serving tests")
        return pick(*args, **kwargs)

    return faulty


def _wrap(module) -> None:
    if TARGET == "vllm":
        module.ClientDispatch.pick = _raise_while_the_file_exists(module.ClientDispatch.pick)
        return
    base = module.Dispatcher

    class FaultyDispatcher(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.dispatch = _raise_while_the_file_exists(self.dispatch)

    module.Dispatcher = FaultyDispatcher


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULES.get(TARGET):
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _wrap(module)

        loader.exec_module = exec_module
        return spec


if FAULT_FILE:
    sys.meta_path.insert(0, _Finder())
