"""Which SGLang releases the plugin supports, and the names of SGLang's it hooks or reads in each.

The plugin hooks functions and methods of SGLang's load-snapshot module, server arguments, scheduler
and DP controller through SGLang's ``HookRegistry``, and reads a few more names of theirs; a release
may rename, add or drop any of them. ``SUPPORTED`` lists, per release, every such name by module.
At the plugin's start (``register_hooks``) the release that runs is looked up, and the names of each
of those modules that the process has loaded (the load-snapshot module is loaded then: SGLang's
``HookRegistry`` would import it anyway). On a release not listed, or where one of its names is
missing, the plugin registers no hook: SGLang runs as without dpboard (its own load snapshots and
dispatch, no board), and the server's main process says so in one line, naming the version and the
releases the plugin supports, or what is missing (SGLang's other processes log it at DEBUG only, so
that a server says it once). It never keeps SGLang from starting.

What differs between the two supported releases (their wheels, sglang/srt/), for the plugin:

- 0.5.23 has a TCP peer allowlist (``SGLANG_ZMQ_ALLOWED_PEERS``, ``utils.network.restrict_zmq_peers``)
  that its load-snapshot reader applies to its PULL socket; the plugin's collector, which binds that
  socket in SGLang's stead, applies it too. 0.5.22 has neither the variable nor the function: its
  own socket binds without one, and so does the collector (``Support.peer_allowlist``).
- ``managers/data_parallel_controller.py`` (186 diff lines): 0.5.23 sends elastic-EP joiners a
  ``WorkerPortHandshake`` (the ports with the attention topology) where 0.5.22 sends the port list,
  sizes ``max_dp_size`` from ``elastic_ep.topology``, and merges its schedulers' start-up infos (HiCache
  layouts, ``get_init_info``); the peer allowlist on its joiners' PUSH sockets. The plugin hooks or
  reads none of that: the methods it hooks, their signatures, and what it reads of a controller
  (``workers``, ``status``, ``_active_workers``, ``port_args``, ``recv_from_tokenizer``,
  ``maybe_external_dp_rank_routing``) and of the module (``sock_send``, ``sock_recv``,
  ``get_parallel``, ``get_disagg``) are the same in both, as is ``event_loop``, whose receive the
  wave's timer wraps.
- ``managers/scheduler.py``: the intake handlers and ``publish_load_snapshot`` are the same;
  ``managers/load_snapshot.py`` differs only by the allowlist; the plugin framework
  (``plugins/__init__.py``, ``plugins/hook_registry.py``) and ``entrypoints/v1_loads.py`` are the same.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import multiprocessing
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("dpboard.sglang")

LOAD_SNAPSHOT = "sglang.srt.managers.load_snapshot"
SERVER_ARGS = "sglang.srt.server_args"
SCHEDULER = "sglang.srt.managers.scheduler"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller"
NETWORK = "sglang.srt.utils.network"


@dataclass(frozen=True)
class Support:
    """What the plugin uses of one SGLang release."""

    release: str  # "0.5.23"
    names: Mapping[str, tuple[str, ...]]  # module -> the (dotted) names in it the plugin hooks or reads
    peer_allowlist: bool  # utils.network.restrict_zmq_peers: the collector applies SGLANG_ZMQ_ALLOWED_PEERS


_DP_CONTROLLER_CLASS = tuple(f"DataParallelController.{name}" for name in (
    "__init__", "total_tokens_scheduler", "total_requests_scheduler", "refresh_load_budget", "update_active_ranks",
    "_refresh_active_workers", "send_to_all_workers", "send_control_message", "maybe_external_dp_rank_routing",
    "event_loop"))
_NAMES: dict[str, tuple[str, ...]] = {
    LOAD_SNAPSHOT: ("create_load_snapshot_writer", "create_load_snapshot_reader", "LoadSnapshot", "should_use_zmq",
                    "zmq_reader_owner", "_zmq_addr_for", "get_parallel"),
    SERVER_ARGS: ("PortArgs.init_new",),
    SCHEDULER: ("Scheduler.handle_generate_request", "Scheduler.handle_embedding_request"),
    DP_CONTROLLER: (*_DP_CONTROLLER_CLASS, "sock_send", "sock_recv", "get_parallel", "get_disagg"),
}
SUPPORTED: dict[str, Support] = {
    "0.5.22": Support("0.5.22", _NAMES, peer_allowlist=False),
    "0.5.23": Support("0.5.23", {**_NAMES, NETWORK: ("restrict_zmq_peers",)}, peer_allowlist=True),
}
# a release, or a post release or local build of it; a pre-release or dev build is not the release
_RELEASE = re.compile(r"^\s*(\d+\.\d+\.\d+)(?:\.post\d+)?(?:\+[\w.]+)?\s*$")
_said: set[str] = set()  # what this process has already said (one line each)


def sglang_version() -> str:
    """The version of the SGLang this process runs: its package's own (``sglang.version``), else its
    distribution's; "unknown" without either."""
    try:
        return str(importlib.import_module("sglang.version").__version__)
    except Exception:  # noqa: BLE001 - any failure here means: ask the distribution
        pass
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def support_for(version: str) -> Support | None:
    """The supported release ``version`` is (``0.5.23``, ``0.5.23.post1``, ``0.5.23+cpu``), or None."""
    match = _RELEASE.match(version)
    return None if match is None else SUPPORTED.get(match[1])


def missing(names: Mapping[str, tuple[str, ...]], modules: Mapping[str, Any] = sys.modules) -> list[str]:
    """``module.name`` for each of ``names`` (dotted, by module) that a loaded module lacks."""
    lacking = []
    for module_name, dotted in names.items():
        module = modules.get(module_name)
        if module is None:
            continue
        for name in dotted:
            owner: Any = module
            for part in name.split("."):
                owner = getattr(owner, part, None)
                if owner is None:
                    lacking.append(f"{module_name}.{name}")
                    break
    return lacking


def step_aside(version: str, what: str) -> None:
    """The one line a server says when the plugin leaves SGLang unhooked: its main process at WARNING
    (once per distinct ``what``), SGLang's other processes (each runs the plugin too) at DEBUG."""
    if what in _said:
        return
    _said.add(what)
    level = logging.WARNING if multiprocessing.parent_process() is None else logging.DEBUG
    supported = ", ".join(SUPPORTED)
    logger.log(level, "dpboard: SGLang %s %s: the dpboard plugin steps aside (SGLang's own load snapshots and "
               "dispatch, no board); it supports SGLang %s", version, what, supported)


@functools.cache
def current() -> tuple[str, Support | None]:
    """This process's SGLang version and its release's names (None when the plugin does not know it)."""
    version = sglang_version()
    return version, support_for(version)


def check() -> Support | None:
    """At the plugin's start: this release's names, each loaded module's checked (the load-snapshot
    module is imported for it); None, said in one line, when the plugin must step aside."""
    version, support = current()
    if support is None:
        step_aside(version, "is not a release this plugin knows")
        return None
    importlib.import_module(LOAD_SNAPSHOT)
    lacking = missing(support.names)
    if lacking:
        step_aside(version, f"lacks {', '.join(lacking)}")
        return None
    return support
