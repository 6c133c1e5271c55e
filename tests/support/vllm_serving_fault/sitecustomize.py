"""A fault in dpboard's pick, for the serving tests (tests/support/vllm_serving.py puts this folder on
the server's PYTHONPATH): while the file ``DPBOARD_TEST_FAULT_FILE`` names exists, every pick of
dpboard's ``ClientDispatch`` raises, as a bug in it would. Python imports ``sitecustomize`` at the
start of every process of the server; the wrap is added once ``dispatch`` is imported (only API
servers import it), by wrapping the class as soon as its module has run."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

FAULT_FILE = os.environ.get("DPBOARD_TEST_FAULT_FILE")
TARGET = "dpboard.integrations.vllm.dispatch"


def _wrap(module) -> None:
    original = module.ClientDispatch.pick

    def pick(self, request):
        if FAULT_FILE and os.path.exists(FAULT_FILE):
            raise RuntimeError("fault injected by the serving tests")
        return original(self, request)

    module.ClientDispatch.pick = pick


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
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
