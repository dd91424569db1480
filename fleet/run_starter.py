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
  variable, `flows.deploy`): what the worker starts per run. It hands its stdio, environment
  and directory to the host's starter, passes on the signals it gets (a cancel's SIGTERM) and
  exits as the run did. Without a starter (a worker started some other way, or one still
  preloading) it becomes `python -m prefect.engine` itself. It imports only the standard
  library, so it starts in tens of milliseconds.

Both ends check the other's uid (SO_PEERCRED) before trusting it: the starter runs code for
whoever connects, and the launcher hands over the worker's environment, credentials included;
a socket served by another user is not used (the run starts the slow way).

A launcher that dies (SIGKILL after a cancel's grace, or with its worker) takes its run along:
the starter sees its connection close and kills the run's process group. Forking is safe
because the starter stays single-threaded (one `selectors` loop, no threads), never touches
CUDA and holds no open client; the child sets Prefect's and our settings again from its own
environment before the engine reads them (a run whose environment would change anything else
a preloaded module read at import is started afresh: `REREAD`).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["STARTER_ENV", "REREAD", "launch", "connect_to_starter", "RunStarter", "main"]

STARTER_ENV = "HARVEST_RUN_STARTER"
_LENGTH = struct.Struct("!I")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Variables a run may set differently from its worker and still fork: read again in the child
# (Prefect's, ours, fsspec's; `_settings_from_environment`) or only when a client is made
# (AWS_*). A run that sets any other (PYTHONPATH, HF_HOME, …) is started afresh instead.
REREAD = ("PREFECT_", "HARVEST_", "FSSPEC_", "AWS_")


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


def _engine_argv(argv: list[str]) -> list[str]:
    """The command a run is without a starter: Prefect's own."""
    return [sys.executable, "-m", "prefect.engine", *argv]


def launch(argv: list[str]) -> int:
    """Run this flow run in the host's starter; returns its exit status."""
    path = os.environ.get(STARTER_ENV)
    sock = connect_to_starter(path) if path else None
    if sock is None:
        os.execv(sys.executable, _engine_argv(argv))
    payload = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "argv": argv}).encode()
    socket.send_fds(sock, [_LENGTH.pack(len(payload))], [0, 1, 2])
    sock.sendall(payload)
    answers = sock.makefile("rb")
    first = answers.readline()
    if not first.startswith(b"pid "):  # refused, or the starter went away before forking
        os.execv(sys.executable, _engine_argv(argv))
    pid = int(first.split()[1])
    for signum in _FORWARDED:
        signal.signal(signum, lambda s, f: _signal(pid, s))
    line = answers.readline()
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
    except ProcessLookupError:
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# --- the starter -----------------------------------------------------------------------------


def preload() -> None:
    """Import what every run imports, and the tokenizer classes of the models found here (the
    tokenizers themselves are not kept: their files may change)."""
    import prefect.engine  # noqa: F401
    import prefect.flow_engine  # noqa: F401

    import flows.harvest  # noqa: F401  (torch, the harvest core, the warm-engine client)
    from harvest.registry import load_registry
    from harvest.tokenize import load_tokenizer

    for model in load_registry().all():
        if model.path is not None:
            try:
                load_tokenizer.__wrapped__(model.path)
            except Exception as exc:  # the run will say what is wrong with it; this is only speed
                print(f"run starter: no preload of {model.name}'s tokenizer: {exc}", flush=True)


@dataclass
class _Fork:
    """What the child of a fork carries out of the starter's loop: the run to become."""

    payload: dict  # the launcher's env, cwd and argv
    fds: list[int]  # its stdin, stdout, stderr
    worker_env: dict[str, str]
    set_by_preload: dict[str, str]


class RunStarter:
    """The worker's parent on a worker host: preloads, then forks a run per launcher."""

    def __init__(self, path: str, worker_argv: list[str]):
        self.path = path
        self.worker_argv = worker_argv
        self.runs: dict[int, socket.socket] = {}  # run pid -> its launcher's connection
        self.worker_status: int | None = None
        self.selector: selectors.BaseSelector | None = None
        self.worker_env: dict[str, str] = {}
        self.set_by_preload: dict[str, str] = {}
        self.wake: tuple[socket.socket, socket.socket] | None = None

    def serve(self) -> int | _Fork:
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
        selector.register(self.wake[0], selectors.EVENT_READ, "wake")
        try:
            preload()
            # What the imports set themselves (a fresh run's imports would set the same).
            self.set_by_preload = {k: v for k, v in os.environ.items() if self.worker_env.get(k) != v and k != STARTER_ENV}
            listener = self._listen()
            selector.register(listener, selectors.EVENT_READ, None)
            print(f"run starter: pid {os.getpid()}, worker pid {worker.pid}, socket {self.path}", flush=True)
        except Exception as exc:  # the launchers find no starter and start their runs themselves
            print(f"run starter: not serving, runs start the slow way: {exc!r}", flush=True)
            listener = None
        while self.worker_status is None:
            for key, _ in selector.select(timeout=0.5):
                if key.data is None:
                    fork = self._start(listener)
                    if fork is not None:
                        return fork
                elif key.data == "wake":
                    _drain(self.wake[0])
                else:
                    self._launcher_left(key.fileobj, key.data)
            self._reap(worker.pid)
        self._stop_runs()
        if listener is not None:
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
        listener.listen(16)
        return listener

    def _start(self, listener: socket.socket) -> _Fork | None:
        """Fork a run for the launcher that connected; None in the starter itself. A launch
        refused here closes the connection before any pid is sent: the launcher then starts
        its run itself."""
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            uid = _peer_uid(conn)
            if uid != os.getuid():
                raise PermissionError(f"a launcher of uid {uid}")
            conn.settimeout(10)
            message, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, 3)
            payload = json.loads(_read_exactly(conn, _LENGTH.unpack(message)[0]))
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
        except (OSError, ValueError, struct.error) as exc:
            print(f"run starter: refused a launch: {exc!r}", flush=True)
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for other in [listener, conn, *self.wake, *self.runs.values()]:
                other.close()
            self.selector.close()
            return _Fork(payload, fds, self.worker_env, self.set_by_preload)
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        conn.sendall(f"pid {pid}\n".encode())
        self.runs[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        return None

    def _launcher_left(self, conn: socket.socket, pid: int) -> None:
        """The launcher closed its end (only ever EOF: it sends nothing after the launch)."""
        self.selector.unregister(conn)
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
            conn = self.runs.pop(pid, None)
            if conn is not None:
                if conn in self.selector.get_map():
                    self.selector.unregister(conn)
                try:
                    conn.sendall(f"exit {code}\n".encode())
                except OSError:
                    pass  # its launcher is gone already
                conn.close()

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


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 16))
        if not chunk:
            raise ValueError("launcher closed mid-message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def become_run(fork: _Fork) -> None:
    """In the forked child: take the launcher's place and run `prefect.engine` as `-m` would."""
    import runpy
    import warnings

    os.setpgid(0, 0)  # its own group: the starter can stop the run and whatever it starts
    for signum in (*_FORWARDED, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    for target, fd in zip((0, 1, 2), fork.fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(fork.payload["cwd"])
    env = fork.payload["env"]
    worker_env = fork.worker_env
    stale = sorted(k for k in set(env) | set(worker_env) if env.get(k) != worker_env.get(k) and not k.startswith(REREAD))
    if stale:  # the run's environment changes what a preloaded module read at import
        changes = ", ".join(f"{k}={env.get(k)!r} (worker: {worker_env.get(k)!r})" for k in stale)
        print(f"run starter: this run sets {changes}: started afresh", flush=True)
        os.execve(sys.executable, _engine_argv(fork.payload["argv"]), env)
    os.environ.clear()
    os.environ.update({**fork.set_by_preload, **env})
    _settings_from_environment()
    sys.argv = ["prefect.engine", *fork.payload["argv"]]
    # Preloaded, as intended: `-m` on an imported module is what this is for.
    warnings.filterwarnings("ignore", message="'prefect.engine' found in sys.modules", category=RuntimeWarning)
    runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


def _settings_from_environment() -> None:
    """Settings read at import in the starter, read again from the run's own environment:
    every variable of the `REREAD` prefixes takes effect."""
    import fsspec.config
    import prefect.context
    from prefect.logging.configuration import setup_logging

    from harvest.settings import get_settings

    prefect.context.refresh_global_settings_context()
    setup_logging(incremental=False)
    get_settings.cache_clear()
    fsspec.config.conf.clear()
    fsspec.config.set_conf_files(os.environ.get("FSSPEC_CONFIG_DIR", fsspec.config.default_conf_dir), fsspec.config.conf)
    fsspec.config.set_conf_env(fsspec.config.conf)


def main(argv: list[str]) -> int:
    if argv[:1] != ["--socket"]:
        return launch(argv)
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit("usage: python -m fleet.run_starter --socket PATH -- WORKER COMMAND …")
    outcome = RunStarter(argv[1], argv[3:]).serve()
    if isinstance(outcome, _Fork):
        become_run(outcome)
        return 0
    return outcome if outcome >= 0 else 128 - outcome


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
