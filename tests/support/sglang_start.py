"""An SGLang process's start with the plugin installed, for the version tests
(``python -m tests.support.sglang_start [--claim VERSION] [--child]``).

It runs what SGLang's main process runs first (``sglang/launch_server.py``: ``load_plugins()``), on
the SGLang wheel found first on the path (tests/support/sglang.py, the DP controller's module loaded
as in SGLang's DP controller, so that every hook the plugin has would be registered: DPBOARD_METHOD
is set to a holding method), then SGLang's load path as a scheduler and the DP controller use it:
the writer from SGLang's factory publishes a snapshot, the reader from the factory the controller
imported reads it back. ``--claim VERSION`` puts a stand-in for ``sglang._version`` (the one file
of SGLang that says its version) reporting VERSION; every other module is the wheel's. ``--child``
also runs the same start in a child process made by multiprocessing's spawn, as SGLang starts its
schedulers, which the plugin runs in too.

It prints one JSON line on stdout: the targets SGLang's HookRegistry had hooks registered for and
patched, whether the two factories are SGLang's own, and the writer's and reader's classes. What the
plugin says goes to stderr (logging is not configured yet at that point of SGLang's start).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import types
import uuid


def start(claim: str | None) -> dict:
    from tests.support import sglang as sgl

    sgl.install()
    if claim is not None:
        module = types.ModuleType("sglang._version")
        module.__version__ = module.version = claim
        module.__version_tuple__ = module.version_tuple = tuple(claim.split("."))
        sys.modules["sglang._version"] = module
    import sglang.srt.managers.data_parallel_controller as dpc  # as in SGLang's DP controller
    import sglang.srt.managers.load_snapshot as ls
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    os.environ.update(SGLANG_PLUGINS="dpboard", DPBOARD_METHOD="inflight_wave")
    plugins.load_plugins()
    sgl.set_context(dp_size=2)
    instance = f"dpbtest{uuid.uuid4().hex[:8]}"
    port_args = sgl.PortArgs(instance_id=instance)
    writer = ls.create_load_snapshot_writer(port_args, 2, 1)
    try:
        writer.write(sgl.full_snapshot(1))
        reader = dpc.create_load_snapshot_reader(port_args, "DataParallelController")
        try:
            read = reader.read(1)
        finally:
            reader.close()
    finally:
        writer.close()
        if os.path.exists(ls.shm_path_for(instance)):  # SGLang's own file, where its writer made it
            os.unlink(ls.shm_path_for(instance))
        if "dpboard.integrations.sglang.transport" in sys.modules:  # the board, where the plugin's made it
            from dpboard.integrations.sglang import transport

            for board in transport._boards.values():
                board.close()
                if board.is_owner:
                    board.unlink()
    return {
        "registered": sorted(HookRegistry._hooks), "patched": sorted(HookRegistry._patched),
        "own_factories": (not hasattr(ls.create_load_snapshot_writer, "__wrapped__")
                          and dpc.create_load_snapshot_reader is ls.create_load_snapshot_reader),
        "writer": f"{type(writer).__module__}.{type(writer).__qualname__}",
        "reader": f"{type(reader).__module__}.{type(reader).__qualname__}",
        "read_back": read is not None and read.num_running_reqs == sgl.full_snapshot(1).num_running_reqs,
    }


def _child(claim: str | None, queue: multiprocessing.Queue) -> None:
    queue.put(start(claim))


def main() -> None:
    args = sys.argv[1:]
    claim = args[args.index("--claim") + 1] if "--claim" in args else None
    out = {"main": start(claim)}
    if "--child" in args:
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_child, args=(claim, queue))
        child.start()
        out["child"] = queue.get(timeout=120)
        child.join(30)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
