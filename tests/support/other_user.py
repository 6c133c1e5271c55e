"""Run a function as another, unprivileged user (uid and gid 65534) in a forked child: the real
thing a hostile local user does, for the tests of file ownership. Needs root."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

NOBODY = 65534


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch a process to another user (uid 65534)")


def as_nobody(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child running as uid/gid 65534; returns its result (JSON-able), or raises
    an AssertionError carrying the exception the child raised. No exec: the interpreter under /root
    may not be executable by that user."""
    need_root()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out = {"ok": fn()}
            except BaseException as e:  # reported to the parent, which decides
                out = {"error": type(e).__name__, "message": str(e)}
            os.write(write_end, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child running as uid 65534 failed"
    out = json.loads(b"".join(chunks))
    if "error" in out:
        raise AssertionError(f"as uid 65534: {out['error']}: {out['message']}")
    return out["ok"]


def error_as_nobody(fn: Callable[[], Any]) -> tuple[str, str]:
    """(exception type name, message) that ``fn()`` raises as uid 65534; fails if it raises none."""
    def wrapped() -> list[str]:
        try:
            fn()
        except BaseException as e:
            return [type(e).__name__, str(e)]
        return ["", ""]

    kind, message = as_nobody(wrapped)
    assert kind, "expected an error as uid 65534, got none"
    return kind, message
