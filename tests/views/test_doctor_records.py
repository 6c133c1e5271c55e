"""What ``dpboard doctor``, ``top``'s findings line and serve's ``/v1/doctor`` make of a file at the
dispatch record's name that dpboard refuses (a sparse petabyte, another user's file): a finding
of its own, never a crash and never "healthy"; and of a trusted user's record text: shown with its
control characters escaped, never sent to the terminal raw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dpboard.board.dispatch_record import (
    DISPATCH_HEADER_DTYPE,
    DISPATCH_HEADER_SIZE,
    DISPATCH_MAGIC,
    DISPATCH_VERSION,
    ROW_DTYPE,
    dispatch_record_path,
    record_size,
    row_size,
)
from dpboard.board.liveness import process_start_ticks
from dpboard.snapshot import pack_owner
from tests.support.names import ROOT
from tests.support.other_user import as_nobody, need_root
from tests.support.procutil import stop
from tests.support.serving import get, start_server
from tests.views.test_doctor import by_id, writers

pytestmark = pytest.mark.timeout(120)
SLOTS = 2
SPARSE = 2**50
ESCAPES = "\x1b[2J\x1b]0;owned\x07"  # clear the screen, retitle the terminal


@pytest.fixture(autouse=True)
def planted_record(board_name):
    yield
    Path(dispatch_record_path(board_name)).unlink(missing_ok=True)


def _plant(board: str, *, size: int | None = None, mode: int = 0o600, method: str = "") -> None:
    header = bytearray(DISPATCH_HEADER_SIZE)
    view = np.ndarray((), DISPATCH_HEADER_DTYPE, header)
    view["magic"], view["version"], view["rows"], view["slots"] = DISPATCH_MAGIC, DISPATCH_VERSION, 1, SLOTS
    view["row_size"], view["creator_pid"] = row_size(SLOTS), 1
    row = bytearray(row_size(SLOTS))
    if method:
        head = np.ndarray((), ROW_DTYPE, row)
        head["holder"] = pack_owner(1, process_start_ticks(1))  # pid 1 runs: a live dispatcher
        head["method"], head["mode"] = method.encode(), b"\x1b[31m"
    fd = os.open(dispatch_record_path(board), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    os.write(fd, bytes(header) + bytes(row))
    os.fchmod(fd, mode)
    if size is not None:
        os.ftruncate(fd, size)
    os.close(fd)
    assert size is not None or os.path.getsize(dispatch_record_path(board)) == record_size(1, SLOTS)


def _views(name: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """``dpboard doctor --json``, ``top --json``'s doctor document and ``/v1/doctor`` of board ``name``."""
    doctor = subprocess.run([sys.executable, "-m", "dpboard.cli", "doctor", name, "--window", "0.3", "--json", *extra],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    top = subprocess.run([sys.executable, "-m", "dpboard.cli", "top", name, "--json", *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and "Traceback" not in top.stderr, top.stderr
    proc, url = start_server(name, *extra)
    try:
        status, _, body = get(url + "/v1/doctor")
    finally:
        stop(proc)
    assert status == 200, body
    return doctor, json.loads(top.stdout)["doctor"], json.loads(body)


def _refused_everywhere(name: str, words: str, *extra: str) -> None:
    doctor, top, served = _views(name, *extra)
    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr, doctor.stderr
    report = json.loads(doctor.stdout)
    for doc in (report, top, served):
        assert doc["healthy"] is False
        finding = by_id(doc)["record_refused"]
        assert finding["severity"] == "warning" and words in finding["evidence"], finding
        assert "no_record" not in by_id(doc)


def test_a_sparse_petabyte_record_is_a_finding_in_every_view(board_name):
    _plant(board_name, size=SPARSE)
    with writers(board_name, SLOTS, {0: [], 1: []}):
        _refused_everywhere(board_name, f"is {SPARSE} bytes, but 1 rows of {SLOTS} slots make")


def test_another_users_file_at_the_records_name_is_a_finding_in_every_view(board_name):
    need_root()
    as_nobody(lambda: _plant(board_name, mode=0o644))
    with writers(board_name, SLOTS, {0: [], 1: []}):
        _refused_everywhere(board_name, "belongs to uid 65534")
        text = subprocess.run([sys.executable, "-m", "dpboard.cli", "top", board_name, "--once"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    (line,) = [ln for ln in text.stdout.splitlines() if ln.startswith("doctor:")]
    assert "the dispatch record is refused" in line and "healthy" not in line, line


def _without_escapes(run: Callable[[], subprocess.CompletedProcess]) -> str:
    res = run()
    assert res.returncode in (0, 1), res.stderr
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout
    return res.stdout


def test_a_trusted_records_control_characters_are_escaped_in_every_view(board_name):
    need_root()
    as_nobody(lambda: _plant(board_name, mode=0o644, method=ESCAPES))
    trust = ("--trust-uid", "65534")
    with writers(board_name, SLOTS, {0: [], 1: []}):
        text = _without_escapes(lambda: subprocess.run(
            [sys.executable, "-m", "dpboard.cli", "doctor", board_name, "--window", "0.3", *trust], cwd=ROOT,
            capture_output=True, text=True, timeout=60))
        _without_escapes(lambda: subprocess.run([sys.executable, "-m", "dpboard.cli", "top", board_name, "--once",
                                                 *trust], cwd=ROOT, capture_output=True, text=True, timeout=60))
        doctor, top, served = _views(board_name, *trust)
    assert "method \\x1b[2J\\x1b]0;owned\\x07, disaggregation \\x1b[31m" in text, text
    for doc in (json.loads(doctor.stdout), top, served):
        assert "\x1b" not in json.dumps(doc, ensure_ascii=False)
