"""A submit's parsing and token count, in a process of its own session: `Assessors`.

Learning a large submit's cost is seconds of CPU (4,000 prompts of 3,000 characters are
counted to the 2,000,000-token cap in ~1.4 s here). On the replica's own threads, even at a
lower nice, that CPU was the replica's: on a contended host Linux shares the CPU between
sessions (autogroups) whatever their threads' nice, so one key's refused bodies took the share
that every other key's reads needed (RELIABILITY.md, noisy neighbour: 21-23 of the replica's
28.5-30 CPU seconds in the attack minute; the victim's read p95 22 ms without them, 37-44 ms
with them). So each of the admission budget's places has a child process in a session of its
own, whose group is lowered to `WORK_NICE` (`harvest.cpu_share`): it gets the CPU the rest of
the host leaves, and all of it when the host is quiet. The replica's thread only hands the
body over and waits.

The exchange (a socket pair, `harvest.warm.protocol`'s messages and children): `("assess",
registry)`, then the body's bytes as they are. The child parses the body (`harvest.errors.validate_body`,
strict), checks the request against its model and counts its tokens, cheapest facts first
(`assess`), and answers `("assessed", request, job fields)` or the error, pickled with its class (`harvest.warm.protocol.error_reply`): a 400
names the limit and the number as before. A refused body never comes back to the replica. A
child that dies (killed, out of memory) is started again for the next submit; the submit it
was assessing is answered 503 `replica_busy` with Retry-After. Children end when the replica
closes their socket, or dies (they read EOF).

A child's memory is its imports, the tokenizers it loaded and one submit (README, "Memory of
each process"), so two things that would hold more happen elsewhere: a built-in model's first
submit builds its checkpoint in a short-lived process of its own (`_checkpoint`: torch and the
weights, 1.7 GB for smollm2-135m, were the child's for good before), and request.json is
counted, never encoded (`JobFiles.request_document_size`).
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from api.errors import ReplicaBusy
from harvest.registry import ModelInfo, Registry
from harvest.request import HarvestRequest
from harvest.warm.protocol import child_main, error_reply, raise_error, receive, send, start_child, stop_child

__all__ = ["Assessors", "assess", "build_checkpoint", "WORK_NICE", "TOKENIZE_ON_CALLER", "BUILD_UNAVAILABLE", "main"]

WORK_NICE = 10
"""The nice of the children's scheduling group: a group at 10 gets about a tenth of what a
default one does while both want the CPU."""
TOKENIZE_ON_CALLER = {"TOKENIZERS_PARALLELISM": "false"}
"""A child's environment: the Rust tokenizers count on its one thread, no pool of one thread
per core that no budget counts."""
RETRY_AFTER_S = 5
"""What a submit whose child died is told to wait: about a child's start here."""
BUILD_UNAVAILABLE = 3
"""`--build`'s exit status when the model's source is not on this host (it is served as one
whose weights are absent: `ModelUnavailable`)."""


def assess(request: HarvestRequest, registry: Registry) -> dict:
    """Check the request against its model and learn its cost, cheapest facts first (every
    400 comes from here); the job's row without its id and files (`api.routes.harvest` adds them).
    Its `output_bytes` is the most its folder can hold (`harvest.cost.kept_bytes`), request.json
    counted as the route will write it: the request with the layers resolved here."""
    from harvest.cost import check_before_tokenizing, check_counts, kept_bytes
    from harvest.jobfiles import JobFiles
    from harvest.shard.layout import shard_ranges
    from harvest.request import MAX_TOKENS, resolve_job
    from harvest.tokenize import count_tokens, load_counter, max_token_chars

    job = resolve_job(request, registry)
    lane = registry.lanes()[job.model.lane]
    path = _checkpoint(job.model)
    chars_per_token = max_token_chars(path)
    check_before_tokenizing(job, lane, chars_per_token=chars_per_token)
    counts = count_tokens(
        load_counter(path), request.prompts, add_special_tokens=request.add_special_tokens,
        max_len=job.model.max_model_len, chars_per_token=chars_per_token, stop_above=MAX_TOKENS,
    )
    cost = check_counts(job, counts, lane)
    # Counted, not written: the document of a 48 MB body would be two copies more here.
    stored = JobFiles.request_document_size(request.model_copy(update={"layers": job.layers}))
    kept = kept_bytes(job, cost, request_bytes=stored)
    return {
        "model": job.model.name,
        "lane": job.model.lane,
        "n_prompts": len(request.prompts),
        "layers": job.layers,
        "shard_size": request.shard_size,
        "n_shards": len(shard_ranges(len(request.prompts), request.shard_size)),
        "add_special_tokens": request.add_special_tokens,
        "contents": job.contents,
        "reserved_tokens": cost.tokens,
        "output_bytes": kept.total,
    }


def _checkpoint(model: ModelInfo) -> Path:
    """The model's checkpoint folder, built first if this host has none yet: in a process of
    its own (`build_checkpoint`), never in this one. A built-in model is built on its first
    submit (`ModelInfo.require_path`), and building imports torch and holds the weights
    (smollm2-135m: its GGUF de-quantized to float32): 1,766 MiB of peak RSS in the child that
    did it, 695 MiB held after (torch stays imported), where a child otherwise holds its
    imports, a tokenizer and one submit (~270 MiB for a 46 MiB body). The builder ends when
    the folder is whole, and its memory with it; this child then only reads the folder."""
    from harvest.built_checkpoints import is_built

    if model.path is None and model.build_target is not None and not is_built(model.build_target):
        done = subprocess.run([sys.executable, "-m", "api.admission_process", "--build"], input=pickle.dumps(model),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
        if done.returncode != BUILD_UNAVAILABLE and not is_built(model.build_target):
            raise RuntimeError(f"building the checkpoint of {model.name} failed (exit {done.returncode}): "
                               f"{done.stderr.decode(errors='replace')[-2000:]}")
    return model.require_path()  # built now, or none to build (ModelUnavailable): reads, builds nothing


def build_checkpoint(model: ModelInfo) -> int:
    """Build the model's checkpoint (`ModelInfo.require_path`, under its lock: another child
    building it at once waits and finds it); exit 0 once it is whole, BUILD_UNAVAILABLE when
    its source is not on this host. The model comes pickled on stdin, as the replica's
    registry resolved it (its home and weights), never looked up again here."""
    from harvest.errors import ModelUnavailable

    try:
        model.require_path()
    except ModelUnavailable:
        return BUILD_UNAVAILABLE
    return 0


class _Child:
    """One assessing child and the replica's end of its socket."""

    def __init__(self):
        self.process, self.conn = start_child(__name__, {**os.environ, **TOKENIZE_ON_CALLER})

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        self.conn.close()  # the child reads EOF and ends
        stop_child(self.process)


class Assessors:
    """`size` children, each assessing one submit at a time (the admission budget's places:
    `api.admission`). Started in the background when made, so the first submits do not wait
    for a child's imports; one that died is replaced when next taken."""

    def __init__(self, size: int):
        self._free: queue.SimpleQueue[_Child | None] = queue.SimpleQueue()
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        for _ in range(size):
            self._free.put(None)  # a place whose child is started when first taken…
        threading.Thread(target=self._warm, args=(size,), name="admission-warm", daemon=True).start()

    def _warm(self, size: int) -> None:
        """…unless this thread has started it first."""
        for _ in range(size):
            child = self._free.get()
            self._free.put(child if child is not None else self._start())

    def _start(self) -> _Child:
        child = _Child()
        with self._lock:
            self._children.append(child)
        return child

    def assess(self, body: bytes, registry: Registry) -> tuple[HarvestRequest, dict]:
        """The body parsed and assessed by a child (blocking: the budget's threads call it):
        the request and its job fields, or the child's error raised here."""
        child = self._free.get()
        try:
            if child is None or not child.alive():
                if child is not None:
                    self._forget(child)
                child = self._start()
            try:
                send(child.conn, ("assess", registry))
                child.conn.send_bytes(body)  # from its own memory: no pickled copy of a 50 MB body
                reply = receive(child.conn)
            except (EOFError, OSError) as exc:
                self._forget(child)
                child = None
                raise ReplicaBusy(
                    "This API replica's admission process stopped while reading the request. Send it again in "
                    f"{RETRY_AFTER_S} seconds.", retry_after=RETRY_AFTER_S,
                ) from exc
        finally:
            self._free.put(child)
        if reply[0] == "error":
            raise_error(reply[1])
        return reply[1], reply[2]

    def _forget(self, child: _Child) -> None:
        with self._lock:
            if child in self._children:
                self._children.remove(child)
        child.close()

    def close(self) -> None:
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            child.close()


# -- the child ---------------------------------------------------------------------------------

def _serve(conn: Connection) -> int:
    from harvest.cpu_share import lower_priority
    from harvest.errors import validate_body

    lower_priority(WORK_NICE, session=True)
    # Nothing of transformers is preloaded: a checkpoint this project built is counted through
    # the Rust tokenizers library (`harvest.tokenize.load_counter`, milliseconds to import); its
    # tokenizer class, which every child imported as it started, cost ~1.7 of a child's ~2 CPU-s.

    try:
        while True:
            message = receive(conn)
            if message[0] != "assess":
                return 0
            registry = message[1]
            body = conn.recv_bytes()
            try:
                request = validate_body(HarvestRequest, body, strict=True)  # strict: a JSON string is not a number here
                del body  # the parsed prompts are all that is kept
                reply = ("assessed", request, assess(request, registry))
            except Exception as exc:  # noqa: BLE001 - this submit's error, handed to the replica
                reply = error_reply(exc)
            send(conn, reply)
            del reply
    except (EOFError, OSError):  # the replica went away
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--build"]:
        return build_checkpoint(pickle.loads(sys.stdin.buffer.read()))
    return child_main("api.admission_process", "An API replica's submit assessor.", _serve, argv)


if __name__ == "__main__":
    sys.exit(main())
