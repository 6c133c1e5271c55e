"""A scheduler process of an SGLang instance, for the SGLang tests (``python -m tests.support.sglang_proc``).

``plugin RANK DP_SIZE INSTANCE_ID`` runs what an SGLang scheduler runs of the load path under the
plugin: SGLang's plugin loader (SGLANG_PLUGINS=dpboard), the writer from SGLang's factory, and
SGLang's own ``publish_load_snapshot`` and batch request handler; the board comes from DPBOARD_BOARD.
``sglang PATH DP_SIZE RANK`` is SGLang's own ``ShmLoadSnapshotWriter`` on a file, for comparison.
Extra context (zmq mode, node rank) comes as ``KEY=VALUE`` arguments for ``set_context``.

It prints ``ready`` and then obeys one JSON command per stdin line, answering ``ok``:
``{"op": "publish", "k": K, "set": {...}}`` publishes ``full_snapshot(rank, K)`` with those fields
replaced (``"varied": N``: the rank's snapshot of ``varied_snapshots(N, K)``); ``{"op": "take", "n": N}`` takes in N generate requests; ``{"op": "tear"}`` (plugin only)
begins a publish and stays in its middle, for the test to kill it there.
It exits when stdin closes, or after 300 s.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time


def _context_args(args: list[str]) -> dict:
    out = {}
    for arg in args:
        key, value = arg.split("=", 1)
        out[key] = value == "1" if key == "attn_dp_enabled" else int(value) if value.isdigit() else value
    return out


def main() -> None:
    from tests.support import sglang as sgl

    sgl.install()
    import msgspec
    import sglang.srt.managers.load_snapshot as ls

    kind = sys.argv[1]
    if kind == "plugin":
        rank, dp_size, instance_id = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        os.environ["SGLANG_PLUGINS"] = "dpboard"
        import sglang.srt.plugins as plugins

        plugins.load_plugins()
        sgl.set_context(dp_size=dp_size, role="scheduler", **_context_args(sys.argv[5:]))
        port_args = sgl.PortArgs(instance_id=instance_id, load_collector_ipc_name=os.environ.get("COLLECTOR", ""))
        writer = ls.create_load_snapshot_writer(port_args, dp_size, rank, publish_interval=1)
    else:
        path, dp_size, rank = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        writer = ls.ShmLoadSnapshotWriter(path, dp_size, rank)

    Scheduler = sys.modules["sglang.srt.managers.scheduler"].Scheduler
    io = sys.modules["sglang.srt.managers.io_struct"]

    class Inquirer:
        snapshot = None

        def get_loads(self):
            return self.snapshot

    inquirer = Inquirer()
    scheduler = Scheduler(load_snapshot_writer=writer, load_inquirer=inquirer)
    taken = 0
    print("ready", flush=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if not select.select([sys.stdin], [], [], 1.0)[0]:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        cmd = json.loads(line)
        if cmd["op"] == "publish":
            varied = cmd.get("varied")  # the rank's snapshot of sglang.varied_snapshots(varied, k)
            base = sgl.varied_snapshots(varied, cmd["k"])[rank] if varied else sgl.full_snapshot(rank, cmd["k"])
            snap = msgspec.structs.replace(base, **cmd.get("set", {}))
            inquirer.snapshot = snap
            if scheduler.publish_load_snapshot(force=True) is None:
                raise RuntimeError("publish_load_snapshot failed (see the warning above)")
        elif cmd["op"] == "take":
            reqs = [io.TokenizedGenerateReqInput(rid=f"r{rank}-{taken + i}", input_ids=[1] * 8) for i in range(cmd["n"])]
            Scheduler.handle_batch_generate_request(scheduler, reqs)
            taken += cmd["n"]
        elif cmd["op"] == "tear":  # begin a publish and stay in its middle (the slot's sequence odd)
            from dpboard.snapshot import LoadSnapshot

            print("ok", flush=True)
            writer._writer._publish_paused(LoadSnapshot(dp_rank=rank), 300.0)
        print("ok", flush=True)


class SchedulerProc:
    """The test's side of one such process."""

    def __init__(self, *args: str, env: dict | None = None, wrap: list[str] | None = None):
        import subprocess

        from tests.support.names import ROOT
        from tests.support.procutil import read_line

        self._read_line = read_line
        self.proc = subprocess.Popen([*(wrap or []), sys.executable, "-m", "tests.support.sglang_proc", *args],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        try:
            line = read_line(self.proc, 60)
            assert line.strip() == "ready", line
        except BaseException:
            self.kill()
            raise

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        assert self._read_line(self.proc, 30).strip() == "ok"

    def publish(self, k: int, varied: int | None = None, **fields) -> None:
        self.send(op="publish", k=k, varied=varied, set=fields)

    def close(self) -> None:
        """Close stdin: the process exits cleanly."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)

    def kill(self) -> None:
        from tests.support.procutil import kill

        kill(self.proc)


if __name__ == "__main__":
    main()
