"""One vLLM engine core in a process of its own, running vLLM's own busy loop (``run_busy_loop``).

``python -m tests.support.vllm_engine_proc RANK DP``: vLLM 0.33.0's modules behind tests/support/vllm.py's
stand-ins, dpboard's general plugin loaded by vLLM's loader (from the environment: VLLM_PLUGINS,
DPBOARD_VLLM_BOARD), and an engine core of DP rank RANK of DP (tests/support/vllm_engine.py, each
step 5 ms as a model's would be). Its stdin plays the input socket: one JSON request a line,
``{"id": ..., "tokens": N, "max_tokens": M}``, handed to the engine as its input thread does (an
``ADD`` on ``input_queue``); its stdout plays the output socket: ``{"finished": [ids]}`` per outputs
message. ``{"ready": true}`` first, once the busy loop waits for work.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from tests.support import vllm as sv


def main() -> int:
    rank, dp = int(sys.argv[1]), int(sys.argv[2])
    sv.install()
    import vllm.v1.engine.core  # noqa: F401  (loaded before the plugins, as in an engine core)
    from vllm.plugins import load_general_plugins
    from vllm.v1.request import Request

    load_general_plugins()
    from tests.support.vllm_engine import ADD, TinyScheduler, engine_request, make_engine, vllm_config

    scheduler = TinyScheduler(num_gpu_blocks=1025)
    model_step = scheduler.step

    def step() -> tuple[dict, bool]:
        time.sleep(0.005)
        return model_step()

    engine = make_engine(vllm_config(dp, rank), scheduler)
    engine.step_fn = step

    def intake() -> None:
        for line in sys.stdin:
            doc = json.loads(line)
            request = engine_request(doc["id"], doc["tokens"], doc["max_tokens"])
            engine.input_queue.put_nowait((ADD, (Request.from_engine_core_request(request, None), 0)))

    def output() -> None:
        while True:
            _, outputs = engine.output_queue.get()
            print(json.dumps({"finished": sorted(outputs.finished_requests)}), flush=True)

    threading.Thread(target=intake, daemon=True).start()
    threading.Thread(target=output, daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    engine.run_busy_loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
