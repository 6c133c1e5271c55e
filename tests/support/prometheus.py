"""A real Prometheus server for the tests: loopback only, a temporary storage directory, a port the
kernel picks, and always stopped.

``prometheus_binary()`` is the binary or None (Debian's ``prometheus`` package; .ci/run installs
it). ``running_prometheus(tmp, targets)`` starts one that scrapes ``targets`` every second and
yields a ``Prometheus`` whose ``query`` goes through the HTTP API (``/api/v1/query``).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.procutil import stop

SCRAPE_INTERVAL_S = 1
_LISTENING = re.compile(r'msg="Listening on" address=(127\.0\.0\.1:\d+)')


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@dataclass
class Prometheus:
    url: str
    log: Path

    def api(self, path: str, **params: str) -> Any:
        """The ``data`` of a successful API answer; an AssertionError naming the error otherwise."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as resp:
            doc = json.load(resp)
        assert doc["status"] == "success", f"{path} {params}: {doc}"
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector: ``[{"metric": {labels}, "value": [time, "text"]}, ...]``."""
        data = self.api("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: {data}"
        return data["result"]

    def value(self, expr: str) -> float:
        """The one sample an instant query answers."""
        result = self.query(expr)
        assert len(result) == 1, f"{expr} answered {len(result)} samples: {result}"
        return float(result[0]["value"][1])

    def wait_for(self, expr: str, timeout: float) -> list[dict[str, Any]]:
        """Polls ``expr`` until it answers at least one sample (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() >= deadline:
                raise AssertionError(f"Prometheus answered nothing for {expr} within {timeout} s; "
                                     f"targets: {self.api('/api/v1/targets')['activeTargets']}")
            time.sleep(0.2)


def _config(targets: list[str]) -> str:
    quoted = ", ".join(f"'{t}'" for t in targets)
    return (
        "global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
        f"  scrape_timeout: {SCRAPE_INTERVAL_S}s\n"
        f"  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
        "scrape_configs:\n"
        "  - job_name: dpboard\n"
        "    static_configs:\n"
        f"      - targets: [{quoted}]\n"
    )


@contextlib.contextmanager
def running_prometheus(tmp: Path, targets: list[str], binary: str) -> Iterator[Prometheus]:
    """A Prometheus scraping ``targets`` (host:port) every second, listening on 127.0.0.1 only."""
    config = tmp / "prometheus.yml"
    config.write_text(_config(targets))
    log = tmp / "prometheus.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             "--web.listen-address=127.0.0.1:0", "--storage.tsdb.retention.time=1h"],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    try:
        url = _wait_listening(proc, log, timeout=60)
        prom = Prometheus(url, log)
        _wait_ready(prom, proc, timeout=60)
        yield prom
    finally:
        stop(proc)


def _wait_listening(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _LISTENING.search(log.read_text())
        if found:
            return f"http://{found.group(1)}"
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({proc.returncode}) before listening:\n{log.read_text()}")
        time.sleep(0.05)
    raise AssertionError(f"prometheus did not say where it listens within {timeout} s:\n{log.read_text()}")


def _wait_ready(prom: Prometheus, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({proc.returncode}):\n{prom.log.read_text()}")
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass  # not serving yet (503 or refused)
        time.sleep(0.1)
    raise AssertionError(f"prometheus was not ready within {timeout} s:\n{prom.log.read_text()}")
