"""An API replica's inline engine, in a process of its own: `ProcessEngine`.

Inline generation is the heaviest thing an API replica does: a 2,047-token generation with
every layer is a minute of CPU on a host without GPUs. In the replica's own process it would
share the replica's scheduling group with the event loop that answers everyone else, and on a
contended CPU every session (Linux's autogroup, the default on most distributions) gets an
equal share whatever its threads' nice values: one key's generations then took the share that
other keys' reads, and the control plane's processes, needed (`bench/noisy_neighbour.py`,
RELIABILITY.md). So the engine runs in a child process in a session of its own, and on a host
without CUDA that session's group is lowered (`SESSION_NICE`, `harvest.cpu_share`):
it gets the CPU the rest of the host leaves, and all of it when the host is quiet. With CUDA
the forward passes run on the GPU and the child keeps the default priority, which feeds it.

The exchange (a socket pair, `harvest.warm.protocol`'s messages): the replica sends the
`ModelInfo`; the child loads it and answers `("ready", engine name, versions)` or an error.
Then per batch: `("generate", prompts, sampling, layers)` is answered by
`("generations", [Generation without its residual], [has residual])`, each residual following
as `harvest.warm.protocol` values (raw bytes, received straight into the tensor), or by an
error, which keeps its class when it can (`error_reply`). The child ends when the replica
closes its end (or dies: the child reads EOF), and is started again for the next batch if it
died (a batch it was running fails with 503 `replica_busy`).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from api.errors import ReplicaBusy
from harvest.capture_spec import CaptureSpec
from harvest.cpu_share import lower_priority, with_passive_waits
from harvest.engines.base import Engine, Generation, SamplingSpec, ValueSink
from harvest.heap import give_back_free_memory
from harvest.engines.limits import EngineLimits
from harvest.registry import ModelInfo
from harvest.settings import Settings
from harvest.warm.protocol import (
    child_main, error_reply, raise_error, receive, receive_value, send, send_value, start_child, stop_child,
)

if TYPE_CHECKING:  # the replica's side holds no tensors of its own: torch is its child's
    from harvest.capture import ShardCapture

__all__ = ["ProcessEngine", "SESSION_NICE", "main"]

SESSION_NICE = 10
"""The nice of the child's scheduling group on a host without CUDA: a group at 10 gets about a
tenth of what a default one does while both want the CPU."""
RETRY_AFTER_S = 5
"""What a request whose engine process died is told to wait: about a model load here."""


class ProcessEngine(Engine):
    """A model's engine in a child process (module docstring); one batch at a time, as the
    replica's `EngineBatcher` calls it."""

    def __init__(self, model: ModelInfo, settings: Settings):
        self.model = model
        self.settings = settings  # the engine's choice and limits, handed to the child with the model
        self.name = "process"
        self._versions: dict[str, str] = {}
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._start()  # a model that cannot load fails here, as an in-process engine would

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs (tests, operators)."""
        return self._child.pid if self._child is not None and self._child.poll() is None else None

    def _start(self) -> None:
        child, conn = start_child(__name__, with_passive_waits(os.environ))
        try:
            send(conn, (self.model, self.settings.engine, EngineLimits.of(self.settings)))
            reply = receive(conn)
        except (EOFError, OSError):
            reply = ("error", None)
        if reply[0] != "ready":
            conn.close()
            stop_child(child)
            if reply[1] is not None:
                raise_error(reply[1])
            raise RuntimeError(f"the inline engine process for {self.model.name} ended while loading it")
        _, self.name, self._versions = reply
        self._child, self._conn = child, conn

    def generate(self, prompts: list[list[int]], sampling: list[SamplingSpec], layers: list[int] | None) -> list[Generation]:
        with self._lock:
            if self._child is None or self._child.poll() is not None:  # died between batches: no request lost
                self._lost()
                self._start()
            try:
                send(self._conn, ("generate", prompts, sampling, layers))
                reply = receive(self._conn)
                if reply[0] == "error":
                    raise_error(reply[1])
                _, generations, with_residual = reply
                for generation, has in zip(generations, with_residual):
                    if has:
                        _, generation.residual = receive_value(self._conn, receive(self._conn))
                return generations
            except (EOFError, OSError) as exc:
                self._lost()
                raise ReplicaBusy(
                    f"This API replica's engine for {self.model.name} stopped while running the request. Send it "
                    f"again in {RETRY_AFTER_S} seconds.", retry_after=RETRY_AFTER_S,
                ) from exc

    def _lost(self) -> None:
        """The child died (or its connection broke): forget it; the next batch starts another."""
        if self._conn is not None:
            self._conn.close()
        if self._child is not None:
            stop_child(self._child)
        self._conn = self._child = None

    def capture(self, prompts: list[list[int]], spec: CaptureSpec, *, batch_size: int | None = None,
                sink: ValueSink | None = None) -> ShardCapture:
        raise NotImplementedError("an API replica's inline engine only generates; harvests run on worker hosts")

    def versions(self) -> dict[str, str]:
        return dict(self._versions)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    send(self._conn, ("close",))
                except OSError:
                    pass
            self._lost()


# -- the child ---------------------------------------------------------------------------------

def _serve(conn: Connection) -> int:
    import torch

    from harvest.engines.choice import load_engine

    if not torch.cuda.is_available():
        lower_priority(SESSION_NICE, session=True)
    try:
        model, setting, limits = receive(conn)
        engine = load_engine(model, setting, limits, warm=True)
    except (EOFError, OSError):
        return 0
    except Exception as exc:  # noqa: BLE001 - handed to the replica, which raises it
        send(conn, error_reply(exc))
        return 1
    send(conn, ("ready", engine.name, engine.versions()))
    try:
        while True:
            message = receive(conn)
            if message[0] != "generate":
                break
            try:
                generations = engine.generate(*message[1:])
            except Exception as exc:  # noqa: BLE001 - this batch's error, not the engine's end
                send(conn, error_reply(exc))
                continue
            residuals = [generation.residual for generation in generations]
            send(conn, ("generations", [dataclasses.replace(g, residual=None) for g in generations],
                        [r is not None for r in residuals]))
            for position, residual in enumerate(residuals):
                if residual is not None:
                    send_value(conn, position, residual)
            del generations, residuals
            give_back_free_memory()  # the batch's KV cache and captures, freed but kept by malloc (harvest.heap)
    except (EOFError, OSError):  # the replica went away
        pass
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return child_main("api.inline_process", "An API replica's inline engine.", _serve, argv)


if __name__ == "__main__":
    sys.exit(main())
