"""testbed.netns: hosts reach the root namespace only through the bridge, not its 127.0.0.1;
kill_all leaves nothing running; nothing is left behind, also when a test fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from testbed.netns import Host, Network

PYTHON = sys.executable if os.path.exists(sys.executable) else "/usr/bin/python3"

# Run inside a host: try each (host, port) and say what happened, as one JSON line.
PROBE = r"""
import json, socket, sys, urllib.request
out = {}
for target in sys.argv[1:]:
    if target.startswith("http"):
        try:
            out[target] = urllib.request.urlopen(target, timeout=3).read().decode()
        except Exception as e:
            out[target] = f"error: {e!r}"
    else:
        host, port = target.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            out[target] = "connected"
        except OSError as e:
            out[target] = f"error: {e!r}"
print(json.dumps(out))
"""


def probe(host: Host, *targets: str) -> dict[str, str]:
    proc = subprocess.run(host.argv([PYTHON, "-I", "-c", PROBE, *targets]), capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


class _Echo(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = f"hello {self.client_address[0]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve(address: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((address, 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _wait_in(host: Host, pid: int) -> None:
    """Until `pid` has entered the host: a Popen returns before `ip netns exec` has switched
    namespaces, and until then the process is not the host's (kill_all would not see it)."""
    deadline = time.monotonic() + 5
    while pid not in host.pids():
        assert time.monotonic() < deadline, f"{pid} never entered {host.netns}"
        time.sleep(0.01)


def _ours(network: Network) -> tuple[str, str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return ("\n".join(l for l in links.splitlines() if network.token in l), "\n".join(l for l in spaces.splitlines() if network.token in l))


def test_hosts_reach_the_gateway_but_not_the_root_loopback():
    loopback = socket.create_server(("127.0.0.1", 0))  # a root-namespace service on 127.0.0.1 only
    lo_port = loopback.getsockname()[1]
    with Network() as network:
        server = _serve(network.gateway)
        url = f"http://{network.gateway}:{server.server_address[1]}/"
        try:
            a, b = network.add_host("a"), network.add_host("b")
            assert a.ip != b.ip and a.netns != b.netns
            for host in (a, b):
                seen = probe(host, url, f"127.0.0.1:{lo_port}", "127.0.0.1:5432")
                # The server sees the host's own address: the request crossed the bridge.
                assert seen[url] == f"hello {host.ip}"
                assert seen[f"127.0.0.1:{lo_port}"].startswith("error"), seen
                assert seen["127.0.0.1:5432"].startswith("error"), seen  # PostgreSQL stays out of reach
            # From the root namespace the same loopback service answers: the isolation is the namespace's.
            socket.create_connection(("127.0.0.1", lo_port), timeout=2).close()
        finally:
            server.shutdown()
            server.server_close()
            loopback.close()
    assert _ours(network) == ("", "")


def test_host_to_host_and_kill_all():
    with Network() as network:
        a, b = network.add_host("a"), network.add_host("b")
        # A server inside b, which forks children (a process tree, as a worker's flow runs are).
        port = 8000
        server = subprocess.Popen(
            b.argv([PYTHON, "-I", "-m", "http.server", "--bind", b.ip, str(port)]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "NETNS_PROBE": "1"},
        )
        tree = subprocess.Popen(b.argv(["sh", "-c", "sleep 300 & sleep 300 & wait"]))
        url = f"http://{b.ip}:{port}/"
        deadline = time.monotonic() + 10
        while not probe(a, url)[url].startswith("<!DOCTYPE"):
            assert time.monotonic() < deadline, "server in host b never answered host a"
            time.sleep(0.1)
        # `ip netns exec` execs in place: the Popen's pid is the server itself, with our env.
        _wait_in(b, tree.pid)
        assert server.pid in b.pids()
        with open(f"/proc/{server.pid}/environ", "rb") as f:
            assert b"NETNS_PROBE=1" in f.read().split(b"\0")
        deadline = time.monotonic() + 5
        while len(b.pids()) < 4:  # the server, sh and its two sleeps
            assert time.monotonic() < deadline, b.pids()
            time.sleep(0.01)
        assert a.pids() == []
        # b's own loopback is b's: a cannot reach b's server through 127.0.0.1.
        assert probe(a, f"127.0.0.1:{port}")[f"127.0.0.1:{port}"].startswith("error")

        b.kill_all()
        assert b.pids() == []
        assert server.wait(timeout=5) == -9 and tree.wait(timeout=5) == -9
        # No DNS in a host, and a lookup fails at once (not after the machine's 10 s timeout).
        started = time.monotonic()
        lookup = subprocess.run(
            a.argv([PYTHON, "-I", "-c", f"import socket; socket.getfqdn({a.ip!r}); socket.gethostbyname('example.invalid')"]),
            capture_output=True, text=True, timeout=20,
        )
        assert "gaierror" in lookup.stderr and time.monotonic() - started < 3
        # The host survives the loss of its processes; a runs on.
        assert probe(a, f"{network.gateway}:1")  # still answers (refused, but ran)
    assert _ours(network) == ("", "")


def test_teardown_when_the_test_fails_with_processes_running():
    network = Network()
    with pytest.raises(RuntimeError, match="boom"):
        with network:
            host = network.add_host("doomed")
            sleeper = subprocess.Popen(host.argv(["sleep", "300"]), start_new_session=True)
            _wait_in(host, sleeper.pid)
            raise RuntimeError("boom")
    assert _ours(network) == ("", "") and network.leftovers() == []
    network.close()  # idempotent
    network.__exit__(None, None, None)


def test_parallel_add_host_and_unique_names():
    from concurrent.futures import ThreadPoolExecutor

    with Network() as one, Network() as two:
        assert one.bridge != two.bridge and one.subnet != two.subnet
        with ThreadPoolExecutor(4) as pool:
            hosts = list(pool.map(one.add_host, ["w0", "w1", "w2", "w3"]))
        assert len({h.ip for h in hosts}) == 4 and len({h.netns for h in hosts}) == 4
        with pytest.raises(ValueError):
            one.add_host("w0")
        for name in ("w0", "w1"):
            assert len(two.add_host(name).netns) > 0  # same host names on another network: no clash
    assert _ours(one) == ("", "") and _ours(two) == ("", "")
