"""`dpboard serve` as the tests run it: a real server process on a free loopback port, plain HTTP
requests to it, and a Prometheus text page read back as samples."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.names import ROOT
from tests.support.procutil import kill, read_line

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def start_server(name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """``dpboard serve NAME --port 0 ...``; returns the process and the URL its first line names."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpboard.cli", "serve", name, "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        line = read_line(proc, 30)
    except AssertionError:
        kill(proc)
        raise
    url = line.split(" on ")[1].split()[0]
    assert url.startswith("http://127.0.0.1:"), line
    return proc, url


def get(url: str, timeout: float = 10) -> tuple[int, str, str]:
    """(status, content type, body) of a GET; error statuses are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text page, by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
