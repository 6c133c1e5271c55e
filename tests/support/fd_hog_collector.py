"""A collector whose process has no fd left: ``python tests/support/fd_hog_collector.py BOARD LIMIT``.

Lowers its RLIMIT_NOFILE to LIMIT, starts a Collector on a free loopback port (printed as JSON), then
opens /dev/null until ``open`` fails, so that every accept of the collector's listener fails with
EMFILE. It serves until stdin closes; the line ``free`` closes the hoarded fds first, the line
``stats`` prints the guard's counters as JSON. At the end it prints them too.
"""

from __future__ import annotations

import json
import os
import resource
import select
import sys

from dpboard.multinode.collector import Collector


def main(board: str, limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    with Collector(board, "tcp://127.0.0.1:*") as collector:
        print(json.dumps({"endpoint": collector.endpoint}), flush=True)
        hoard: list[int] = []
        try:
            while len(hoard) < limit:
                hoard.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        print(json.dumps({"hoarded": len(hoard)}), flush=True)
        while True:
            collector.poll(50)
            if select.select([sys.stdin], [], [], 0)[0]:
                line = sys.stdin.readline()
                if not line:
                    break
                if line.strip() == "stats":
                    print(json.dumps(collector.peer_stats), flush=True)
                    continue
                for fd in hoard:
                    os.close(fd)
                hoard.clear()
                print(json.dumps({"freed": True}), flush=True)
        print(json.dumps(collector.peer_stats), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
