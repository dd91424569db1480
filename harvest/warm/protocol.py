"""Where a GPU group's engine server lives on a host, and how its errors travel.

Per group, under `$HARVEST_HOME/engines/`: `<group>.sock` (the Unix socket), `<group>.pid`
(the server's pid and its process start time: a pid alone may name another process once the
server is gone and the kernel hands the number out again, and that one must never be
signalled), `<group>.lock` (held by whoever starts the server, so two runs never start two), and one
`authkey` for the host, created owner-only: `multiprocessing.connection`'s handshake refuses
any process that cannot read it. The log is `$HARVEST_HOME/logs/engine-<group>.log`.

A shard's capture (`capture_into`) comes with the run's staged shard file itself: its
descriptor follows the request over the socket (`send_fd`, SCM_RIGHTS). The server writes each
prompt's values into it at their place and hashes them as it writes (`harvest.shard.file.
ShardFill`), then answers one `("ok", ShardCapture)` with the statistics and the file's digest.
So the values cross no socket: one host pass from the engine's buffer into the file (RESULTS,
"Host passes"). A capture without a file (`capture`: an engine's caller that wants the values
back) streams them: each prompt's values come as a small `("value", position, shape, dtype)`
message followed by the tensor's raw bytes, then the `("ok", …)`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

import psutil

from harvest.private_files import private_dir, write_private

if TYPE_CHECKING:  # only the values' two functions need torch: the API's assessing children import this without it
    import torch

__all__ = [
    "unix_socket_path", "GroupFiles", "group_name", "send", "receive", "send_value", "receive_value", "send_fd", "receive_fd", "error_reply", "raise_error",
    "stop_engine_servers", "process_started", "start_child", "stop_child", "child_main",
]

# A Unix socket path holds at most 107 bytes; deep homes (test folders) fall back to /tmp.
_MAX_SOCKET_PATH = 100


def unix_socket_path(directory: Path, name: str) -> Path:
    """`<directory>/<name>.sock`, or the same name in a private folder under /tmp when that path
    is too long for a Unix socket (one that is ours and 0700, else `NotPrivate`: a socket in a
    folder another user controls could be swapped for theirs)."""
    path = Path(directory) / f"{name}.sock"
    if len(str(path)) > _MAX_SOCKET_PATH:
        short = Path("/tmp") / f"harvest-engines-{hashlib.sha1(str(directory).encode()).hexdigest()[:12]}"
        path = private_dir(short) / f"{name}.sock"
    return path


def group_name(devices: str | None) -> str:
    """`cpu` for a slot without devices (all such slots of a host share one engine), else
    `gpu-0-1` for the slot's GPU ids (`"0,1"`, as a placement records them)."""
    ids = [d.strip() for d in (devices or "").split(",") if d.strip()]
    return "gpu-" + "-".join(ids) if ids else "cpu"


class GroupFiles:
    def __init__(self, home: Path, group: str):
        self.home = Path(home)
        self.group = group
        self.dir = self.home / "engines"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = unix_socket_path(self.dir, group)
        self.pid = self.dir / f"{group}.pid"
        self.lock = self.dir / f"{group}.lock"
        self.log = self.home / "logs" / f"engine-{group}.log"

    def authkey(self) -> bytes:
        path = self.dir / "authkey"
        write_private(path, secrets.token_hex(32), replace=False)  # the first writer wins
        return path.read_bytes()

    def record_pid(self) -> None:
        """Write this process's pid and start time as the group's server."""
        pid = os.getpid()
        self.pid.write_text(f"{pid} {process_started(pid)}")

    def _recorded(self) -> tuple[int, str] | None:
        try:
            pid, started = self.pid.read_text().split()
            return int(pid), started
        except (OSError, ValueError):  # absent, or not written by `record_pid`: nothing to trust
            return None

    def server_pid(self) -> int | None:
        """The group's server pid, when that process still runs and is the one that wrote the
        pid file (same start time); None otherwise, so a reused pid is never signalled."""
        recorded = self._recorded()
        if recorded is None:
            return None
        pid, started = recorded
        return pid if process_started(pid) == started else None

    def forget(self, pid: int) -> None:
        """Remove the socket and pid file if they are still this server's."""
        recorded = self._recorded()
        if recorded is None or recorded[0] != pid:
            return
        self.socket.unlink(missing_ok=True)
        self.pid.unlink(missing_ok=True)


def process_started(pid: int) -> str | None:
    """When process `pid` started (seconds since the epoch, to the clock tick, as text), or
    None when none runs (a zombie has ended): with the pid it names one process for good."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"{process.create_time():.2f}"
    except (psutil.Error, ValueError):
        return None


def send(conn, message) -> None:
    """One message, pickled plainly. (`Connection.send` pickles with multiprocessing's
    ForkingPickler, for which torch moves tensors into shared memory handed over by a
    multiprocessing resource sharer that only processes it spawned itself can reach.)"""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn):
    return pickle.loads(conn.recv_bytes())


def send_value(conn, position: int, value: torch.Tensor) -> None:
    """One prompt's values: a header message, then the tensor's bytes straight from its memory."""
    import torch

    value = value.detach().contiguous()
    send(conn, ("value", position, list(value.shape), str(value.dtype).removeprefix("torch.")))
    # Flat: a Connection sends len(memoryview) bytes, which for more dimensions is the first.
    conn.send_bytes(value.view(torch.uint8).reshape(-1).numpy() if value.numel() else b"")


def receive_value(conn, header: tuple) -> tuple[int, torch.Tensor]:
    """The prompt position and tensor of a `("value", …)` header just received, read from the
    raw message that follows it."""
    import torch

    _, position, shape, dtype_name = header
    value = torch.empty(shape, dtype=getattr(torch, dtype_name))
    # CPython's Connection reads the message into a buffer of its own, then copies it here: two
    # host passes. Shards never come this way (`capture_into` writes them into the run's file).
    received = conn.recv_bytes_into(value.view(torch.uint8).reshape(-1).numpy() if value.numel() else bytearray(1))
    if received != value.numel() * value.element_size():
        raise EOFError(f"a value of shape {shape} came with {received} bytes")
    return position, value


def send_fd(conn: Connection, fd: int) -> None:
    """Hand descriptor `fd` to the other end (SCM_RIGHTS, with one byte of data): it gets its
    own descriptor of the same open file."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno())) as sock:
        socket.send_fds(sock, [b"F"], [fd])


def receive_fd(conn: Connection) -> int:
    """The descriptor `send_fd` handed over, owned by the caller (close it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno())) as sock:
        data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if data != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise EOFError("the shard file's descriptor did not come")
    return fds[0]


def error_reply(exc: BaseException) -> tuple[str, bytes]:
    """An exception as it travels back to the client: pickled whole when it can be (the
    service's own errors keep their class and code), else as a RuntimeError with its text."""
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)
    except Exception:
        payload = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return ("error", payload)


def raise_error(payload: bytes) -> None:
    raise pickle.loads(payload)


# -- children that talk to their parent over a socket pair (the API's inline engines and assessors)

CHILD_STOP_S = 10.0
"""How long a child told to stop (its end of the socket closed) has before it is killed."""


def start_child(module: str, env: Mapping[str, str]) -> tuple[subprocess.Popen, Connection]:
    """`python -m module --fd N` in a session of its own (so it can lower its own scheduling
    group), and this side of the socket pair it shares; it reads EOF when this side closes or
    this process dies. The module's `main` is `child_main`."""
    mine, theirs = socket.socketpair()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", module, "--fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True, env=dict(env),
        )
    finally:
        theirs.close()
    return child, Connection(mine.detach())


def stop_child(child: subprocess.Popen) -> None:
    """Wait for a child told to stop (its end closed), then kill it."""
    try:
        child.wait(CHILD_STOP_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def child_main(prog: str, description: str, serve: Callable[[Connection], int], argv: list[str] | None = None) -> int:
    """A `start_child` child's command line: `--fd N`, the socket it serves."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--fd", type=int, required=True, help="the socket shared with the parent")
    return serve(Connection(parser.parse_args(argv).fd))


def stop_engine_servers(home: Path, timeout: float = 15.0) -> list[int]:
    """SIGTERM every engine server of this host's home (a worker stopping), SIGKILL after
    `timeout`; returns their pids. Each is signalled only while it is still the process its
    pid file names (`GroupFiles.server_pid`, checked again before the SIGKILL)."""
    folder = Path(home) / "engines"
    servers: list[tuple[int, str]] = []
    for pid_file in folder.glob("*.pid") if folder.is_dir() else []:
        pid = GroupFiles(home, pid_file.stem).server_pid()
        started = process_started(pid) if pid is not None else None
        if started is not None and _signal_if(pid, started, signal.SIGTERM):
            servers.append((pid, started))
    deadline = time.monotonic() + timeout
    for pid, started in servers:
        while time.monotonic() < deadline and process_started(pid) == started:
            time.sleep(0.1)
        if _signal_if(pid, started, signal.SIGKILL):
            # Gone when this returns, not merely signalled: a busy host may take a moment to
            # end a killed process, and a worker that stops leaves no process behind.
            killed_by = time.monotonic() + 10
            while time.monotonic() < killed_by and process_started(pid) == started:
                time.sleep(0.05)
    return [pid for pid, _ in servers]


def _signal_if(pid: int, started: str, signum: int) -> bool:
    """Send `signum` to `pid` only if it is still the process that started at `started`."""
    if process_started(pid) != started:
        return False
    try:
        os.kill(pid, signum)
    except OSError:
        return False
    return True
