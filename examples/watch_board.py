"""Follow a board from a script: one line per sample, through its vanishing and coming back.

    python examples/watch_board.py NAME [SECONDS]

``BoardWatch`` is what ``dpboard top`` and ``dpboard serve`` read boards with; each ``sample()``
gives a ``Frame`` (rows, liveness counts, imbalance, totals, rates).
"""

from __future__ import annotations

import sys
import time

from dpboard.views.watch import BoardWatch


def main() -> int:
    name = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    watch = BoardWatch(name, stale_after=1.0, wait=True)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            frame = watch.sample()
            if frame.gone:
                print(frame.gone)
            else:
                imbalance = f"{frame.imbalance:.2f}" if frame.imbalance is not None else "-"
                rate = f"{frame.publish_rate:.0f}/s" if frame.publish_rate is not None else "-"
                print(f"{frame.board}: {frame.counts['live']} live, {frame.counts['stale']} stale, "
                      f"imbalance {imbalance}, total tokens {frame.totals['num_total_tokens']}, publishes {rate}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        watch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
