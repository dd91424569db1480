"""Two worker hosts on one machine and the metrics exporter's port (issue 45, item 1).

Before: the second `harvest worker` died with `OSError: [Errno 98] Address already in use`,
naming neither the address nor the setting, as both bound the default 9464. Now the default
port moves aside to a free one, and a port the operator chose is refused with a message that
names the address and both ways to choose another (`fleet.metrics`)."""

from __future__ import annotations

import os
import socket

import httpx
import pytest

from fleet.metrics import Exporter, MetricsPortTaken, serve_worker_metrics

TOKEN = "t" * 32


@pytest.fixture
def taken_port():
    """A port some other process of this machine listens on."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield holder.getsockname()[1]
    holder.close()


def test_a_taken_default_port_moves_aside_and_serves(taken_port, tmp_path):
    exporter = serve_worker_metrics(os.getpid, tmp_path, tmp_path / "counts", TOKEN, port=taken_port, chosen=False)
    try:
        assert exporter.port != taken_port
        response = httpx.get(exporter.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert response.status_code == 200 and "harvest_process_" in response.text
        assert httpx.get(exporter.url, timeout=30).status_code == 401  # the token still guards it
    finally:
        exporter.close()


def test_two_default_exporters_on_one_machine_both_serve(tmp_path):
    """The story: two roles, each with the defaults (the same default port for both)."""
    first = serve_worker_metrics(os.getpid, tmp_path, tmp_path / "a", TOKEN, port=0, chosen=True)
    default = first.port  # whatever port the first took is "the default" the second asks for
    second = serve_worker_metrics(os.getpid, tmp_path, tmp_path / "b", TOKEN, port=default, chosen=False)
    try:
        assert second.port != default
        for exporter in (first, second):
            assert httpx.get(exporter.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).status_code == 200
    finally:
        first.close()
        second.close()


def test_a_chosen_port_that_is_taken_is_refused_naming_address_and_setting(taken_port):
    with pytest.raises(MetricsPortTaken) as refused:
        Exporter(None, TOKEN, "127.0.0.1", taken_port, chosen=True)
    message = str(refused.value)
    assert f"127.0.0.1:{taken_port}" in message
    assert "--metrics-port" in message and "HARVEST_METRICS_PORT" in message
    assert "Errno" not in message
