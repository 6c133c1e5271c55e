"""``register()``: the ``vllm.general_plugins`` entry point, which vLLM runs in every process it starts.

Two vLLM modules get dpboard's hooks, each when it is loaded and in whichever process loads it:

- ``vllm.v1.engine.core`` (the engine-core processes; engine_core.py): each engine core publishes
  its scheduler's load into its rank's slot, with the requests it took in.
- ``vllm.v1.engine.core_client`` (the API servers; dispatch.py), only while ``DPBOARD_METHOD`` is set:
  ``DPLBAsyncMPClient`` picks its engines through dpboard's Dispatcher.
- with ``DPBOARD_STEP_LOG``, ``vllm.v1.engine.core`` again (steps.py): each engine core records its
  scheduler's steps.

Each patch first looks up every name of vLLM's it uses, for the vLLM release that runs
(versions.py): an unsupported release, or a missing name, is said in one line and leaves vLLM's code
as it is, so vLLM starts and serves with its own pick.

It also lists ``DPBOARD_`` among the prefixes vLLM's Ray backend copies to its engine actors
(``settings.carry_to_ray``), so ``--data-parallel-backend ray`` engines get the board's settings.

vLLM runs the general plugins early in the API server (while it parses its engine arguments, before
``core_client`` is imported) and from ``EngineCore.__init__`` in an engine core (``core`` is loaded
then). So a module already loaded is patched at once, and one not yet loaded is patched as soon as
it is, by a finder on ``sys.meta_path`` that adds the patch after the module's own code runs; a
process that never loads it (a worker) is never touched and imports nothing more.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from dpboard.integrations.vllm import steps, versions
from dpboard.integrations.vllm.settings import ENV_PREFIX, carry_to_ray, dispatch_method
from dpboard.integrations.vllm.versions import Support

CORE = "vllm.v1.engine.core"
CORE_CLIENT = "vllm.v1.engine.core_client"


def patch_core(module: ModuleType, version: str, support: Support) -> None:
    from dpboard.integrations.vllm import engine_core

    cls = getattr(module, "EngineCoreProc", None)
    request_types = getattr(module, "EngineCoreRequestType", None)
    lacking = (["vllm.v1.engine.core.EngineCoreProc"] if cls is None else
               versions.missing(cls, support.engine_core, "EngineCoreProc"))
    if request_types is None or not hasattr(request_types, "ADD"):
        lacking.append("vllm.v1.engine.core.EngineCoreRequestType.ADD")
    if lacking:
        versions.step_aside(version, f"lacks {', '.join(lacking)}")
        return
    engine_core.patch(cls, request_types.ADD, support)
    if steps.wanted():  # DPBOARD_STEP_LOG: each engine core records its steps (steps.py)
        steps.patch(cls)


def patch_core_client(module: ModuleType, version: str, support: Support) -> None:
    from dpboard.integrations.vllm import dispatch

    cls = getattr(module, "DPLBAsyncMPClient", None)
    late_interaction = getattr(module, "get_late_interaction_engine_index", None)
    lacking = (["vllm.v1.engine.core_client.DPLBAsyncMPClient"] if cls is None else
               versions.missing(cls, support.client, "DPLBAsyncMPClient"))
    if late_interaction is None:
        lacking.append("vllm.v1.engine.core_client.get_late_interaction_engine_index")
    if lacking:
        versions.step_aside(version, f"lacks {', '.join(lacking)}")
        return
    dispatch.patch(cls, late_interaction, support, version)


def register(environ: Mapping[str, str] = os.environ) -> None:
    """Patch now what is loaded, and the rest when it loads (see the module's docstring). On a vLLM
    release the plugin does not support, say so once and patch nothing (versions.py)."""
    dispatch_method(environ)  # a bad DPBOARD_METHOD stops vLLM here, with its message, in every process
    steps.check(environ)  # so does a bad DPBOARD_STEP_LOG (steps.py)
    if not any(name.startswith(ENV_PREFIX) for name in environ):
        return  # the plugin is off: nothing to patch, nothing to say
    carry_to_ray()  # the settings reach engine cores started as Ray actors (settings.py)
    log_with_vllm()
    from dpboard.integrations.vllm.leaving import watch_from_launcher

    watch_from_launcher(environ)  # `vllm serve` itself removes, at exit, what its processes left (leaving.py)
    version, support = versions.current()
    if support is None:
        return
    targets: dict[str, Callable[[ModuleType, str, Support], None]] = {CORE: patch_core}
    if dispatch_method(environ) is not None:
        targets[CORE_CLIENT] = patch_core_client
    later = {}
    for name, patch in targets.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module, version, support)
        else:
            later[name] = functools.partial(patch, version=version, support=support)
    if later:
        _AfterImport.install(later)


def log_with_vllm() -> None:
    """dpboard's log lines go where vLLM's go: vLLM gives only its own logger handlers (and stops
    it propagating), so without them a dpboard warning inside ``vllm serve`` would be lost."""
    ours, theirs = logging.getLogger("dpboard"), logging.getLogger("vllm")
    for handler in theirs.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    if theirs.handlers and ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module's own code, the first time the module is imported."""

    _lock = threading.Lock()
    _installed: _AfterImport | None = None

    def __init__(self) -> None:
        self.pending: dict[str, Callable[[ModuleType], None]] = {}

    @classmethod
    def install(cls, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        with cls._lock:
            if cls._installed is None:
                cls._installed = cls()
                sys.meta_path.insert(0, cls._installed)
            cls._installed.pending.update(patches)

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = self.pending.pop(name, None)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)
