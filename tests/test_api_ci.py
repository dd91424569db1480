"""`.ci/run` stops, with a message that says why, when PostgreSQL is not answering at
127.0.0.1:5432, or Redis at 127.0.0.1:6379 (the scaled control plane's, issue 45), instead of
installing for minutes and letting their tests fail one by one (before: a CI without it
learned it test by test, or, earlier, went green on skips)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.api_fixtures import free_port

REPO = Path(__file__).resolve().parent.parent


def test_the_projects_postgresql_answers():
    out = subprocess.run([str(REPO / ".ci" / "postgres_ready")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_ci_stops_before_the_tests_when_nothing_answers():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    out = subprocess.run([str(REPO / ".ci" / "run")], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HARVEST_CI_POSTGRES": address})
    assert out.returncode == 1
    assert f"PostgreSQL is not answering at {address}" in out.stderr
    assert "stopping before the tests" in out.stderr
    assert time.monotonic() - started < 30 and "pytest" not in out.stdout + out.stderr  # make test never ran


@pytest.mark.parametrize(("check", "reads", "says"), [("postgres_ready", 8, "not PostgreSQL"), ("redis_ready", 16, "not a Redis")])
def test_a_port_held_by_something_else_is_refused(check, reads, says):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def answer_wrongly():
        conn, _ = server.accept()
        with conn:
            conn.recv(reads)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer_wrongly, daemon=True).start()
    try:
        out = subprocess.run([str(REPO / ".ci" / check), f"127.0.0.1:{server.getsockname()[1]}"],
                             capture_output=True, text=True, timeout=30)
    finally:
        server.close()
    assert out.returncode == 1 and says in out.stderr, out.stderr


def test_the_projects_redis_answers():
    out = subprocess.run([str(REPO / ".ci" / "redis_ready")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_ci_stops_before_the_tests_when_redis_does_not_answer():
    address = f"127.0.0.1:{free_port()}"
    out = subprocess.run([str(REPO / ".ci" / "run")], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HARVEST_CI_REDIS": address})
    assert out.returncode == 1, out.stderr
    assert f"Redis is not answering at {address}" in out.stderr
    assert "stopping before the tests: Redis is required" in out.stderr
    assert "pytest" not in out.stdout + out.stderr  # make test never ran
