"""Flow runs forked from a preloaded process: a run starts in milliseconds, not seconds.

Prefect's process worker starts every flow run as a fresh `python -m prefect.engine`. On the
2-core dev box that is ~3.5 s of imports (Prefect, torch, transformers' tokenizer classes, the
flow) before the flow's first line: more than a warm job's whole work once its engine stays
loaded (`harvest.warm`). On a worker host this module removes that cost with a fork server:

- `python -m fleet.run_starter --socket S -- prefect worker start …` (the *starter*; what
  `fleet.processes.start_worker` runs on a worker host): starts the Prefect worker as its child,
  with `HARVEST_RUN_STARTER=S` in its environment; imports what a run imports; then listens on
  the Unix socket S. For each run it is asked for, it forks: the child takes the asker's
  stdin/stdout/stderr, environment and working directory and runs `prefect.engine` as
  `python -m` would. The signals it gets go to the worker (a worker stopping), and it ends
  when the worker does, stopping any run still going.
- `python -m fleet.run_starter` (the *launcher*; the harvest deployments' `command` job
  variable, `fleet.processes.RUN_COMMAND`): what the worker starts per run. It hands its stdio, environment
  and directory to the host's starter, passes on the signals it gets (a cancel's SIGTERM) and
  exits as the run did. Without a starter (a worker started some other way, one still
  preloading, or one that refuses to fork) it becomes `python -m prefect.engine` itself. It
  imports only the standard library, so it starts in tens of milliseconds.

The exchange: the launcher sends a 4-byte length with its stdio descriptors (SCM_RIGHTS), then
that many bytes of JSON (env, cwd, argv); the starter answers `pid N` once forked (or
`refused WHY`), and `exit CODE` when the run ends. Both ends check the other's uid
(SO_PEERCRED) first: the starter runs code for whoever connects, and the launcher hands over
the worker's environment, credentials included.

The starter is the parent of the host's worker and of every run: if it ends, the host stops.
So no launcher can end it: the loop never waits on one (non-blocking accept, reads driven by
the selector, a deadline per launch), no write to one can raise, and a launcher dying at any
point of the exchange costs only its own run (its connection closing kills the run's group).
What it preloads, when it may fork and how a child becomes the run: `fleet.run_fork`.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

from fleet.run_fork import (
    Fork, become_run, engine_argv, fork_hazard, fork_in_group, preload, preload_tokenizers, settle_thread_pools,
)

__all__ = ["STARTER_ENV", "HANDSHAKE_S", "launch", "connect_to_starter", "RunStarter", "main"]

STARTER_ENV = "HARVEST_RUN_STARTER"
_LENGTH = struct.Struct("!I")
_MAX_LAUNCH = 1 << 24  # an environment, a directory and an argv: far less; more is not a launcher
HANDSHAKE_S = 10.0
"""How long a launcher may take to send its whole launch once connected."""
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The signals the starter handles itself: blocked across fork, so no handler of the starter's
# (forwarding to its worker, waking its loop) ever runs in a run.
_HANDLED = (*_FORWARDED, signal.SIGCHLD)


# --- the launcher (standard library only) ----------------------------------------------------


def _peer_uid(sock: socket.socket) -> int:
    """The uid of the process on the other end of a Unix socket, from the kernel (SO_PEERCRED)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]


def connect_to_starter(path: str) -> socket.socket | None:
    """A connection to the host's starter at `path`, or None: nothing listens there, or what
    listens runs as another user. The launcher sends the worker's whole environment (its
    credentials) down this socket, so it checks who listens before sending a byte."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        uid = _peer_uid(sock)
    except OSError:
        sock.close()
        return None
    if uid != os.getuid():
        sock.close()
        print(f"run starter: {path} is served by uid {uid}, not by us (uid {os.getuid()}): not used, "
              "this run starts the slow way", file=sys.stderr, flush=True)
        return None
    return sock


def launch(argv: list[str]) -> int:
    """Run this flow run in the host's starter; returns its exit status."""
    path = os.environ.get(STARTER_ENV)
    sock = connect_to_starter(path) if path else None
    if sock is None:
        os.execv(sys.executable, engine_argv(argv))
    payload = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "argv": argv}).encode()
    answers = sock.makefile("rb")
    try:
        socket.send_fds(sock, [_LENGTH.pack(len(payload))], [0, 1, 2])
        sock.sendall(payload)
        first = answers.readline()
    except OSError:  # the starter went away mid-launch
        first = b""
    if not first.startswith(b"pid "):  # refused, or the starter went away before forking
        if first.startswith(b"refused "):
            print(f"run starter: not forked ({first[8:].decode(errors='replace').strip()}): this run starts the slow way",
                  file=sys.stderr, flush=True)
        os.execv(sys.executable, engine_argv(argv))
    pid = int(first.split()[1])
    for signum in _FORWARDED:
        signal.signal(signum, lambda s, f: _signal(pid, s))
    try:
        line = answers.readline()
    except OSError:
        line = b""
    if not line:  # the starter itself died; the run may go on (an orphan): wait it out
        while _alive(pid):
            time.sleep(0.5)
        return 1
    code = int(line.split()[1])
    if code < 0:  # killed by a signal: end the same way, so the worker reads the same status
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):  # gone, or the pid is now another user's
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# --- the starter -----------------------------------------------------------------------------


@dataclass
class _Launch:
    """A launcher connected whose launch is not all here yet."""

    conn: socket.socket
    deadline: float
    data: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)

    def payload(self) -> dict | None:
        """The launch once whole (None before); ValueError when it is not one."""
        if len(self.data) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self.data)
        if length > _MAX_LAUNCH:
            raise ValueError(f"a launch of {length} bytes")
        if len(self.data) < _LENGTH.size + length:
            return None
        if len(self.data) > _LENGTH.size + length:
            raise ValueError("bytes after the launch")
        payload = json.loads(self.data[_LENGTH.size:])
        if len(self.fds) != 3 or not isinstance(payload, dict) or not (
            isinstance(payload.get("env"), dict) and isinstance(payload.get("cwd"), str)
            and isinstance(payload.get("argv"), list)
        ):
            raise ValueError(f"not a launch: {sorted(payload) if isinstance(payload, dict) else type(payload).__name__}, "
                             f"{len(self.fds)} descriptors")
        return payload

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.conn.close()


_LISTENER, _WAKE = "listener", "wake"


class RunStarter:
    """The worker's parent on a worker host: preloads, then forks a run per launcher.

    preload: what to import before serving (`preload`; returns what it preloaded, or None);
    refresh: what to preload after a run ends, given that (`preload_tokenizers`: checkpoints
    built since); handshake_s: how long one launcher may take over its launch before it is
    dropped (`HANDSHAKE_S`).
    """

    def __init__(self, path: str, worker_argv: list[str], *, preload=preload, refresh=preload_tokenizers,
                 handshake_s: float = HANDSHAKE_S):
        self.path = path
        self.worker_argv = worker_argv
        self.preload = preload
        self.refresh = refresh
        self.preloaded: set[str] | None = None  # None: nothing to refresh (no preload, or a test's own)
        self.handshake_s = handshake_s
        self.runs: dict[int, socket.socket | None] = {}  # run pid -> its launcher's connection, if still there
        self.worker_status: int | None = None
        self.selector: selectors.BaseSelector | None = None
        self.worker_env: dict[str, str] = {}
        self.set_by_preload: dict[str, str] = {}
        self.wake: tuple[socket.socket, socket.socket] | None = None

    def serve(self) -> int | Fork:
        """The worker's exit status once it ends, or, in a forked child, the run to become."""
        self.worker_env = {**os.environ, STARTER_ENV: self.path}
        worker = subprocess.Popen(self.worker_argv, env=self.worker_env)
        for signum in _FORWARDED:
            signal.signal(signum, lambda s, f: _signal(worker.pid, s))
        selector = self.selector = selectors.DefaultSelector()
        # A run that ends wakes the loop at once (SIGCHLD through a wakeup socket), so its
        # launcher, and the worker's slot, are freed without waiting for the next tick.
        self.wake = socket.socketpair()
        for end in self.wake:
            end.setblocking(False)
        signal.set_wakeup_fd(self.wake[1].fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda s, f: None)
        selector.register(self.wake[0], selectors.EVENT_READ, _WAKE)
        listener = None
        try:
            self.preloaded = self.preload()
            # What the imports set themselves (a fresh run's imports would set the same).
            self.set_by_preload = {k: v for k, v in os.environ.items() if self.worker_env.get(k) != v and k != STARTER_ENV}
            settle_thread_pools()
            listener = self._listen()
            selector.register(listener, selectors.EVENT_READ, _LISTENER)
            hazard = fork_hazard()
            print(f"run starter: pid {os.getpid()}, worker pid {worker.pid}, socket {self.path}"
                  + (f"; not forking while it has {hazard}: runs start the slow way" if hazard else ""), flush=True)
        except Exception as exc:  # the launchers find no starter and start their runs themselves
            print(f"run starter: not serving, runs start the slow way: {exc!r}", flush=True)
        while self.worker_status is None:
            for key, _ in selector.select(timeout=self._tick()):
                fork = self._handle(key)
                if fork is not None:
                    return fork
            self._expire()
            self._reap(worker.pid)
        self._stop_runs()
        if listener is not None:
            with contextlib.suppress(FileNotFoundError):  # removed under us: the status still counts
                os.unlink(self.path)
        return self.worker_status

    def _listen(self) -> socket.socket:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)  # owner-only from the first moment: a connection runs code as us
        try:
            listener.bind(self.path)
        finally:
            os.umask(old)
        listener.listen(64)
        listener.setblocking(False)
        return listener

    def _tick(self) -> float:
        deadlines = [key.data.deadline for key in self.selector.get_map().values() if isinstance(key.data, _Launch)]
        return max(0.0, min([time.monotonic() + 0.5, *deadlines]) - time.monotonic())

    def _handle(self, key: selectors.SelectorKey) -> Fork | None:
        """One ready socket; a fork in the child only. Whatever goes wrong with one launcher is
        that launcher's: the starter logs it, drops that connection and serves on."""
        try:
            if key.data == _LISTENER:
                self._accept(key.fileobj)
            elif key.data == _WAKE:
                _drain(key.fileobj)
            elif isinstance(key.data, _Launch):
                return self._read(key.data)
            else:
                self._from_launcher(key.fileobj, key.data)
        except Exception as exc:
            print(f"run starter: dropped a launcher: {exc!r}", flush=True)
            if key.data not in (_LISTENER, _WAKE):
                self._forget(key.data if isinstance(key.data, _Launch) else key.fileobj)
        return None

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # one connection aborted (or no descriptor left): not the listener's end
                print(f"run starter: accept failed: {exc!r}", flush=True)
                return
            try:
                conn.setblocking(False)
                uid = _peer_uid(conn)
            except OSError:
                conn.close()
                continue
            if uid != os.getuid():
                print(f"run starter: refused a launch: a launcher of uid {uid}", flush=True)
                conn.close()
                continue
            self.selector.register(conn, selectors.EVENT_READ, _Launch(conn, time.monotonic() + self.handshake_s))

    def _read(self, launch: _Launch) -> Fork | None:
        try:
            data, fds, flags, _ = socket.recv_fds(launch.conn, 1 << 16, 3)
        except BlockingIOError:
            return None
        except OSError as exc:  # reset by a launcher that died
            data, fds, flags = b"", [], 0
            print(f"run starter: a launcher left mid-launch: {exc!r}", flush=True)
        launch.fds += fds
        if flags & socket.MSG_CTRUNC or len(launch.fds) > 3:
            raise ValueError("more descriptors than stdin, stdout and stderr")
        if not data:
            self._forget(launch)  # it died or gave up before its launch was whole: nothing to run
            return None
        launch.data += data
        payload = launch.payload()
        return None if payload is None else self._fork(launch, payload)

    def _fork(self, launch: _Launch, payload: dict) -> Fork | None:
        """Fork the run (None in the starter). A launch refused here gets `refused WHY` and no
        pid: its launcher starts the run itself."""
        self.selector.unregister(launch.conn)
        hazard = fork_hazard()
        if hazard is not None:
            print(f"run starter: not forking a run: this process has {hazard}; it starts the slow way", flush=True)
            _send(launch.conn, f"refused this starter has {hazard}\n")
            launch.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = fork_in_group(_HANDLED)
        except OSError as exc:
            print(f"run starter: fork failed: {exc!r}; the run starts the slow way", flush=True)
            _send(launch.conn, f"refused fork failed: {exc}\n")
            launch.close()
            return None
        if pid == 0:
            try:
                self._close_all_but(launch)
            except BaseException as exc:  # never back into the loop: that would be a second starter
                os.write(2, f"run starter: a forked run could not start: {exc!r}\n".encode())
                os._exit(70)
            return Fork(payload, launch.fds, self.worker_env, self.set_by_preload)
        for fd in launch.fds:
            os.close(fd)
        launch.fds = []
        if _send(launch.conn, f"pid {pid}\n"):
            self.runs[pid] = launch.conn
            self.selector.register(launch.conn, selectors.EVENT_READ, pid)
        else:  # its launcher is gone already: the run goes with it, as if it had left later
            self.runs[pid] = None
            launch.conn.close()
            _signal(-pid, signal.SIGKILL)
        return None

    def _close_all_but(self, launch: _Launch) -> None:
        """In a forked run: close the starter's sockets, and other launches' descriptors, so
        the run holds nothing of theirs (a launcher learns of the starter's end by EOF)."""
        for key in list(self.selector.get_map().values()):
            key.data.close() if isinstance(key.data, _Launch) else key.fileobj.close()
        for conn in self.runs.values():
            if conn is not None:
                conn.close()
        for end in self.wake:
            end.close()
        self.selector.close()
        launch.conn.close()

    def _forget(self, what: _Launch | socket.socket) -> None:
        """Drop a launcher's connection (and a pending launch's descriptors)."""
        self._unregister(what.conn if isinstance(what, _Launch) else what)
        what.close()

    def _unregister(self, conn: socket.socket) -> None:
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):  # not registered (any more), or closed already
            pass

    def _expire(self) -> None:
        now = time.monotonic()
        for key in list(self.selector.get_map().values()):
            if isinstance(key.data, _Launch) and key.data.deadline <= now:
                print(f"run starter: refused a launch: not whole within {self.handshake_s:g} s", flush=True)
                self._forget(key.data)

    def _from_launcher(self, conn: socket.socket, pid: int) -> None:
        """A launcher whose run is going: it sends nothing, so this is its end (EOF or reset)."""
        try:
            if conn.recv(4096):
                return  # not a goodbye; nothing a launcher says after its launch means anything
        except BlockingIOError:
            return
        except OSError:
            pass
        self._unregister(conn)
        _signal(-pid, signal.SIGKILL)  # its worker gave up on it; the run goes with it

    def _reap(self, worker_pid: int) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if pid == worker_pid:
                self.worker_status = code
            ran = pid in self.runs
            conn = self.runs.pop(pid, None)
            if conn is not None:
                self._unregister(conn)
                _send(conn, f"exit {code}\n")
                conn.close()
            if ran:
                self._refresh()

    def _refresh(self) -> None:
        """After a run ended: preload what it may have added (a checkpoint it built), then let
        the thread pools its imports started stop, as after the first preload."""
        if self.preloaded is None or fork_hazard() is not None:
            return
        try:
            before = self.preloaded
            self.preloaded = self.refresh(before)
            if self.preloaded != before:
                settle_thread_pools()
                print(f"run starter: preloaded {', '.join(sorted(self.preloaded - before))} after a run"
                      + (f"; not forking while it has {hazard}" if (hazard := fork_hazard()) else ""), flush=True)
        except Exception as exc:  # only speed: the runs read what they need themselves
            print(f"run starter: preloading after a run failed: {exc!r}", flush=True)

    def _stop_runs(self, grace_s: float = 10.0) -> None:
        """The worker has ended: runs still going get SIGTERM, then SIGKILL after the grace."""
        for pid in self.runs:
            _signal(-pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.runs and time.monotonic() < deadline:
            time.sleep(0.1)
            self._reap(-1)
        for pid in list(self.runs):
            _signal(-pid, signal.SIGKILL)
        self._reap(-1)


def _send(conn: socket.socket, line: str) -> bool:
    """One line to a launcher; False when it is gone. A launcher dying at any point is its own
    run's business, never the starter's: no write to one may raise."""
    try:
        conn.sendall(line.encode())
        return True
    except OSError:
        return False


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass


def main(argv: list[str]) -> int:
    if argv[:1] != ["--socket"]:
        return launch(argv)
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit("usage: python -m fleet.run_starter --socket PATH -- WORKER COMMAND …")
    outcome = RunStarter(argv[1], argv[3:]).serve()
    if isinstance(outcome, Fork):
        become_run(outcome)
        return 0
    return outcome if outcome >= 0 else 128 - outcome


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
