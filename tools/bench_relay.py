"""Relay latency and throughput: `python tools/bench_relay.py [--quick]` (same as `dpboard bench relay`)."""

from __future__ import annotations

import sys

from dpboard.bench.relay import main

if __name__ == "__main__":
    sys.exit(main())
