"""One vLLM engine core in a process of its own, running vLLM's own busy loop (``run_busy_loop``).

``python -m tests.support.vllm_engine_proc RANK DP``: vLLM 0.33.0's modules behind tests/support/vllm.py's
stand-ins, dpboard's general plugin loaded by vLLM's loader (from the environment: VLLM_PLUGINS,
DPBOARD_VLLM_BOARD), and an engine core of DP rank RANK of DP (tests/support/vllm_engine.py: vLLM's
own step and scheduler, the model a stand-in whose every step takes 5 ms as a model's would). Its stdin plays the input socket: one JSON request a line,
``{"id": ..., "tokens": N, "max_tokens": M}``, handed to the engine as its input thread does (an
``ADD`` on ``input_queue``); its stdout plays the output socket: ``{"finished": [ids]}`` per outputs
message that finishes any. ``{"ready": true}`` first, once the busy loop waits for work. SIGTERM asks
it to shut down as vLLM's ``run_engine_core`` does; ``{"stopped": true}`` once its busy loop has
ended, then ``TEARDOWN`` seconds (vLLM's teardown) before its ``shutdown()``.

``serve(rank, dp, input_address, output_address)`` runs the same engine core as the target of a
process vLLM's way (``multiprocessing`` spawn, as ``CoreEngineProcManager`` starts engine cores) and
talks vLLM's ZMQ sockets as ``EngineCoreProc`` does: a DEALER with the engine's identity on the API
server's ROUTER input socket (an empty message first, as the engine's handshake ends), a PUSH on
its PULL output socket, every ``EngineCoreOutputs`` encoded by vLLM's ``MsgpackEncoder``. One
stand-in: an ADD's payload is decoded by msgspec without a type, fields named by vLLM's own
``EngineCoreRequest.__struct_fields__``, because vLLM's ``MsgpackDecoder(EngineCoreRequest)``
cannot be built without torch (msgspec refuses the stand-in ``torch.Tensor`` field types).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from tests.support import vllm as sv

TEARDOWN = 3.0  # seconds between the busy loop's end and shutdown(), as vLLM's teardown takes


def _engine(rank: int, dp: int):
    sv.install()
    import vllm.v1.engine.core  # noqa: F401  (loaded before the plugins, as in an engine core)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from tests.support.vllm_engine import real_engine

    return real_engine(dp, rank, num_blocks=1025, step_seconds=0.005)


def main() -> int:
    rank, dp = int(sys.argv[1]), int(sys.argv[2])
    engine = _engine(rank, dp)
    from tests.support.vllm_engine import ADD, as_request, engine_request

    def intake() -> None:
        for line in sys.stdin:
            doc = json.loads(line)
            request = engine_request(doc["id"], doc["tokens"], doc["max_tokens"])
            engine.input_queue.put_nowait((ADD, (as_request(engine, request), 0)))

    def output() -> None:
        while True:
            _, outputs = engine.output_queue.get()
            if not outputs.finished_requests:  # a step's tokens and stats, nothing finished
                continue
            print(json.dumps({"finished": sorted(outputs.finished_requests)}), flush=True)

    def asked_to_stop(signum: int, frame: object) -> None:
        # what vLLM's run_engine_core does at SIGTERM: a shutdown requested, the idle loop woken
        from vllm.v1.engine import EngineCoreRequestType
        from vllm.v1.engine.core import EngineShutdownState

        engine.shutdown_state = EngineShutdownState.REQUESTED
        engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    signal.signal(signal.SIGTERM, asked_to_stop)
    threading.Thread(target=intake, daemon=True).start()
    threading.Thread(target=output, daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    try:
        engine.run_busy_loop()
    except SystemExit:
        pass
    # the busy loop has ended: the engine reads no more requests; then vLLM's teardown (workers,
    # process groups: seconds in a real deployment, TEARDOWN here) before its shutdown()
    sys.stdout.write(json.dumps({"stopped": True}) + "\n")
    sys.stdout.flush()
    time.sleep(TEARDOWN)
    engine.shutdown()
    return 0


def serve(rank: int, dp: int, input_address: str, output_address: str) -> None:
    engine = _engine(rank, dp)
    import msgspec
    import zmq
    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackEncoder

    from tests.support.vllm_engine import ADD, as_request, engine_request

    ctx = zmq.Context()
    fields = EngineCoreRequest.__struct_fields__

    def intake() -> None:
        socket = make_zmq_socket(ctx, input_address, zmq.DEALER, identity=rank.to_bytes(2, "little"), bind=False)
        socket.send(b"")
        while True:
            kind, *payload = socket.recv_multipart()
            if kind != ADD.value:
                continue
            doc = dict(zip(fields, msgspec.msgpack.decode(payload[0]), strict=False))
            request = engine_request(doc["request_id"], len(doc["prompt_token_ids"]),
                                     doc["sampling_params"]["max_tokens"])
            engine.input_queue.put_nowait((ADD, (as_request(engine, request), 0)))

    def output() -> None:
        socket = make_zmq_socket(ctx, output_address, zmq.PUSH, bind=False)
        encoder = MsgpackEncoder()
        while True:
            _, outputs = engine.output_queue.get()
            outputs.engine_index = rank
            socket.send_multipart(encoder.encode(outputs))

    threading.Thread(target=intake, daemon=True).start()
    threading.Thread(target=output, daemon=True).start()
    engine.run_busy_loop()


if __name__ == "__main__":
    sys.exit(main())
