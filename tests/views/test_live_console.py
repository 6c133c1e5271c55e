"""The live page as a console, in a real headless Chromium against real boards: the header top
shows (node, creator pid, stale threshold, active tokens, KV in tokens), sorting by a heading, the
cluster's charts, the requests each rank receives per second, a stale rank's last values kept and
marked, rates from the board's own counters (a real writer process at a known rate, the page
under Chromium's virtual time, whose clock runs far ahead of the board's), and the doctor's
findings line (hidden while the server answers 404, shown from a stand-in route in front of the
real server otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dpboard import Board, LoadSnapshot
from dpboard.views.top import fmt_count, fmt_like
from tests.support.names import ROOT
from tests.support.procutil import kill, read_line
from tests.support.serving import get, start_server

pytestmark = pytest.mark.timeout(180)

CAPACITY = 200_000


def cell(rank: int, key: str) -> str:
    return f"document.querySelector('tr[data-rank=\"{rank}\"] td[data-key=\"{key}\"]')?.textContent"


ROW_ORDER = "Array.from(document.querySelectorAll('#rows tr'), tr => Number(tr.dataset.rank))"


def snapshot(rank: int, running: int, waiting: int, total: int, received: int = 0) -> LoadSnapshot:
    return LoadSnapshot(dp_rank=rank, num_running_reqs=running, num_waiting_reqs=waiting, num_total_tokens=total,
                        num_active_tokens=total // 2, num_used_tokens=total, max_total_num_tokens=CAPACITY,
                        num_received_reqs=received)


class Writers:
    """Every rank in ``loads`` publishes its load every 50 ms (a thread) until stopped, or until its
    rank is dropped from ``loads`` (it then goes stale)."""

    def __init__(self, board: Board, loads: dict[int, tuple[int, int, int]]) -> None:
        self.loads = dict(loads)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.writers = {r: board.writer(r) for r in loads}
        self.received = dict.fromkeys(loads, 0)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.publish()
        self.thread.start()

    def publish(self) -> None:
        with self.lock:
            for r, (running, waiting, total) in self.loads.items():
                self.received[r] += 1 + r
                self.writers[r].publish(snapshot(r, running, waiting, total, self.received[r]))

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.publish()

    def drop(self, rank: int) -> None:
        with self.lock:
            del self.loads[rank]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def test_board_document_has_every_slot_and_the_header(board_name):
    with Board.create(board_name, n_slots=3) as board:
        board.writer(1).publish(snapshot(1, 4, 2, 900, received=7))
        server, url = start_server(board_name, "--stale-after", "0.2")
        try:
            time.sleep(0.4)  # rank 1 goes stale: /v1/board keeps its values, /v1/loads leaves it out
            status, ctype, body = get(url + "/v1/board")
            assert status == 200 and ctype == "application/json"
            doc = json.loads(body)
            assert (doc["board"], doc["n_slots"], doc["creator_pid"], doc["node_id"]) == (
                board_name, 3, os.getpid(), board.node_id)
            assert doc["stale_after_s"] == 0.2
            assert [r["status"] for r in doc["ranks"]] == ["empty", "stale", "empty"]
            stale = doc["ranks"][1]
            assert (stale["num_running_reqs"], stale["num_total_tokens"], stale["num_received_reqs"]) == (4, 900, 7)
            assert stale["publish_seq"] == 1 and stale["monotonic_ns"] > 0 and stale["age_s"] >= 0.2
            assert "publish_rate" not in stale and "history" not in stale
            assert get(url + "/v1/board?x=1")[0] == 400
            assert json.loads(get(url + "/v1/loads")[2])["loads"] == []
        finally:
            kill(server)


def test_the_console_header_sorting_charts_and_phone(chromium, board_name):
    # rank: (running, waiting, total); slot 4 is never written
    loads = {0: (5, 1, 30_000), 1: (9, 4, 150_000), 2: (2, 0, 12_000), 3: (7, 2, 64_000)}
    with Board.create(board_name, n_slots=5) as board:
        pub = Writers(board, loads)
        server, url = start_server(board_name, "--stale-after", "2")
        try:
            page = chromium.open(url + "/")
            page.wait_for("document.querySelectorAll('#rows tr').length === 5")
            sub = page.evaluate("document.getElementById('sub').textContent")
            assert f"node {board.node_id}" in sub and f"creator pid {os.getpid()}" in sub
            assert "stale after 2 s" in sub and f"{board.n_slots} slots" in sub
            totals = [v[2] for v in loads.values()]
            assert page.evaluate("document.getElementById('tokens').textContent") == (
                f"{fmt_count(sum(totals))} / {fmt_count(sum(t // 2 for t in totals))}")
            for r, (_, _, total) in loads.items():
                assert page.evaluate(cell(r, "num_active_tokens")) == fmt_count(total // 2)
                assert page.evaluate(cell(r, "kv_tokens")) == f"{fmt_like(total, CAPACITY)}/{fmt_count(CAPACITY)}"
                assert page.evaluate(cell(r, "node_id")) == str(board.node_id)
            assert page.evaluate(cell(4, "token_usage")) == "never written"

            # requests received per second per rank: rank r receives 1 + r requests per publish
            page.wait_for(f"{cell(3, 'request_rate')} !== '-' && {cell(0, 'request_rate')} !== '-'")
            shown = page.evaluate("[" + ", ".join(f"[{cell(r, 'request_rate')}, {cell(r, 'publish_rate')}]"
                                                  for r in loads) + "]")  # one read of the page
            req = {r: float(shown[r][0]) for r in loads}
            pubs = {r: float(shown[r][1]) for r in loads}
            for r in loads:  # rank r receives (1 + r) requests per publish: the page's ratio is the board's
                assert req[r] == pytest.approx((1 + r) * pubs[r], rel=0.25), (r, req, pubs)
            assert req[3] > 2.5 * req[0]

            # sorting: a heading's first click sorts busiest first, the second turns it round; the
            # empty slot sinks both ways
            page.evaluate("document.querySelector('th[data-sort=\"num_total_tokens\"]').click()")
            assert page.evaluate(ROW_ORDER) == [1, 3, 0, 2, 4]
            assert page.evaluate("document.querySelector('th[data-sort=\"num_total_tokens\"]')"
                                 ".getAttribute('aria-sort')") == "descending"
            page.evaluate("document.querySelector('th[data-sort=\"num_total_tokens\"]').click()")
            assert page.evaluate(ROW_ORDER) == [2, 0, 3, 1, 4]
            time.sleep(1.5)  # the order holds across refreshes
            assert page.evaluate(ROW_ORDER) == [2, 0, 3, 1, 4]
            page.evaluate("document.querySelector('th[data-sort=\"num_waiting_reqs\"]').click()")
            assert page.evaluate(ROW_ORDER) == [1, 3, 0, 2, 4]
            page.evaluate("document.querySelector('th[data-sort=\"dp_rank\"]').click()")
            assert page.evaluate(ROW_ORDER) == [0, 1, 2, 3, 4]

            # the cluster's charts: four inline SVG lines whose latest values are the header's
            for key in ("imbalance", "requests", "waiting", "kv"):
                page.wait_for(f"Number(document.querySelector('#chart-{key} svg').dataset.samples) >= 3")
                points = page.evaluate(f"document.querySelector('#chart-{key} polyline').getAttribute('points')")
                assert len(points.split()) >= 3
            now = "document.querySelector('#chart-{}  [data-role=\"now\"]').textContent"
            assert page.evaluate(now.format("imbalance")) == page.evaluate("document.getElementById('imbalance').textContent")
            assert page.evaluate(now.format("waiting")) == fmt_count(sum(v[1] for v in loads.values()))
            assert page.evaluate(now.format("kv")) == f"{round(100 * sum(totals) / (4 * CAPACITY))}%"
            chart, card = page.evaluate(f"[{now.format('requests')}, "
                                        "document.getElementById('rates').textContent.split(' · ')[1]]")
            assert chart == card  # one read of the page: the rate moves between refreshes

            # a phone: the page fits 390 pixels, the charts two by two, requests/s stays
            phone = chromium.open(url + "/", width=390, height=844, mobile=True)
            phone.wait_for("document.querySelectorAll('#rows tr').length === 5 && "
                           "Number(document.querySelector('#chart-kv svg').dataset.samples) >= 2")
            phone.wait_for(f"{cell(1, 'request_rate')} !== '-'")
            assert phone.evaluate("document.documentElement.scrollWidth") <= 390
            assert phone.evaluate("getComputedStyle(document.querySelector('tr[data-rank=\"0\"] "
                                  "td[data-key=\"request_rate\"]')).display") != "none"
            assert phone.evaluate("getComputedStyle(document.querySelector('tr[data-rank=\"0\"] "
                                  "td[data-key=\"writer_pid\"]')).display") == "none"
            shots = os.environ.get("DPBOARD_SCREENSHOTS")
            if shots:
                (open(os.path.join(shots, "live_console.png"), "wb")).write(page.screenshot())
                (open(os.path.join(shots, "live_console_phone.png"), "wb")).write(phone.screenshot())
        finally:
            pub.close()
            kill(server)


def test_a_stale_rank_keeps_its_last_values_marked_stale(chromium, board_name):
    with Board.create(board_name, n_slots=2) as board:
        pub = Writers(board, {0: (6, 1, 40_000), 1: (11, 3, 90_000)})
        server, url = start_server(board_name, "--stale-after", "1")
        try:
            page = chromium.open(url + "/")
            last_y = ("Number(document.querySelector('tr[data-rank=\"1\"] svg.spark polyline')"
                      ".getAttribute('points').split(' ').at(-1).split(',')[1])")
            page.wait_for(f"{cell(1, 'status')} === 'live' && document.querySelector('tr[data-rank=\"1\"] "
                          "svg.spark polyline').getAttribute('points').split(' ').length >= 3")
            live_y = page.evaluate(last_y)
            assert live_y < 19  # the line is above the baseline
            pub.drop(1)  # rank 1's writer stops publishing
            page.wait_for(f"{cell(1, 'status')} === 'stale'", timeout=15)
            time.sleep(2.5)  # a few refreshes while it is stale
            assert page.evaluate("document.querySelector('tr[data-rank=\"1\"]').className") == "stale"
            assert page.evaluate(cell(1, "num_running_reqs")) == "11"
            assert page.evaluate(cell(1, "num_waiting_reqs")) == "3"
            assert page.evaluate(cell(1, "num_total_tokens")) == fmt_count(90_000)
            assert page.evaluate(cell(1, "token_usage")) == f"{round(100 * 90_000 / CAPACITY)}%"
            assert page.evaluate(cell(1, "writer_pid")) == str(os.getpid())
            assert page.evaluate(cell(1, "age_s")).endswith("s")
            assert page.evaluate(cell(1, "publish_rate")) == "0.0"
            # its history does not drop to zero (the load did not go away: its writer did)
            assert page.evaluate(last_y) == pytest.approx(live_y, abs=1.0)
            # and it is no live rank: the header counts it stale, the totals leave it out
            assert page.evaluate("document.getElementById('ranks').textContent") == "1 live · 1 stale"
            assert page.evaluate("document.getElementById('tokens').textContent") == "40000 / 20000"
        finally:
            pub.close()
            kill(server)


WRITER = r"""
import sys, time
from dpboard import Board, LoadSnapshot
name, rank, rate, per = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
board = Board.attach(name)
w = board.writer(rank)
k, t = 0, time.monotonic()
while True:
    k += 1
    w.publish(LoadSnapshot(dp_rank=rank, num_running_reqs=3, num_total_tokens=1000 + k % 7,
                           max_total_num_tokens=4096, num_used_tokens=100, num_received_reqs=per * k))
    if k == 1:
        print("publishing", flush=True)
    t += 1 / rate  # paced by absolute deadlines: the long-run rate is the one asked for
    time.sleep(max(0.0, t - time.monotonic()))
"""


def board_rate(board: Board, rank: int, seconds: float) -> tuple[float, float]:
    """(publishes/s, requests received/s) of ``rank`` over the last ``seconds``, from the board's own
    counters and stamps: the window the page's rates cover when read right after."""
    reader = board.reader(stale_after=5)
    a = reader.read(rank)
    time.sleep(seconds)
    b = reader.read(rank)
    dt = (b.monotonic_ns - a.monotonic_ns) / 1e9
    return (b.publish_seq - a.publish_seq) / dt, (b.num_received_reqs - a.num_received_reqs) / dt


def test_rates_are_the_boards_own_under_a_clock_that_runs_ahead(chromium, board_name):
    """A writer process publishes at 400/s, 3 requests each. Under Chromium's virtual time the
    page's timers fire at once and its clock (performance.now) runs seconds ahead of the board's:
    rates over that clock read a fraction of the truth (the page once said 25 publishes/s where
    top said 401). Rates over the writer's own stamps match the board's counters."""
    with Board.create(board_name, n_slots=1) as board:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, board_name, "0", "400", "3"],
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
        server = None
        try:
            read_line(writer, 30)
            server, url = start_server(board_name)
            page = chromium.open(url + "/")
            page.wait_for(f"{cell(0, 'publish_rate')} !== undefined && {cell(0, 'publish_rate')} !== '-'")
            page.send("Emulation.setVirtualTimePolicy", {"policy": "advance"})
            clock = page.evaluate("performance.now()")
            pub_rate, req_rate = board_rate(board, 0, 2.0)
            # one read of the page: under virtual time it refreshes many times a second
            now, shown_pub, shown_req, cards = page.evaluate(
                f"[performance.now(), {cell(0, 'publish_rate')}, {cell(0, 'request_rate')}, "
                "document.getElementById('rates').textContent]")
            assert now - clock > 4_000  # the page's clock ran ahead of the 2 s that passed
            shown_pub, shown_req = float(shown_pub), float(shown_req)
            assert shown_pub == pytest.approx(pub_rate, rel=0.25), (shown_pub, pub_rate)
            assert shown_req == pytest.approx(req_rate, rel=0.25), (shown_req, req_rate)
            assert shown_req == pytest.approx(3 * shown_pub, rel=0.05)
            assert float(cards.split(" · ")[0]) == pytest.approx(pub_rate, rel=0.25)
        finally:
            kill(writer)
            if server is not None:
                kill(server)


class StandIn(ThreadingHTTPServer):
    """In front of the real ``dpboard serve``: every request is passed to it and its answer passed
    back, except ``/v1/doctor``, answered with ``doctor`` (None: a 404, as a server without it)."""

    daemon_threads = True

    def __init__(self, upstream: str, doctor: dict[str, Any] | None) -> None:
        self.upstream = upstream
        self.doctor = doctor
        self.asked = 0  # requests for /v1/doctor
        super().__init__(("127.0.0.1", 0), _StandInHandler)


class _StandInHandler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/v1/doctor":
            self.server.asked += 1
            doc = self.server.doctor
            status, body, ctype = (404, b'{"error": "no such path"}', "application/json") if doc is None else (
                200, json.dumps(doc).encode(), "application/json")
        else:
            try:
                with urllib.request.urlopen(self.server.upstream + self.path, timeout=10) as resp:
                    status, body, ctype = resp.status, resp.read(), resp.headers["Content-Type"]
            except urllib.error.HTTPError as e:
                status, body, ctype = e.code, e.read(), e.headers["Content-Type"]
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


FINDINGS = {"healthy": False, "window_s": 30.0, "findings": [
    {"severity": "info", "title": "one rank idle", "evidence": "rank 1: 0 requests", "cause": "c", "fix": "f"},
    {"severity": "critical", "title": "every request goes to rank 0 by routed_dp_rank",
     "evidence": "97% of 1200 requests", "cause": "the router pins routed_dp_rank", "fix": "drop it"},
    {"severity": "warning", "title": "refreshes above the throttle", "evidence": "40/s", "cause": "c", "fix": "f"},
]}


@pytest.mark.parametrize("doctor", [None, FINDINGS, {"healthy": True, "window_s": 30.0, "findings": []}],
                         ids=["404", "findings", "healthy"])
def test_the_findings_line(chromium, board_name, doctor):
    with Board.create(board_name, n_slots=1) as board:
        board.writer(0).publish(snapshot(0, 1, 0, 100))
        server, url = start_server(board_name, "--stale-after", "60")
        stand_in = StandIn(url, doctor)
        threading.Thread(target=stand_in.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        try:
            page = chromium.open(f"http://127.0.0.1:{stand_in.server_address[1]}/")
            page.wait_for("document.querySelectorAll('#rows tr').length === 1")
            line = "document.getElementById('findings')"
            if doctor is None:
                deadline = time.monotonic() + 15
                while stand_in.asked == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert stand_in.asked >= 1
                time.sleep(0.5)  # its answer has come back
                assert page.evaluate(f"{line}.hidden") is True
                assert page.evaluate(f"getComputedStyle({line}).display") == "none"
                return
            page.wait_for(f"!{line}.hidden")
            text = page.evaluate(f"{line}.textContent")
            if doctor["findings"]:
                assert text == "doctor: 3 findings · critical: every request goes to rank 0 by routed_dp_rank"
                assert page.evaluate(f"{line}.className") == "critical"
                assert "fix: drop it" in page.evaluate(f"{line}.title")
            else:
                assert text == "doctor: healthy over the last 30 s"
        finally:
            stand_in.shutdown()
            stand_in.server_close()
            kill(server)
