"""A run's side of the warm engines: `open_engine` and the `RemoteEngine` it returns."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from multiprocessing.connection import Client, Connection

from harvest.capture import ShardCapture
from harvest.capture_spec import CaptureSpec
from harvest.cpu_share import with_passive_waits
from harvest.credentials import handed
from harvest.engines.base import Engine, EngineLoad, ValueSink
from harvest.engines.choice import choose_engine, load_engine
from harvest.engines.limits import EngineLimits
from harvest.heap import TrimEvery
from harvest.private_files import open_private_log
from harvest.registry import ModelInfo
from harvest.settings import Settings
from harvest.shard.file import FileDigest, StagedShard
from harvest.warm.protocol import GroupFiles, group_name, raise_error, receive, receive_value, send, send_fd

__all__ = ["RemoteEngine", "EngineLost", "open_engine", "connect", "engine_status", "engine_server_env"]

# A server lost mid-shard is started again this many times for one shard before the shard
# fails (its task's own retry then tries once more).
RECONNECTS = 2


class EngineLost(ConnectionError):
    """The engine server went away (killed, out of memory) while it had our request."""


def engine_server_env(environ: Mapping[str, str], settings: Settings) -> dict[str, str]:
    """The environment an engine server is handed: the run's configuration (`settings`, as
    variables), and of the run's environment what it uses.

    - No secret at all (`harvest.credentials.handed` with no needs): it reads weights from the
      host's disk and answers runs on a Unix socket, so it needs neither storage credentials,
      nor the job store, nor the metrics token; a server taken over (a model file that runs
      code when loaded) reaches none of them.
    - Nothing of Prefect's (`PREFECT_*`): it never calls Prefect, so neither its URL nor its
      password; nor the run's own identity (`PREFECT__FLOW_RUN_ID` and the rest of Prefect's
      per-run context): the server serves every later run of the host, and a process carrying
      one run's id after it ended would pass for that run to whoever looks.
    - Of `HARVEST_*`, the run's configuration as it was handed to the run (a test's or a
      notebook's `Settings` as well as a worker's environment), less the metrics token.
    """
    env = {k: v for k, v in handed(environ).items() if not k.startswith(("PREFECT_", "HARVEST_"))}
    return with_passive_waits({**env, **settings.as_environment(leave_out=frozenset({"metrics_token"}))})


def _start_server(files: GroupFiles, settings: Settings) -> None:
    """Start the group's engine server in its own session, so it outlives the run that
    started it (a cancel signals the run's process group, not the server's), with its own
    environment (`engine_server_env`), never the run's whole one."""
    log = open_private_log(files.log, "a")  # owner-only, as every log (`harvest.private_files`)
    subprocess.Popen(
        [sys.executable, "-m", "harvest.warm.server", "--group", files.group],
        env=engine_server_env(os.environ, settings),
        cwd=str(settings.home),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()


def _try_connect(files: GroupFiles) -> Connection | None:
    try:
        return Client(str(files.socket), family="AF_UNIX", authkey=files.authkey())
    except (FileNotFoundError, ConnectionRefusedError):
        return None


def connect(files: GroupFiles, settings: Settings) -> Connection:
    """A connection to the group's server, starting it if none answers."""
    conn = _try_connect(files)
    if conn is not None:
        return conn
    with open(files.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter per group; the others find it running
        conn = _try_connect(files)
        if conn is not None:
            return conn
        _start_server(files, settings)
        deadline = time.monotonic() + settings.engine_start_timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
            conn = _try_connect(files)
            if conn is not None:
                return conn
    tail = files.log.read_text()[-1500:] if files.log.exists() else ""
    raise RuntimeError(f"the engine server of group {files.group} did not answer within {settings.engine_start_timeout_s:.0f} s:\n{tail}")


class RemoteEngine(Engine):
    """An engine in the group's server; `capture` is one request, asked again (after the
    server is started again) if the server dies with it."""

    def __init__(self, model: ModelInfo, files: GroupFiles, setting: str, settings: Settings):
        self.model = model
        self.files = files
        self.setting = setting
        self.settings = settings
        self.conn: Connection | None = None
        self.load = self._load()
        self.name = self.load.engine

    def _call(self, *message):
        return self._call_with_fd(message, None)

    def _load(self) -> EngineLoad:
        self.conn = connect(self.files, self.settings)
        reply = self._call("load", self.model.name, self.setting)
        self._versions = reply["versions"]
        return EngineLoad(reply["engine"], reply["reason"], reply["warm"], reply["load_s"], self.files.group)

    def capture(self, prompts: list[list[int]], spec: CaptureSpec, *, batch_size: int | None = None,
                sink: ValueSink | None = None) -> ShardCapture:
        """One shard, its values handed to `sink` as they arrive (or returned, without one).
        Asked again whole after a lost server: every prompt comes again, and lands again at
        its own place, so a shard is one whole answer or none."""
        for attempt in range(RECONNECTS + 1):
            try:
                if self.conn is None:
                    self._load()
                return self._capture(prompts, spec, batch_size, sink)
            except EngineLost:
                if attempt == RECONNECTS:
                    raise
        raise AssertionError("unreachable")

    def _capture(self, prompts: list[list[int]], spec: CaptureSpec, batch_size: int | None, sink: ValueSink | None) -> ShardCapture:
        if isinstance(sink, StagedShard):
            return self._capture_into(prompts, spec, batch_size, sink)
        return self._capture_streamed(prompts, spec, batch_size, sink)

    def _capture_into(self, prompts: list[list[int]], spec: CaptureSpec, batch_size: int | None, staged: StagedShard) -> ShardCapture:
        """The server fills the staged file itself, handed over as its descriptor, and answers
        its digest with the statistics: no value crosses the socket."""
        capture = self._call_with_fd(("capture_into", prompts, list(spec.layers), spec.directions, batch_size, staged.first_index),
                                     staged.fd)
        staged.filled_elsewhere(FileDigest(**capture.extra.pop("file")))
        return capture

    def _call_with_fd(self, message: tuple, fd: int | None):
        """One request (with a descriptor after it, if `fd`) and its answer."""
        assert self.conn is not None
        try:
            send(self.conn, message)
            if fd is not None:
                send_fd(self.conn, fd)
            status, reply = receive(self.conn)
        except (EOFError, OSError) as exc:
            self.conn.close()
            self.conn = None
            raise EngineLost(f"the engine server of group {self.files.group} went away: {exc!r}") from exc
        if status == "error":
            raise_error(reply)
        return reply

    def _capture_streamed(self, prompts: list[list[int]], spec: CaptureSpec, batch_size: int | None, sink: ValueSink | None) -> ShardCapture:
        assert self.conn is not None
        values: list = [None] * len(prompts)
        trim = TrimEvery(self.settings.engine_piece_bytes)  # the values' buffers, freed once written
        try:
            send(self.conn, ("capture", prompts, list(spec.layers), spec.directions, batch_size))
            while (message := receive(self.conn))[0] == "value":
                position, value = receive_value(self.conn, message)
                try:
                    if sink is None:
                        values[position] = value
                    else:
                        sink(position, value)
                        trim.passed(value.numel() * value.element_size())
                except BaseException:
                    # The server is still sending this shard: this connection is out of step.
                    self.close()
                    raise
        except (EOFError, OSError) as exc:
            if self.conn is None:
                raise  # the sink's own error (a full disk), not the server's
            self.conn.close()
            self.conn = None
            raise EngineLost(f"the engine server of group {self.files.group} went away: {exc!r}") from exc
        status, reply = message
        if status == "error":
            raise_error(reply)
        if sink is None:
            reply.values = values
        return reply

    def status(self) -> dict:
        return self._call("status")

    def versions(self) -> dict[str, str]:
        return dict(self._versions)

    def close(self) -> None:
        """Hand the engine back (the server keeps it loaded for the next job)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def open_engine(model: ModelInfo, placement: dict | None, settings: Settings) -> tuple[Engine, EngineLoad]:
    """The run's engine: its host group's warm one on a worker host (`placement` is its
    slot), else one loaded here; either within the limits `settings` give."""
    started = time.perf_counter()
    if placement is None:
        choice = choose_engine(settings.engine)
        engine = load_engine(model, choice, EngineLimits.of(settings))
        return engine, EngineLoad(engine.name, choice.reason, False, time.perf_counter() - started)
    files = GroupFiles(settings.home, group_name(placement.get("devices")))
    engine = RemoteEngine(model, files, settings.engine, settings)
    load = engine.load
    # What the run waited, warm or not: connecting, and a load (its own or one it queued behind).
    load.load_s = time.perf_counter() - started
    return engine, load


def engine_status(home, group: str = "cpu") -> dict | None:
    """What a group's engine server holds (pid, clients, loaded models, loads, evictions),
    or None when none runs; starts nothing."""
    from pathlib import Path

    conn = _try_connect(GroupFiles(Path(home), group))
    if conn is None:
        return None
    try:
        send(conn, ("status",))
        status, reply = receive(conn)
        return reply
    finally:
        conn.close()
