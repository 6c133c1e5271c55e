"""The ZMQ ends the tests play: a scheduler's PULL, a client's PUSH. Neither lingers at close, so a
test that fails never hangs in Context.term()."""

from __future__ import annotations

import zmq


def bound_pull(ctx: zmq.Context, endpoint: str, *, rcvhwm: int | None = None) -> zmq.Socket:
    """A PULL socket bound at ``endpoint``."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.bind(endpoint)
    return sock


def connected_push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A PUSH socket connected to ``endpoint``."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock
