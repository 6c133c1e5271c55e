"""Serve a board's loads over HTTP from inside your own program.

    python examples/serve_board.py NAME [PORT]

Starts ``LoadsServer`` (the server of ``dpboard serve``) on a thread, scrapes it once, and keeps
serving until Ctrl-C: /v1/loads, /v1/loads?format=prometheus, /metrics and /healthz.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request

from dpboard.views.serve import LoadsServer


def main() -> int:
    name = sys.argv[1]
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 0  # 0: any free port
    server = LoadsServer(name, "127.0.0.1", port, stale_after=1.0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    try:
        with urllib.request.urlopen(f"{server.url}/v1/loads", timeout=5) as resp:
            doc = json.load(resp)
        for load in doc["loads"]:
            print(f"rank {load['dp_rank']}: {load['status']:<5} total tokens {load['num_total_tokens']}")
        print(f"serving board {name!r} on {server.url} (Ctrl-C stops)")
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
