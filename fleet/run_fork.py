"""A flow run forked from a preloaded process (the run starter): what is preloaded, when a
fork is safe, the fork itself, and how its child becomes the run.

- `fork_hazard`: a process may be forked only while it is single-threaded (a thread is not
  copied, but the locks it holds are, held for ever in the child) and has not initialised
  CUDA (a CUDA context does not survive a fork). Checked before every fork, by the kernel's
  count of the process's threads.
- `preload`: so it imports what a run imports and builds nothing (building llama-tiny trains a
  tokenizer on a thread pool and initialises torch) and tokenizes nothing (the Rust tokenizers
  start their pool on the first encode; loading one starts no thread); and makes the one TLS
  context its runs' Prefect clients share (`flows.prefect_clients`).
- `fork_in_group`: the forking process's own signal handlers are blocked across `fork` and
  put back to the defaults in the child before it unblocks them, so none of them ever runs
  in the child; the child's process group is set by both parent and child, so a group kill
  from the parent right after the fork reaches the child whichever of them runs first.
- `become_run`: the child takes its launcher's stdio, directory and environment and runs
  `prefect.engine` as `python -m` would, after reading Prefect's and our settings again from
  that environment (one that would change anything else a preloaded module read at import is
  started afresh: `REREAD`).

Standard library only at import: the launcher, which must start in milliseconds, imports it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from harvest.settings import get_settings

__all__ = [
    "REREAD", "Fork", "engine_argv", "fork_hazard", "preload", "preload_tokenizers", "settle_thread_pools", "fork_in_group",
    "become_run",
]

# Variables a run may set differently from its worker and still fork: read again in the child
# (Prefect's, ours, fsspec's; `_settings_from_environment`) or only when a client is made
# (AWS_*). A run that sets any other (PYTHONPATH, HF_HOME, …) is started afresh instead.
REREAD = ("PREFECT_", "HARVEST_", "FSSPEC_", "AWS_")


@dataclass
class Fork:
    """What the child of a fork carries out of the starter's loop: the run to become."""

    payload: dict  # the launcher's env, cwd and argv
    fds: list[int]  # its stdin, stdout, stderr
    worker_env: dict[str, str]
    set_by_preload: dict[str, str]


def engine_argv(argv: list[str]) -> list[str]:
    """The command a run is without a starter: Prefect's own."""
    return [sys.executable, "-m", "prefect.engine", *argv]


def preload() -> set[str]:
    """Import what every run imports, make the TLS context its Prefect clients share
    (`flows.prefect_clients`), and load the tokenizer classes of the checkpoints already on
    this host (`preload_tokenizers`); returns the checkpoints whose tokenizers it read."""
    import prefect.engine  # noqa: F401
    import prefect.flow_engine  # noqa: F401

    import flows.harvest  # noqa: F401  (torch, the harvest core, the warm-engine client)
    from flows.prefect_clients import share_tls_context, tls_context

    share_tls_context()  # a run's ~9 Prefect clients share one context, made here once for every run
    tls_context()
    return preload_tokenizers(set())


def preload_tokenizers(done: set[str]) -> set[str]:
    """Read the tokenizer of each checkpoint on this host not in `done`, which imports its
    tokenizer classes (0.83 s for llama-tiny's on the dev box, paid by every run forked before
    it); the tokenizers themselves are not kept (their files may change). Returns `done` and
    the names read. The starter calls it again after each run ends: a checkpoint that a run
    built (a host that started before its models were) is preloaded for the runs after it."""
    from harvest.registry import load_registry
    from harvest.tokenize import read_tokenizer

    read = set(done)
    for name, path in load_registry(get_settings()).checkpoints_on_disk().items():
        if name in read:
            continue
        read.add(name)
        try:
            read_tokenizer(path)
        except Exception as exc:  # the run will say what is wrong with it; this is only speed
            print(f"run starter: no preload of {name}'s tokenizer: {exc}", flush=True)
    return read


def fork_hazard() -> str | None:
    """Why a child forked from this process now could inherit a broken copy of it, or None."""
    try:
        tasks = sorted(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: Python's own threads are all that can be counted
        tasks = []
    if len(tasks) > 1 or threading.active_count() > 1:
        names = [_thread_name(task) for task in tasks] or [t.name for t in threading.enumerate()]
        return f"{max(len(tasks), threading.active_count())} threads ({', '.join(names)})"
    torch = sys.modules.get("torch")  # never imported here only to ask
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA initialised"
    return None


def _thread_name(task: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/comm") as comm:
            return comm.read().strip()
    except OSError:  # it ended meanwhile
        return "?"


def settle_thread_pools() -> None:
    """Fork a child that exits at once. Libraries that stop their thread pools before a fork
    and restart them only when next used (OpenBLAS: numpy's import starts its pool) have then
    stopped them in this process, which will not use them: the thread count `fork_hazard`
    reads is then the one a child would inherit."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # no handler runs in it
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.waitpid(pid, 0)


def fork_in_group(handled: Iterable[signal.Signals]) -> int:
    """`os.fork()` for a child in its own process group, with the `handled` signals at their
    defaults before it can receive one (and no signal wakeup fd). In the child, a failure here
    ends it: it must never run on as a copy of its parent."""
    handled = tuple(handled)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            for signum in handled:
                signal.signal(signum, signal.SIG_DFL)
            os.setpgid(0, 0)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a signal sent meanwhile lands now, on the default
        except BaseException as exc:
            os.write(2, f"forked run: could not start: {exc!r}\n".encode())
            os._exit(70)
        return 0
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        os.setpgid(pid, pid)
    except OSError:  # EACCES: the child set it itself and has exec'd already
        pass
    return pid


def become_run(fork: Fork) -> None:
    """In the forked child: take the launcher's place and run `prefect.engine` as `-m` would."""
    import runpy
    import warnings

    for target, fd in zip((0, 1, 2), fork.fds):
        os.dup2(fd, target)
        os.close(fd)
    starter_cwd = os.getcwd()
    os.chdir(fork.payload["cwd"])
    env = fork.payload["env"]
    worker_env = fork.worker_env
    stale = sorted(k for k in set(env) | set(worker_env) if env.get(k) != worker_env.get(k) and not k.startswith(REREAD))
    if stale:  # the run's environment changes what a preloaded module read at import
        changes = ", ".join(f"{k}={env.get(k)!r} (worker: {worker_env.get(k)!r})" for k in stale)
        print(f"run starter: this run sets {changes}: started afresh", flush=True)
        os.execve(sys.executable, engine_argv(fork.payload["argv"]), env)
    prefect_changed = _prefect_settings_changed(env, worker_env, starter_cwd)
    os.environ.clear()
    os.environ.update({**fork.set_by_preload, **env})
    _settings_from_environment(prefect_changed)
    sys.argv = ["prefect.engine", *fork.payload["argv"]]
    # Preloaded, as intended: `-m` on an imported module is what this is for.
    warnings.filterwarnings("ignore", message="'prefect.engine' found in sys.modules", category=RuntimeWarning)
    runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


# Set by Prefect's process worker on every run; it only matters to a client with no API URL.
_EPHEMERAL = "PREFECT_SERVER_EPHEMERAL_ENABLED"
# Files in a run's working directory that Prefect's settings read besides the environment.
_PREFECT_SETTINGS_FILES = (".env", "prefect.toml", "pyproject.toml")


def _prefect_settings_changed(env: dict[str, str], worker_env: dict[str, str], starter_cwd: str) -> bool:
    """Whether the run's Prefect settings can differ from those the starter built at preload:
    a setting variable (`PREFECT_…`; `PREFECT__…` are the run's identity, read from the
    environment as needed) set differently, or a working directory of its own holding a
    settings file. Called in the run's working directory."""
    changed = {
        k for k in set(env) | set(worker_env)
        if k.startswith("PREFECT_") and not k.startswith("PREFECT__") and env.get(k) != worker_env.get(k)
    }
    if "PREFECT_API_URL" in env:
        changed.discard(_EPHEMERAL)
    moved = os.getcwd() != starter_cwd and any(os.path.exists(name) for name in _PREFECT_SETTINGS_FILES)
    return bool(changed) or moved


def _settings_from_environment(prefect_changed: bool) -> None:
    """Settings read at import in the starter, read again from the run's own environment:
    every variable of the `REREAD` prefixes takes effect. Prefect's settings and logging only
    when `prefect_changed`: rebuilding them took ~0.7 s of each run's start on the 2-core dev
    box (the logging configuration is templated from every setting), and a worker's runs
    usually set none of them differently."""
    import fsspec.config
    import prefect.context
    from prefect.logging.configuration import setup_logging

    if prefect_changed:
        prefect.context.refresh_global_settings_context()
        setup_logging(incremental=False)
    fsspec.config.conf.clear()
    fsspec.config.set_conf_files(os.environ.get("FSSPEC_CONFIG_DIR", fsspec.config.default_conf_dir), fsspec.config.conf)
    fsspec.config.set_conf_env(fsspec.config.conf)
