"""``ready_server``: a server whose port was taken between ``free_port()``'s pick and its bind is
started again on a fresh port; any other failure is raised at once. Real processes (Python's own
``http.server``) and a real listening socket."""

from __future__ import annotations

import socket
import sys
import urllib.request

import pytest

from tests.support.session_server import SessionServer, free_port, ready_server

pytestmark = pytest.mark.timeout(120)


class Http(SessionServer):
    name = "http.server"


def http_server(port: int) -> Http:
    return Http([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], {}, port=port)


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_server_whose_port_was_taken_starts_again_on_another(taken_port):
    made = []

    def make() -> Http:
        made.append(http_server(taken_port if not made else free_port()))
        return made[-1]

    server = ready_server(make, timeout=60, path="/")
    try:
        assert len(made) == 2 and server is made[1] and server.port != taken_port
        assert made[0].proc.returncode is not None and not made[0].log_path.exists()  # gone, its log too
        with urllib.request.urlopen(f"{server.url}/", timeout=30) as answer:
            assert answer.status == 200 and server.ready_after > 0
    finally:
        server.kill()
        server.log_path.unlink(missing_ok=True)


def test_ports_taken_every_time_give_up_after_the_attempts(taken_port):
    made = []

    def make() -> Http:
        made.append(http_server(taken_port))
        return made[-1]

    with pytest.raises(AssertionError, match="(?i)address already in use"):
        ready_server(make, attempts=2, timeout=60, path="/")
    assert len(made) == 2 and all(m.proc.returncode is not None for m in made)
    made[-1].log_path.unlink(missing_ok=True)


def test_any_other_failure_to_start_is_raised_at_once():
    made = []

    def make() -> Http:
        port = free_port()
        made.append(Http([sys.executable, "-c", "raise SystemExit('no model here')"], {}, port=port))
        return made[-1]

    with pytest.raises(AssertionError, match="no model here"):
        ready_server(make, timeout=60, path="/")
    assert len(made) == 1
    made[0].log_path.unlink(missing_ok=True)
