"""Where a GPU group's engine server lives on a host, and how its errors travel.

Per group, under `$HARVEST_HOME/engines/`: `<group>.sock` (the Unix socket), `<group>.pid`,
`<group>.lock` (held by whoever starts the server, so two runs never start two), and one
`authkey` for the host, created owner-only: `multiprocessing.connection`'s handshake refuses
any process that cannot read it. The log is `$HARVEST_HOME/logs/engine-<group>.log`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import secrets
import signal
import time
from pathlib import Path

from harvest.private_files import private_dir, write_private

__all__ = ["unix_socket_path", "GroupFiles", "group_name", "send", "receive", "error_reply", "raise_error", "stop_engine_servers"]

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

    def server_pid(self) -> int | None:
        try:
            pid = int(self.pid.read_text())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            return None

    def forget(self, pid: int) -> None:
        """Remove the socket and pid file if they are still this server's."""
        try:
            if int(self.pid.read_text()) != pid:
                return
        except (OSError, ValueError):
            return
        self.socket.unlink(missing_ok=True)
        self.pid.unlink(missing_ok=True)


def send(conn, message) -> None:
    """One message, pickled plainly. (`Connection.send` pickles with multiprocessing's
    ForkingPickler, for which torch moves tensors into shared memory handed over by a
    multiprocessing resource sharer that only processes it spawned itself can reach.)"""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn):
    return pickle.loads(conn.recv_bytes())


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


def stop_engine_servers(home: Path, timeout: float = 15.0) -> list[int]:
    """SIGTERM every engine server of this host's home (a worker stopping), SIGKILL after
    `timeout`; returns their pids."""
    folder = Path(home) / "engines"
    pids = []
    for pid_file in folder.glob("*.pid") if folder.is_dir() else []:
        pid = GroupFiles(home, pid_file.stem).server_pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                break
            time.sleep(0.1)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return pids
