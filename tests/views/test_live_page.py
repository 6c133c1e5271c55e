"""`dpboard serve`'s live page (``/``) in a real headless Chromium, against a board whose numbers
change: the page shows every rank as `dpboard top` does, follows a change within a few refreshes,
and fits a phone's width. Without Chromium the test skips and says how to get it; in CI (CI=true)
that is a failure (.ci/run installs Debian's chromium).

``DPBOARD_SCREENSHOTS=DIR`` keeps the laptop and phone screenshots there (docs/img holds the ones
the README shows); otherwise they go to the test's temporary folder.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dpboard import Board, LoadSnapshot
from dpboard.views.top import fmt_count
from dpboard.views.watch import imbalance
from tests.support.procutil import kill
from tests.support.serving import get, start_server

pytestmark = pytest.mark.timeout(180)

CAPACITY = 131_072
LIVE = (0, 1, 2, 3, 4, 5)
STALE_RANK, EMPTY_RANK = 6, 7
STALE_AFTER = 1.0


class Publishing:
    """The board's writers: every live rank publishes ``loads[rank]`` every 50 ms until stopped."""

    def __init__(self, board: Board) -> None:
        self.loads = {r: {"running": 10 + 3 * r, "waiting": r % 3, "total": 40_000 + 9_000 * r} for r in LIVE}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.writers = {r: board.writer(r) for r in (*LIVE, STALE_RANK)}
        # the stale rank published once, long enough ago by the time the page looks
        self.writers[STALE_RANK].publish(self.snapshot(STALE_RANK, {"running": 1, "waiting": 0, "total": 500}))
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    @staticmethod
    def snapshot(rank: int, load: dict[str, int]) -> LoadSnapshot:
        return LoadSnapshot(dp_rank=rank, num_running_reqs=load["running"], num_waiting_reqs=load["waiting"],
                            num_total_tokens=load["total"], num_active_tokens=load["total"],
                            num_used_tokens=load["total"], max_total_num_tokens=CAPACITY)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            with self.lock:
                loads = {r: dict(v) for r, v in self.loads.items()}
            for r, load in loads.items():
                self.writers[r].publish(self.snapshot(r, load))

    def set(self, rank: int, **load: int) -> None:
        with self.lock:
            self.loads[rank].update(load)

    def totals(self) -> list[int]:
        with self.lock:
            return [self.loads[r]["total"] for r in LIVE]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def cell(rank: int, key: str) -> str:
    return f"document.querySelector('tr[data-rank=\"{rank}\"] td[data-key=\"{key}\"]')?.textContent"


def test_live_page_shows_the_board_and_follows_a_change(chromium, board_name, tmp_path):
    shots = Path(os.environ.get("DPBOARD_SCREENSHOTS") or tmp_path)
    with Board.create(board_name, n_slots=8) as board:
        pub = Publishing(board)
        server, url = start_server(board_name, "--stale-after", str(STALE_AFTER))
        try:
            status, ctype, body = get(url + "/")
            assert status == 200 and ctype == "text/html; charset=utf-8"
            # self-contained: nothing is fetched from anywhere but this server's /v1/loads
            assert "http://" not in body.replace("http://www.w3.org/2000/svg", "") and "https://" not in body
            assert "<script src" not in body and "<link" not in body

            page = chromium.open(url + "/")
            page.wait_for(f"document.querySelectorAll('#rows tr').length === 8 && {cell(STALE_RANK, 'status')} === 'stale'")
            page.wait_for("document.querySelector('#rows svg polyline')?.getAttribute('points').split(' ').length >= 3")
            assert page.evaluate("document.getElementById('board').textContent") == board_name
            for r in LIVE:
                load = pub.loads[r]
                assert page.evaluate(cell(r, "status")) == "live"
                assert page.evaluate(cell(r, "num_running_reqs")) == fmt_count(load["running"])
                assert page.evaluate(cell(r, "num_waiting_reqs")) == fmt_count(load["waiting"])
                assert page.evaluate(cell(r, "num_total_tokens")) == fmt_count(load["total"])
                assert page.evaluate(cell(r, "token_usage")) == f"{round(100 * load['total'] / CAPACITY)}%"
                assert page.evaluate(cell(r, "writer_pid")) == str(os.getpid())
                assert page.evaluate(cell(r, "age_s")).endswith("ms")
            assert page.evaluate(cell(EMPTY_RANK, "status")) == "empty"
            assert page.evaluate(cell(EMPTY_RANK, "token_usage")) == "never written"
            # a rank never written has no history to draw: no line, not a flat one at zero
            lines = "document.querySelectorAll('tr[data-rank=\"{}\"] td[data-key=\"history\"] polyline').length"
            assert page.evaluate(lines.format(EMPTY_RANK)) == 0
            assert all(page.evaluate(lines.format(r)) == 1 for r in (*LIVE, STALE_RANK))
            # the doctor's findings line (the stale rank), as the README's screenshot shows it
            page.wait_for("!document.getElementById('findings').hidden")
            assert page.evaluate("document.getElementById('findings').textContent").startswith("doctor: ")
            assert page.evaluate("document.getElementById('ranks').textContent") == "6 live · 1 stale · 1 empty"
            assert page.evaluate("document.getElementById('imbalance').textContent") == f"{imbalance(pub.totals()):.2f}x"
            chromium_png = page.screenshot()
            (shots / "live_page.png").write_bytes(chromium_png)

            # a change on the board reaches the page: rank 2 gets busy, the imbalance follows
            pub.set(2, running=97, waiting=12, total=120_000)
            page.wait_for(f"{cell(2, 'num_total_tokens')} === '{fmt_count(120_000)}'", timeout=15)
            page.wait_for(f"{cell(2, 'num_running_reqs')} === '97' && {cell(2, 'num_waiting_reqs')} === '12'",
                          timeout=15)
            page.wait_for(f"document.getElementById('imbalance').textContent === '{imbalance(pub.totals()):.2f}x'",
                          timeout=15)
            assert page.evaluate("document.getElementById('imbalance').className") == "v bad"  # 1.5x and more

            # a phone: the page fits its width, the wide columns are gone, the rows stay
            phone = chromium.open(url + "/", width=390, height=844, mobile=True)
            phone.wait_for("document.querySelectorAll('#rows tr').length === 8")
            assert phone.evaluate("document.documentElement.scrollWidth") <= 390, phone.evaluate(
                "JSON.stringify(Array.from(document.querySelectorAll('#rows tr:first-child td, #heads th'), "
                "c => [c.textContent, Math.round(c.getBoundingClientRect().width)]))")
            assert phone.evaluate("getComputedStyle(document.querySelector('tr[data-rank=\"0\"] "
                                  "td[data-key=\"writer_pid\"]')).display") == "none"
            assert phone.evaluate(cell(2, "num_total_tokens")) == fmt_count(120_000)
            (shots / "live_page_phone.png").write_bytes(phone.screenshot())
        finally:
            pub.close()
            kill(server)
    assert chromium_png.startswith(b"\x89PNG")


def test_the_page_says_when_the_board_cannot_be_read(chromium, board_name):
    with Board.create(board_name, n_slots=2) as board:
        board.writer(0).publish(LoadSnapshot(dp_rank=0, num_total_tokens=10))
        server, url = start_server(board_name)
        try:
            page = chromium.open(url + "/")
            page.wait_for("document.querySelectorAll('#rows tr').length === 2")
            board.unlink()
            page.wait_for("document.getElementById('status').className === 'bad'", timeout=15)
            assert "cannot read the board" in page.evaluate("document.getElementById('status').textContent")
        finally:
            kill(server)
