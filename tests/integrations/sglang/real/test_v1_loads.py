"""``dpboard serve``'s /v1/loads against SGLang's own endpoint code.

The same snapshots go into SGLang's own shared-memory file (SGLang's writer) and into a board (the
plugin's writer, in other processes). SGLang's document comes from its real ``get_loads`` endpoint
function and ``_format_loads_prometheus`` (``entrypoints/v1_loads.py``), over its real
``TokenizerControlMixin.get_loads`` (read from the wheel), fed by SGLang's own reader or by the
plugin's; dpboard's comes from a ``dpboard serve`` process over HTTP. They must agree for every
``include``, ``dp_rank`` and format (the wall-clock ``timestamp`` and ``version`` aside).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from typing import Any

import pytest
import sglang.srt.entrypoints.v1_loads as v1_loads

from tests.integrations.sglang.real.conftest import ls
from tests.integrations.sglang.real.test_plugin import typed
from tests.support import sglang as sgl
from tests.support.names import ROOT
from tests.support.procutil import kill, read_line, stop
from tests.support.sglang_proc import SchedulerProc

pytestmark = pytest.mark.timeout(300)

DP_SIZE = 4  # rank 3 never publishes
SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


class TokenizerManager:
    """What /v1/loads asks of SGLang's tokenizer manager: SGLang's own ``get_loads`` method."""

    def __init__(self, reader: Any, dp_size: int):
        self.load_snapshot_reader = reader
        self.elastic_worker_count = dp_size

    def auto_create_handle_loop(self) -> None:
        pass


sgl.real_defs("srt/managers/tokenizer_control_mixin.py", ["get_loads"],
              ns := {"Optional": Any, "List": list, "LoadSnapshot": Any, "TokenizerManager": Any},
              cls="TokenizerControlMixin")
TokenizerManager.get_loads = ns["get_loads"]


def sglang_answer(tm: TokenizerManager, query: dict) -> tuple[int, str, Any]:
    """(status, content type, body) of SGLang's endpoint function for ``query``."""
    try:
        result = asyncio.run(v1_loads.get_loads(dp_rank=query.get("dp_rank"), include=query.get("include"),
                                                format=query.get("format"), tokenizer_manager=tm))
    except ValueError as e:  # escapes SGLang's handler: FastAPI answers 500
        return 500, "", str(e)
    if isinstance(result, dict):
        return 200, "application/json", result
    return result.status_code, result.headers["content-type"], result.body.decode()


def served_answer(url: str, query: dict) -> tuple[int, str, Any]:
    qs = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
    try:
        with urllib.request.urlopen(f"{url}/v1/loads{'?' + qs if qs else ''}", timeout=10) as resp:
            status, ctype, body = resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as e:
        status, ctype, body = e.code, e.headers["Content-Type"], e.read().decode()
    return status, ctype, json.loads(body) if ctype.startswith("application/json") else body


def include_values() -> list[str | None]:
    values: list[str | None] = [None, ""]
    for n in range(1, len(SECTIONS) + 1):
        values += [",".join(c) for c in itertools.combinations(SECTIONS, n)]
    values.append(" core , spec ")  # SGLang strips each name
    return values


@pytest.fixture(scope="module")
def two_sources(loaded_plugins, tmp_path_factory):
    """SGLang's file and a board holding the same snapshots, SGLang's two readers, a dpboard serve."""
    from dpboard.board import Board
    from tests.support.names import new_board_name

    board_name = new_board_name()
    sgl.set_context(dp_size=DP_SIZE, tp_size=2, pp_size=1)
    path = str(tmp_path_factory.mktemp("sglang") / "loads.shm")
    board = Board.create(board_name, DP_SIZE)
    procs = [SchedulerProc("plugin", str(r), str(DP_SIZE), "v1loads", env={"DPBOARD_BOARD": board_name})
             for r in range(DP_SIZE - 1)]
    own = [ls.ShmLoadSnapshotWriter(path, DP_SIZE, r) for r in range(DP_SIZE - 1)]
    server = None
    try:
        for r, snap in enumerate(sgl.varied_snapshots(DP_SIZE - 1, 5)):
            own[r].write(snap)
            procs[r].publish(5, varied=DP_SIZE - 1)
        import os

        # The snapshots are written once; the comparisons take longer than the default 5 s on a busy
        # machine, after which the ranks would be handed to SGLang as unpublished. Both dpboard
        # readers get the same 300 s (dpboard serve below too).
        os.environ.update(DPBOARD_BOARD=board_name, DPBOARD_STALE_AFTER="300")
        try:
            board_reader = ls.create_load_snapshot_reader(sgl.PortArgs(instance_id="v1loads"), "TokenizerManager")
        finally:
            del os.environ["DPBOARD_BOARD"], os.environ["DPBOARD_STALE_AFTER"]
        server = subprocess.Popen([sys.executable, "-m", "dpboard.cli", "serve", board_name, "--port", "0",
                                   "--stale-after", "300", "--num-accelerators", "2"],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        url = read_line(server, 30).split(" on ")[1].split()[0]
        yield {"sglang": TokenizerManager(ls.ShmLoadSnapshotReader(path, DP_SIZE), DP_SIZE),
               "plugin": TokenizerManager(board_reader, DP_SIZE), "url": url}
    finally:
        if server is not None:
            stop(server)
        for p in procs:
            kill(p.proc)
        for w in own:
            w.close()
        board.close()
        board.unlink()
        from tests.integrations.sglang.real.conftest import drop_boards

        drop_boards()
        sgl.reset_context()


def compare_json(theirs: dict, ours: dict) -> None:
    assert set(theirs) <= set(ours)
    for key in ("accelerator", "num_accelerators"):
        assert typed(ours[key]) == typed(theirs[key]), key
    for key in ("timestamp", "version"):
        assert type(ours[key]) is type(theirs[key]), key
    stamp = datetime.fromisoformat(ours["timestamp"])  # SGLang's format: Python's isoformat with +00:00
    assert stamp.utcoffset().total_seconds() == 0 and ours["timestamp"].endswith("+00:00")
    assert len(ours["loads"]) == len(theirs["loads"])
    for mine, want in zip(ours["loads"], theirs["loads"], strict=True):
        shown = [key for key in mine if key in want]
        assert shown == list(want), "SGLang's keys, in SGLang's order"
        assert typed({k: mine[k] for k in shown}) == typed(want)
        assert not set(mine) - set(want) & (set(ls._CORE_KEYS) | {"memory", "speculative", "lora",
                                                                   "disaggregation", "queues"})


@pytest.mark.parametrize("fmt", [None, "prometheus"])
def test_every_include_and_dp_rank_matches_sglangs_endpoint(two_sources, fmt):
    url = two_sources["url"]
    checked = 0
    for include in include_values():
        for dp_rank in (None, 0, 1, 2, 3, 7, -1):
            query = {"include": include, "dp_rank": dp_rank, "format": fmt}
            s_status, s_type, s_body = sglang_answer(two_sources["sglang"], query)
            p_status, p_type, p_body = sglang_answer(two_sources["plugin"], query)
            d_status, d_type, d_body = served_answer(url, query)
            assert s_status == p_status == d_status == 200, (query, d_body)
            if fmt == "prometheus":
                assert s_body == p_body == d_body, query
                assert s_type == p_type == d_type == "text/plain; version=0.0.4; charset=utf-8"
            else:
                assert typed(p_body["loads"]) == typed(s_body["loads"]), query
                compare_json(s_body, d_body)
            checked += 1
    assert checked == len(include_values()) * 7
    # the loads are really there: SGLang lists ranks 0-2, with their sections
    doc = served_answer(url, {})[2]
    assert [load["dp_rank"] for load in doc["loads"]] == [0, 1, 2]
    assert "memory" in doc["loads"][0] and "memory" not in doc["loads"][1]
    assert doc["omitted_ranks"] == [{"dp_rank": 3, "status": "empty", "age_s": None}]


@pytest.mark.parametrize("include", ["bogus", "core,bogus", "memory,spec,nothing"])
def test_a_bad_include_is_a_400_with_sglangs_message(two_sources, include):
    s_status, _, message = sglang_answer(two_sources["sglang"], {"include": include})
    assert s_status == 500  # SGLang's own endpoint lets to_dict's ValueError escape
    status, ctype, body = served_answer(two_sources["url"], {"include": include})
    assert status == 400 and ctype.startswith("application/json")
    if include.count(",") < 2:  # one bad name: the message is the same text (a set of several has no order)
        assert body["detail"] == message
    assert body["detail"].startswith("Invalid include sections: {") and "Valid options: ['all', 'core'" in body["detail"]


def test_all_beside_a_bad_name_is_accepted_as_sglang_accepts_it(two_sources):
    assert sglang_answer(two_sources["sglang"], {"include": "all,bogus"})[0] == 200
    status, _, body = served_answer(two_sources["url"], {"include": "all,bogus"})
    assert status == 200 and len(body["loads"]) == 3


def test_a_non_integer_dp_rank_is_a_422_as_fastapi_answers(two_sources):
    status, _, body = served_answer(two_sources["url"], {"dp_rank": "abc"})
    assert status == 422 and body["detail"][0]["loc"] == ["query", "dp_rank"]
