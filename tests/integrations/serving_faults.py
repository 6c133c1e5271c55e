"""What the SGLang and vLLM serving suites share: starting only where their environment is built, a
fault in dpboard's pick while a file exists (tests/support/serving_fault), and the dispatchers'
counts in the board's dispatch record."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dpboard.board.dispatch_record import read_dispatch_record
from tests.support.procutil import wait_until


def need_environment(reason: str | None, what: str) -> None:
    """Skip, saying ``reason``, where the serving environment is not built; in CI fail instead."""
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run {what}: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def fault_file(tmp_path_factory) -> Path:
    """While this file exists, dpboard's pick raises in the server's dispatching processes."""
    return tmp_path_factory.mktemp("fault") / "raise-in-pick"


def dispatchers(server: Any) -> list:
    """The live rows of the server's board's dispatch record."""
    return [row for row in read_dispatch_record(server.board) or [] if row.alive]


def counted(server: Any, counter: str) -> int:
    return sum(row.counts[counter] for row in dispatchers(server))


def counted_by_then(server: Any, counter: str, at_least: int, ask: Callable[[str, int], Any], *,
                    settle: float = 120.0) -> None:
    """Wait until ``counter`` summed over the live dispatchers reaches ``at_least``, asking one-token
    requests meanwhile: a row is published from its dispatcher's refreshes, so the last counts
    before a pause wait for the next request that dispatcher picks (docs/FORMAT.md), and with two
    API servers only a request that reaches the one that counted brings them."""

    def in_the_record() -> bool:
        if counted(server, counter) >= at_least:
            return True
        ask("bring the counts", 1)
        return counted(server, counter) >= at_least

    assert wait_until(in_the_record, timeout=settle, interval=0.5), (counter, at_least, dispatchers(server))


def answered_while_dpboard_fails(server: Any, fault_file: Path, ask: Callable[[str, int], Any], *, n: int = 8,
                                 settle: float = 120.0) -> list:
    """The answers to ``ask(text, max_tokens)``, ``n`` times while dpboard's pick raises in the
    server; then until the dispatch record counts the ``n`` fallbacks (it is published from the
    dispatchers' refreshes: later requests bring it)."""
    before = counted(server, "fallbacks")
    fault_file.touch()
    try:
        answers = [ask(f"while dpboard fails {i}", 4) for i in range(n)]
    finally:
        fault_file.unlink()
    counted_by_then(server, "fallbacks", before + n, ask, settle=settle)
    return answers
