"""The engine server of one GPU group: `python -m harvest.warm.server --group G`.

It listens on the group's Unix socket (`harvest.warm.protocol`) and serves each client (a
job's run) in a thread of its own. A client first asks for a model (`load`: which engine and
why, whether it was warm, the load time), then for shards, one at a time: `capture_into`, with
the run's staged shard file, which the server fills and hashes as the engine makes the values
(`_FileSink`), then answers the statistics and the file's digest; or `capture`, answered as a
stream of the prompts' values (`harvest.warm.protocol`). The engines are an `EngineCache` of
`CobatchedEngine`s: the shards of jobs on one engine that wait together can be co-batched, in
shared forward passes (`harvest.warm.cobatch`).

A client that goes away (its run was cancelled and its process ended) is noticed when its
connection reads EOF or refuses the answer; only its own work is dropped. The server exits
when it has had no client for `HARVEST_ENGINE_IDLE_S`, on SIGTERM (its worker stopping), and
it removes its socket and pid file on the way out.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from multiprocessing.connection import Connection, Listener

from harvest.capture_spec import CaptureSpec
from harvest.engines.choice import EngineChoice, choose_engine, load_engine
from harvest.heap import TrimEvery, give_back_free_memory
from harvest.registry import load_registry
from harvest.engines.limits import EngineLimits
from harvest.settings import Settings, get_settings
from harvest.shard.file import ShardFill, token_bytes
from harvest.warm.cobatch import Abandoned, CobatchedEngine
from harvest.warm.cache import EngineCache, Loaded
from harvest.warm.protocol import GroupFiles, error_reply, receive, receive_fd, send, send_value

__all__ = ["EngineServer", "main"]


class _Stream:
    """A capture's sink in the server: each prompt's values straight to the asking run. A run
    that went away stops the sending, never the engine call its shard shares with others.
    The heap's free pages go back to the kernel once per `trim_every` bytes sent (a piece,
    `HARVEST_ENGINE_PIECE_BYTES`; `harvest.heap.TrimEvery`), not only at the shard's end."""

    def __init__(self, conn: Connection, trim_every: int):
        self.conn = conn
        self.lost = False
        self.trim = TrimEvery(trim_every)

    def __call__(self, position: int, value) -> None:
        if self.lost:
            return
        try:
            send_value(self.conn, position, value)
        except (OSError, EOFError, ValueError):  # ValueError: the connection is already closed
            self.lost = True
            return
        self.trim.passed(value.numel() * value.element_size())


class _FileSink:
    """A capture's sink in the server: each prompt's values into the run's staged shard file,
    handed over as a descriptor (`harvest.shard.file.ShardFill`), hashed as they are written.
    A run that went away leaves a file nobody reads; its shard's engine call, shared with
    others, goes on all the same."""

    def __init__(self, fill: ShardFill, trim_every: int):
        self.fill = fill
        self.trim = TrimEvery(trim_every)

    def __call__(self, position: int, value) -> None:
        self.fill.put(position, value)
        self.trim.passed(value.numel() * value.element_size())


class EngineServer:
    def __init__(self, files: GroupFiles, settings: Settings):
        self.files = files
        self.settings = settings
        self.idle_s = settings.engine_idle_s
        self.trim_every = settings.engine_piece_bytes  # bytes of values sent between two trims of the heap (`_Stream`)
        self.limits = EngineLimits.of(settings)
        self.registry = load_registry(settings)
        self.cache = EngineCache(settings.engine_models_per_group, self._load)
        self.clients = 0
        self.last_seen = time.monotonic()
        self.lock = threading.Lock()
        self.listener: Listener | None = None

    def _load(self, key: tuple[str, str]) -> CobatchedEngine:
        model, engine = key
        settings = self.settings
        return CobatchedEngine(load_engine(self.registry.get(model), EngineChoice(engine, ""), self.limits),
                               settings.engine_cobatch_shards, settings.engine_cobatch_wait_s,
                               turn_tokens=settings.engine_turn_tokens, turn_s=settings.engine_turn_s)

    # -- one client -----------------------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        held: Loaded | None = None
        reason = ""
        try:
            while True:
                try:
                    message = receive(conn)
                except (EOFError, OSError):
                    return  # the run ended (done, cancelled or killed)
                op, args = message[0], message[1:]
                try:
                    if op == "load":
                        model, setting = args
                        choice = choose_engine(setting, warm=True)  # on this host: what torch sees here
                        self.registry.get(model)  # unknown model: a clear error, nothing evicted
                        if held is not None:
                            self.cache.release(held)
                            held = None
                        held, warm = self.cache.acquire((model, choice.name))
                        reason = choice.reason
                        reply = {
                            "engine": held.engine.engine.name,
                            "reason": reason,
                            "warm": warm,
                            "load_s": held.load_s,
                            "versions": held.engine.engine.versions(),
                            "group": self.files.group,
                        }
                    elif op == "capture_into":
                        fd = receive_fd(conn)  # the run's staged shard file, right behind the request
                        try:
                            if held is None:
                                raise RuntimeError("capture before load")
                            prompts, layers, directions, batch_size, first_index = args
                            spec = CaptureSpec(layers=list(layers), directions=directions)
                            model = held.engine.engine.model
                            fill = ShardFill(fd, range(first_index, first_index + len(prompts)), [len(p) for p in prompts],
                                             len(layers), spec.n_features(model.hidden_size), spec.stored_dtype,
                                             {f"tokens_{first_index + i}": token_bytes(p) for i, p in enumerate(prompts)})
                            reply = held.engine.capture(prompts, spec, batch_size, gone=lambda: conn.poll(0), peers=held.users,
                                                        sink=_FileSink(fill, self.trim_every))
                            reply.extra["file"] = asdict(fill.finish())
                        finally:
                            os.close(fd)
                    elif op == "capture":
                        if held is None:
                            raise RuntimeError("capture before load")
                        prompts, layers, directions, batch_size = args
                        spec = CaptureSpec(layers=list(layers), directions=directions)
                        # conn.poll: nothing is sent while a shard waits, so readable means closed.
                        stream = _Stream(conn, self.trim_every)
                        reply = held.engine.capture(prompts, spec, batch_size, gone=lambda: conn.poll(0), peers=held.users,
                                                    sink=stream)
                        if stream.lost:
                            return  # cancelled while its shard ran: its values had nobody to go to
                    elif op == "status":
                        reply = {"pid": os.getpid(), "group": self.files.group, "clients": self.clients - 1,  # not the asker
                                 "loaded": self.cache.describe(CobatchedEngine.counters), "loads": self.cache.loads,
                                 "evictions": self.cache.evictions}
                    else:
                        raise ValueError(f"unknown request {op!r}")
                    answer = ("ok", reply)
                except Abandoned:
                    return  # cancelled while its shard waited: it never ran
                except Exception as exc:  # the client raises it; the server goes on
                    answer = error_reply(exc)
                try:
                    send(conn, answer)
                except (OSError, EOFError):
                    return  # cancelled while its shard ran: the answer has nobody to go to
                finally:
                    if op in ("capture", "capture_into"):
                        give_back_free_memory()  # the shard's buffers, freed but kept by malloc (harvest.heap)
        finally:
            if held is not None:
                self.cache.release(held)
            conn.close()
            with self.lock:
                self.clients -= 1
                self.last_seen = time.monotonic()

    # -- the server -----------------------------------------------------------------------

    def _watch_idle(self) -> None:
        while True:
            time.sleep(min(5.0, self.idle_s / 4))
            with self.lock:
                idle = self.clients == 0 and time.monotonic() - self.last_seen > self.idle_s
            if idle:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def run(self) -> None:
        self.files.socket.unlink(missing_ok=True)
        self.listener = Listener(str(self.files.socket), family="AF_UNIX", authkey=self.files.authkey())
        self.files.record_pid()
        print(f"engine server {self.files.group}: pid {os.getpid()}, socket {self.files.socket}", flush=True)
        threading.Thread(target=self._watch_idle, daemon=True, name="idle").start()
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                continue  # a client that failed the authentication handshake
            with self.lock:
                self.clients += 1
                self.last_seen = time.monotonic()
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="client").start()

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.files.forget(os.getpid())
        self.cache.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harvest.warm.server", description="The engine server of one GPU group.")
    parser.add_argument("--group", required=True, help="the GPU group's name (harvest.warm.protocol.group_name)")
    args = parser.parse_args(argv)
    settings = get_settings()
    server = EngineServer(GroupFiles(settings.home, args.group), settings)

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    # The default CPU priority, even on a CPU-only host. This server runs in a session of its
    # own, and under autogroup scheduling (Linux's default on most distributions) a session
    # takes an equal share of a contended CPU whatever its processes' nice values: a nice here
    # alone changes nothing. Lowering the session's own (/proc/self/autogroup) does take effect,
    # and made things worse: every job's forward passes wait here, a small job's behind a
    # large one's, so a lighter key's jobs waited longer (`bench/noisy_neighbour.py`).
    try:
        server.run()
    except (SystemExit, KeyboardInterrupt):
        pass
    finally:
        print(f"engine server {args.group}: stopping", flush=True)
        server.close()
    # Daemon client threads may sit in a forward pass; nothing of theirs is worth waiting for.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
