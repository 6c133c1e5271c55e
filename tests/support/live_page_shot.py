"""The README's picture of ``dpboard serve``'s live page: ``python -m tests.support.live_page_shot
docs/img/live_page.png``.

A real board of 8 slots (six ranks publishing loads that swing, one gone stale, one never written),
a real ``dpboard serve`` and a real headless Chromium (tests/support/chromium.py); the picture is
taken once the history has ``READS`` reads and the doctor's findings line is on the page. Takes
about a minute.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path

from dpboard import Board, LoadSnapshot
from tests.support.chromium import Browser
from tests.support.procutil import kill
from tests.support.serving import start_server

NAME = "live-console-demo"
LIVE, STALE, SLOTS = range(6), 6, 8
CAPACITY = 262_144
READS = 28  # history points in each sparkline when the picture is taken


def publish(board: Board, stop: threading.Event) -> None:
    """Each live rank's load swings on its own period, rank 0 the busiest; requests arrive at ~48/s."""
    writers = {r: board.writer(r) for r in LIVE}
    start = time.monotonic()
    while not stop.wait(0.05):
        t = time.monotonic() - start
        for r, w in writers.items():
            total = int((60_000 + 25_000 * (r % 3)) * (1.4 if r == 0 else 1.0) * (1.6 + math.sin(t / (3 + r))))
            w.publish(LoadSnapshot(r, num_running_reqs=20 + 4 * r + int(10 * math.sin(t / 2 + r)),
                                   num_waiting_reqs=max(0, int(8 * math.sin(t / 3 + r))), num_used_tokens=total,
                                   num_total_tokens=total, num_active_tokens=int(total * 0.9),
                                   max_total_num_tokens=CAPACITY, num_received_reqs=int(48 * t)))
    for w in writers.values():
        w.close()


def main(out: str) -> int:
    with Board.create(NAME, n_slots=SLOTS) as board:
        with board.writer(STALE) as w:  # published once, then silent: stale by the time of the picture
            w.publish(LoadSnapshot(STALE, num_running_reqs=31, num_waiting_reqs=4, num_used_tokens=150_000,
                                   num_total_tokens=150_000, num_active_tokens=140_000, max_total_num_tokens=CAPACITY))
        stop = threading.Event()
        thread = threading.Thread(target=publish, args=(board, stop), daemon=True)
        thread.start()
        server, url = start_server(NAME)
        try:
            with Browser() as browser:
                page = browser.open(url + "/")
                page.wait_for(f"document.querySelector('tr[data-rank=\"0\"] svg polyline')?.getAttribute('points')"
                              f".split(' ').length >= {READS}", timeout=120)
                page.wait_for("!document.getElementById('findings').hidden", timeout=30)
                Path(out).write_bytes(page.screenshot())
        finally:
            stop.set()
            thread.join(10)
            kill(server)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/img/live_page.png"))
