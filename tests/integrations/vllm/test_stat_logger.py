"""dpboard's vLLM stat logger (DPBOARD_VLLM_PUBLISHER=stat_logger) driven through vLLM's own loading
path and stats classes, on each release the plugin supports (0.33.0's wheel, then 0.32.0's).

Each test starts tests/support/vllm_host.py: a process playing the vLLM API server on vLLM's real
modules (behind tests/support/vllm.py's torch stand-ins). It finds the plugin with vLLM's own
loader and dpboard's installed entry point, builds it, and calls it as vLLM's output handler does,
on a running event loop. The test process reads the board as any reader would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from dpboard import Board, SlotStatus
from dpboard.board import segment_path
from tests.support.names import ROOT, new_board_name
from tests.support.procutil import kill, read_line
from tests.support.vllm import vllm_missing, wheel_env, wheel_missing, wheel_params

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(vllm_missing() is not None and not os.environ.get("CI"),
                                 reason=str(vllm_missing()))]

ENTRY_POINT = "dpboard.integrations.vllm.stat_logger:DpboardStatLogger"


@pytest.fixture(autouse=True, params=wheel_params())
def vllm_wheel(request, monkeypatch):
    """Every test once per supported vLLM wheel (the earlier one marked slow): the host processes
    import that one."""
    missing = wheel_missing(request.param)
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run these tests: {missing}")
        pytest.skip(missing)
    for key, value in wheel_env(request.param).items():
        monkeypatch.setenv(key, value)
    return request.param
SPEC = {"dp": 4, "engines": [0, 1, 2, 3], "block_size": 16, "num_gpu_blocks": 4 * 4096,
        "kv_cache_size_tokens": 65_536, "max_num_seqs": 256, "served_model_name": "org/Model-8B"}


class Host:
    """The API-server stand-in process and its command channel."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str]) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("DPBOARD_VLLM", "VLLM_PLUGINS"))}
        environ["DPBOARD_VLLM_PUBLISHER"] = "stat_logger"
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.vllm_host", json.dumps(spec)], cwd=ROOT,
                                     env={**environ, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        try:
            self.started = json.loads(read_line(self.proc, 60))
        except AssertionError:
            kill(self.proc)
            raise AssertionError(f"the vLLM host printed nothing: {self.proc.stderr.read()}") from None

    def send(self, op: str, **args: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(read_line(self.proc, 30))
        assert reply == {"ok": op}, reply
        return reply

    def record(self, engine: int, generated: int | None = None, **stats: Any) -> None:
        self.send("record", engine=engine, scheduler=stats, generated=generated)

    def shut_down(self) -> tuple[int, str]:
        """Closes stdin (the server shuts down and its atexit hooks run); its exit status and stderr."""
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            kill(self.proc)
        return self.proc.returncode, self.proc.stderr.read()


def start(board: str | None, spec: dict[str, Any] = SPEC, **env: str) -> Host:
    host = Host(spec, {"DPBOARD_VLLM_BOARD": board, **env} if board else env)
    if "error" in host.started:
        host.shut_down()
    return host


def read_slots(board: str) -> list[dict[str, Any]]:
    """The board as `dpboard dump --json` prints it, from a reader process of its own."""
    out = subprocess.run([sys.executable, "-m", "dpboard.cli", "dump", board, "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["slots"]


def test_the_installed_entry_point_names_the_class():
    (plugin,) = [ep for ep in entry_points(group="vllm.stat_logger_plugins") if ep.name == "dpboard"]
    assert plugin.value == ENTRY_POINT


def test_each_engine_publishes_into_its_slot(board_name):
    host = start(board_name)
    try:
        assert host.started["plugins"] == ["dpboard"] and host.started["classes"] == [ENTRY_POINT]
        assert host.started["load_failures"] == []
        # log_engine_initialized: every engine is on the board, idle, with its capacity.
        slots = read_slots(board_name)
        assert [s["status"] for s in slots] == ["live"] * 4
        assert all(s["max_total_num_tokens"] == 65_536 and s["num_running_reqs"] == 0 for s in slots)
        for engine in range(4):
            host.record(engine, generated=10, num_running_reqs=engine + 1, num_waiting_reqs=2 * engine,
                        num_skipped_waiting_reqs=1, kv_cache_usage=0.125 * (engine + 1),
                        prefix={"requests": 4, "queries": 400, "hits": 100 * engine})
        host.send("record", engine=1, scheduler=None, generated=5)  # a message without stats: no publish
        slots = read_slots(board_name)
        reader = Board.attach(board_name).reader()
        for engine in range(4):
            used = round(0.125 * (engine + 1) * 65_536)
            expected = dict(dp_rank=engine, num_running_reqs=engine + 1, num_waiting_reqs=2 * engine + 1,
                            num_used_tokens=used, num_total_tokens=used, num_active_tokens=used,
                            max_total_num_tokens=65_536, num_received_reqs=0, status="live",
                            writer_pid=host.started["pid"])
            assert {k: slots[engine][k] for k in expected} == expected
            assert slots[engine]["token_usage"] == 0.125 * (engine + 1)
            _, _, detail = reader.read_detail(engine)
            assert detail.token_usage == 0.125 * (engine + 1)
            assert detail.max_running_requests == 256
            assert detail.cache_hit_rate == engine / 4
        host.send("log")
        host.send("admission", reason="max_num_queued_reqs")
        code, err = host.shut_down()
        assert code == 0 and "Traceback" not in err
        assert not segment_path(board_name).exists()  # the API server made the board and removed it
    finally:
        host.shut_down()


def test_capacity_from_the_summed_blocks(board_name):
    spec = {**SPEC, "dp": 2, "engines": [0, 1], "num_gpu_blocks": 2 * 1000, "kv_cache_size_tokens": None}
    host = start(board_name, spec)
    try:
        host.record(0, num_running_reqs=1, kv_cache_usage=0.5)
        slot = read_slots(board_name)[0]
        assert slot["max_total_num_tokens"] == 1000 * 16 and slot["num_used_tokens"] == 8000
    finally:
        host.shut_down()


def test_external_load_balancing_one_server_per_rank(board_name):
    """One `vllm serve --data-parallel-rank R` per rank: each API server manages one engine and
    writes its slot of the same board."""
    hosts = [start(board_name, {**SPEC, "engines": [r], "num_gpu_blocks": 4096}) for r in range(2)]
    try:
        for r, host in enumerate(hosts):
            assert host.started.get("ready"), host.started
            host.record(r, num_running_reqs=5 + r, kv_cache_usage=0.25)
        slots = read_slots(board_name)
        for r, host in enumerate(hosts):
            assert slots[r]["num_running_reqs"] == 5 + r and slots[r]["writer_pid"] == host.started["pid"]
            assert slots[r]["num_used_tokens"] == 16_384 and slots[r]["status"] == "live"
        assert [s["status"] for s in slots[2:]] == ["empty", "empty"]
    finally:
        for host in reversed(hosts):  # the creator last, so the other never writes an unlinked board
            host.shut_down()


def test_node_id_stamped_for_the_relay(board_name):
    """Hybrid load balancing over nodes: node K's API server stamps K, which `dpboard relay --node-id K`
    forwards to node0."""
    host = start(board_name, {**SPEC, "engines": [2, 3]}, DPBOARD_VLLM_NODE_ID="1")
    try:
        host.record(2, num_running_reqs=1, kv_cache_usage=0.5)
        slots = read_slots(board_name)
        assert [s["node_id"] for s in slots[2:]] == [1, 1] and slots[2]["num_running_reqs"] == 1
        assert [s["status"] for s in slots[:2]] == ["empty", "empty"]
    finally:
        host.shut_down()


def test_idle_engines_stay_live_and_silent_busy_ones_go_stale(board_name):
    host = start(board_name)
    try:
        host.record(0, num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0)
        host.record(1, num_running_reqs=3, num_waiting_reqs=0, kv_cache_usage=0.2)
        host.record(2, num_running_reqs=0, num_waiting_reqs=2, kv_cache_usage=0.0)
        board = Board.attach(board_name)
        reader = board.reader(stale_after=1.0)
        before = reader.read(0).publish_seq
        host.send("wait", seconds=2.0)  # vLLM sends no stats meanwhile
        assert [reader.status(r) for r in range(4)] == [SlotStatus.LIVE, SlotStatus.STALE, SlotStatus.STALE,
                                                        SlotStatus.LIVE]
        assert reader.read(0).publish_seq > before
        host.send("sleep", args=[1, 1])  # vLLM sleeps: no engine can serve
        host.send("wait", seconds=2.0)
        assert {reader.status(r) for r in range(4)} == {SlotStatus.STALE}
        host.send("sleep", args=[0, 0])  # awake again
        assert [reader.status(r) for r in range(4)] == [SlotStatus.LIVE] * 4
    finally:
        host.shut_down()


def test_more_than_one_api_server_stops_vllm_with_the_fix(board_name):
    host = start(board_name, {**SPEC, "api_process_count": 4})
    assert host.started["error"] == "InvalidInputError"
    assert "--api-server-count 1" in host.started["message"]
    assert not segment_path(board_name).exists()


def test_off_without_the_environment():
    name = f"vllm-{new_board_name()}-Model"
    host = start(None, {**SPEC, "served_model_name": name.removeprefix("vllm-")})
    try:
        assert host.started["plugins"] == ["dpboard"]
        host.record(0, num_running_reqs=1, kv_cache_usage=0.5)
        assert not segment_path(name).exists()
    finally:
        host.shut_down()


def test_board_named_after_the_served_model(board_name):
    served = f"{board_name}/Model-8B"  # a served model name with a slash, as from a hub path
    name = f"vllm-{board_name}-Model-8B"
    host = start(None, {**SPEC, "served_model_name": served}, DPBOARD_VLLM="1")
    try:
        host.record(3, num_running_reqs=9, kv_cache_usage=0.5)
        assert read_slots(name)[3]["num_running_reqs"] == 9
    finally:
        host.shut_down()
        Path(segment_path(name)).unlink(missing_ok=True)


def test_vllm_plugins_allow_list_leaves_it_out(board_name):
    host = start(board_name, VLLM_PLUGINS="some_other_plugin")
    try:
        assert host.started["plugins"] == []
        assert not segment_path(board_name).exists()
    finally:
        host.shut_down()


def test_second_deployment_on_the_same_board_is_refused(board_name):
    first = start(board_name)
    try:
        second = start(board_name)
        assert second.started["error"] == "BoardError"
        assert f"held by the writer in live process {first.started['pid']}" in second.started["message"]
    finally:
        first.shut_down()


def test_stats_of_an_engine_not_managed_here_are_dropped(board_name):
    host = start(board_name, {**SPEC, "engines": [0, 1]})
    try:
        host.record(3, num_running_reqs=4, kv_cache_usage=0.1)
        host.record(3, num_running_reqs=4, kv_cache_usage=0.1)
        assert [s["status"] for s in read_slots(board_name)] == ["live", "live", "empty", "empty"]
    finally:
        code, err = host.shut_down()
    assert code == 0
    assert err.count("stats of engine 3, which this API server does not manage [0, 1], are dropped") == 1


def test_plugin_modules_import_no_vllm_until_vllm_runs_them():
    modules = ["dpboard.integrations.vllm", "dpboard.integrations.vllm.engines", "dpboard.integrations.vllm.settings",
               "dpboard.integrations.vllm.plugin", "dpboard.integrations.vllm.engine_core",
               "dpboard.integrations.vllm.dispatch"]
    code = (f"import sys, {', '.join(modules)}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out
