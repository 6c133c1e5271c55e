"""Serve a board's loads over HTTP from inside your own program.

    python examples/serve_board.py NAME [--port 0] [--wait]

Starts ``LoadsServer`` (the server of ``dpboard serve``) on a thread, scrapes it once, and keeps
serving until Ctrl-C: the live page at /, /v1/loads, /v1/loads?format=prometheus, /metrics and
/healthz.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.error
import urllib.request

from dpboard.errors import DpboardError
from dpboard.options import count
from dpboard.views.serve import LoadsServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("name", help="board name (`dpboard ls` lists them)")
    parser.add_argument("--port", type=count(0, 65535), default=0, help="port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--wait", action="store_true", help="serve (503) until the board is created")
    args = parser.parse_args(argv)
    name = args.name
    try:
        server = LoadsServer(name, "127.0.0.1", args.port, stale_after=1.0, wait=args.wait)
    except DpboardError as e:
        parser.error(str(e))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    try:
        try:
            with urllib.request.urlopen(f"{server.url}/v1/loads", timeout=5) as resp:
                doc = json.load(resp)
            for load in doc["loads"]:
                print(f"rank {load['dp_rank']}: {load['status']:<5} total tokens {load['num_total_tokens']}")
        except urllib.error.HTTPError as e:  # 503 while a --wait board does not exist yet
            print(f"/v1/loads: {e.code} {json.load(e).get('error')}")
        print(f"serving board {name!r} on {server.url}: the live page at {server.url}/ (Ctrl-C stops)")
        # in slices: Ctrl-C may be delivered to the serving thread, and a join without a timeout
        # would keep the main thread, the only one that runs Python's handlers, from ever seeing it
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
