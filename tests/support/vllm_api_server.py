"""One vLLM API server's balancing client in a process of its own, for the many-servers tests.

``python -m tests.support.vllm_api_server INDEX COUNT ENGINES``: vLLM 0.33.0's real modules (behind
tests/support/vllm.py's stand-ins), dpboard's general plugin loaded by vLLM's loader with the
environment's DPBOARD_METHOD and DPBOARD_VLLM_BOARD, and a ``DPLBAsyncMPClient`` (client INDEX of
COUNT, over ENGINES engines) with its ClientDispatch, as the patched ``__init__`` makes it. Prints
``{"ready": pid}``, then answers one JSON line per command line on stdin:

- ``{"op": "send", "n": N}``: N requests through ``get_core_engine_for_request``; answers the ranks.
- ``{"op": "in_flight"}``: the in-flight count per engine that this server's dispatcher reads.
"""

from __future__ import annotations

import json
import sys

from tests.support import vllm as sv


def main() -> int:
    index, count, engines = (int(a) for a in sys.argv[1:4])
    sv.install()
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    from dpboard.integrations.vllm import dispatch
    from tests.integrations.vllm.real.conftest import vllm_config
    from tests.support.vllm_engine import make_client, picked_ranks

    client = make_client(vllm_config(engines, api_servers=count), engines, client_index=index, client_count=count)
    state = dispatch.client_dispatch(client)
    setattr(client, dispatch.STATE, state)
    print(json.dumps({"ready": True}), flush=True)
    sent = 0
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "send":
            ranks = picked_ranks(client, [f"s{index}-{sent + i}" for i in range(command["n"])])
            sent += command["n"]
            print(json.dumps({"ranks": ranks}), flush=True)
        elif command["op"] == "in_flight":
            state.reader.read_array()
            print(json.dumps({"in_flight": state.reader.in_flight.tolist()}), flush=True)
    state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
