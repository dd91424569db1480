"""The run starter's protocol, driven directly and cheaply: its own loop with a `sleep` for
worker and runs that only say who they are (`tests.trivial_starter`), asked by raw sockets, by
forked launchers that kill themselves at chosen points (`tests.launchers`), and by the real
launcher. What is checked, and against what:

- framing: a launch sent a byte at a time forks; malformed ones get no pid, and the starter
  serves on;
- who may launch: a launcher of another uid is refused (the kernel's SO_PEERCRED), even on a
  socket opened to everyone;
- one slow launcher does not hold up another; one that never finishes is dropped;
- a starter with a second thread refuses to fork and says why; its launcher starts the run
  the slow way (Prefect's own `prefect.engine`); the real starter's preload, on a host where
  llama-tiny is not built, builds nothing and leaves one thread (/proc/PID/status);
- a forked run: its parent, group, blocked and caught signals as the kernel has them
  (/proc), and a SIGTERM to its launcher ending the run, not the starter's worker;
- launchers killed at random points of the exchange, over a hundred times while jobs run:
  the starter keeps its pid (and the kernel's peer pid of its socket), leaks no descriptor
  (/proc/PID/fd), every killed launcher's run ends (the end of its stdout pipe), and the
  jobs around them, and later ones, fork and exit as asked.

That a real flow run still forks through Prefect is checked in tests/test_warm_engines.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fleet.run_starter import STARTER_ENV
from tests.launchers import Launcher, launch_bytes, read_to_end, start_launcher

REPO = Path(__file__).resolve().parent.parent
STARTER = [sys.executable, "-m", "fleet.run_starter"]  # the launcher; with `--socket S -- WORKER…`, the starter
NOBODY = 65534


class Starter:
    """`tests.trivial_starter` in its own process, serving a socket in a fresh /tmp folder
    (a Unix socket path must stay short)."""

    def __init__(self, preload: str = "bare", handshake_s: float = 60, env: dict[str, str] | None = None):
        self.folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="harvest-test-starter-"))
        self.path = self.folder / "runs" / "runs.sock"
        self.log = self.folder / "starter.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.trivial_starter", str(self.path), preload, str(handshake_s)],
                                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while "run starter: pid" not in self.text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()
            time.sleep(0.05)

    def text(self) -> str:
        return self.log.read_text()

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def peer_pid(self) -> int:
        """The pid of the process listening on the socket, as the kernel has it."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(self.path))
            return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # to its worker, which ends, and so does it
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def starter():
    started = Starter()
    yield started
    started.stop()


def _assert_job(starter: Starter, outcome: dict, code: int) -> None:
    """A job whose launcher stayed: forked from the starter, in its own group, its status back."""
    report = outcome["report"]
    assert outcome["status"] == 0 and len(report) == 2 and report[0].startswith("pid "), outcome
    pid = int(report[0].split()[1])
    assert report[1] == f"exit {code}"
    assert outcome["lines"] == [f"run {pid} {starter.proc.pid} {pid}"] and outcome["ended"], outcome


def _job(starter: Starter, argv: list[str]) -> dict:
    return start_launcher(str(starter.path), argv).finish(time.monotonic() + 60)


def _raw_launch(starter: Starter, chunks: list[bytes], fds_with: int | None = 0) -> tuple[list[bytes], bytes]:
    """Send `chunks` (the stdio descriptors with chunk `fds_with`), then read every answer to
    the end; returns the answers and what a run wrote."""
    stdout_r, stdout_w = os.pipe()
    null = os.open(os.devnull, os.O_RDWR)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(starter.path))
        for i, chunk in enumerate(chunks):
            if i == fds_with:
                socket.send_fds(sock, [chunk], [null, stdout_w, null])
            else:
                sock.sendall(chunk)
        os.close(stdout_w)
        os.close(null)
        sock.settimeout(60)
        answers = sock.makefile("rb").readlines()
    out, ended = read_to_end(stdout_r, time.monotonic() + 60)
    assert ended, out
    return answers, out


# --- framing -------------------------------------------------------------------------------


def test_a_launch_sent_a_byte_at_a_time_forks(starter):
    header, payload = launch_bytes(["0", "4"])
    message = header + payload
    answers, out = _raw_launch(starter, [message[i:i + 1] for i in range(len(message))])
    assert len(answers) == 2 and answers[0].startswith(b"pid ") and answers[1] == b"exit 4\n", answers
    pid = int(answers[0].split()[1])
    assert out.decode() == f"run {pid} {starter.proc.pid} {pid}\n"


@pytest.mark.parametrize("what", ["too long", "not json", "not a launch", "no descriptors", "bytes after"])
def test_a_malformed_launch_gets_no_pid_and_the_starter_serves_on(starter, what):
    header, payload = launch_bytes(["0", "0"])
    chunks, fds_with = {
        "too long": ([struct.pack("!I", 1 << 30)], 0),
        "not json": ([struct.pack("!I", 3) + b"{no"], 0),
        "not a launch": ([struct.pack("!I", 2) + b"[]"], 0),
        "no descriptors": ([header + payload], None),
        "bytes after": ([header + payload + b"x"], 0),
    }[what]
    answers, out = _raw_launch(starter, chunks, fds_with)
    assert answers == [] and out == b""
    assert "dropped a launcher" in starter.text().splitlines()[-1]
    _assert_job(starter, _job(starter, ["0", "0"]), 0)


# --- who may launch, and how long --------------------------------------------------------------


def test_a_launcher_of_another_user_is_refused(starter):
    # The socket opened to everyone, as a careless operator might: the peer's uid still stops it.
    for folder in (starter.folder, starter.path.parent):
        os.chmod(folder, 0o755)
    os.chmod(starter.path, 0o777)
    try:
        report_r, report_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the launcher, as `nobody`
            code = 1
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                header, payload = launch_bytes(["0", "0"])
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(str(starter.path))
                sock.settimeout(60)
                try:  # the starter may have closed on it already (EPIPE): the answer is the same
                    socket.send_fds(sock, [header + payload], [stdout_w, stdout_w, stdout_w])
                    os.write(report_w, b"".join(sock.makefile("rb").readlines()))
                except (BrokenPipeError, ConnectionResetError):
                    pass
                code = 0
            finally:
                os._exit(code)
        os.close(report_w)
        os.close(stdout_w)
        outcome = Launcher(pid, report_r, stdout_r, None).finish(time.monotonic() + 60)
        assert (outcome["status"], outcome["report"], outcome["lines"], outcome["ended"]) == (0, [], [], True)
    finally:
        for folder in (starter.folder, starter.path.parent):
            os.chmod(folder, 0o700)
    assert f"refused a launch: a launcher of uid {NOBODY}" in starter.text()


def test_a_slow_launcher_does_not_hold_up_another(starter):
    header, _ = launch_bytes(["0", "0"])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
        slow.connect(str(starter.path))
        slow.sendall(header[:2])
        _assert_job(starter, _job(starter, ["0", "5"]), 5)
        slow.setblocking(False)
        with pytest.raises(BlockingIOError):  # still waited for: neither answered nor dropped
            slow.recv(1)


def test_a_launch_not_whole_within_its_deadline_is_dropped():
    short = Starter(handshake_s=0.5)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(short.path))
            sock.settimeout(60)
            assert sock.recv(1) == b""
        assert "not whole within 0.5 s" in short.text()
        _assert_job(short, _job(short, ["0", "0"]), 0)
    finally:
        short.stop()


# --- when it forks, and what a run is ------------------------------------------------------------


def test_a_threaded_starter_refuses_to_fork_and_says_why():
    threaded = Starter(preload="threaded")
    try:
        header, payload = launch_bytes(["0", "0"])
        answers, out = _raw_launch(threaded, [header + payload])
        assert len(answers) == 1 and answers[0].startswith(b"refused this starter has 2 threads"), answers
        assert out == b""
        assert "not forking a run: this process has 2 threads" in threaded.text()
        # The real launcher then starts its run the slow way: Prefect's own engine (which
        # finds no flow run by this id).
        launcher = subprocess.run([*STARTER, "not-a-run-id"], cwd=REPO,
                                  env={**os.environ, STARTER_ENV: str(threaded.path)}, capture_output=True, text=True, timeout=120)
        assert "run starter: not forked (this starter has 2 threads" in launcher.stderr
        assert "Invalid flow run id" in launcher.stderr and launcher.returncode == 1, launcher.stderr
        assert threaded.proc.poll() is None
    finally:
        threaded.stop()


def test_the_preload_builds_nothing_and_leaves_the_starter_single_threaded(tiny):
    """The real starter on a host where llama-tiny is not built yet and another checkpoint is
    installed: it loads that one's tokenizer (the tokenizers library is mapped), builds
    nothing, and serves with one thread (its own log would say otherwise)."""
    home = Path(tempfile.mkdtemp(dir="/tmp", prefix="harvest-test-preload-"))
    (home / "models" / "org").mkdir(parents=True)
    (home / "models" / "org" / "installed").symlink_to(tiny.path)
    (home / "models.toml").write_text('[models.llama-tiny]\nweights = "models/llama-tiny"\nbuiltin = true\n\n'
                                      '[models.installed]\nweights = "org/installed"\n')
    log = home / "starter.log"
    env = {**os.environ, "HARVEST_HOME": str(home), "HARVEST_MODELS_FILE": str(home / "models.toml")}
    with open(log, "wb") as out:
        real = subprocess.Popen([*STARTER, "--socket", str(home / "runs.sock"), "--", "sleep", "600"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "run starter: pid" not in log.read_text():
            assert real.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "not forking" not in log.read_text() and "no preload" not in log.read_text(), log.read_text()
        assert _proc_status(real.pid)["Threads"] == "1"
        assert "tokenizers" in Path(f"/proc/{real.pid}/maps").read_text()
        assert sorted(p.name for p in (home / "models").iterdir()) == ["org"]  # no llama-tiny, no staging, no lock
    finally:
        os.killpg(real.pid, signal.SIGKILL)  # it and its worker: how it stops is not what this checks
        real.wait()
        shutil.rmtree(home, ignore_errors=True)


def test_a_checkpoint_built_after_the_preload_is_preloaded_once_the_run_that_built_it_ends(tiny, tmp_path):
    """A host whose starter preloaded before its model was built (a worker started on a fresh
    host): the run that builds it imports the tokenizer classes itself; once it ends the
    starter reads the new checkpoint's tokenizer, and the runs forked after it have them
    (0.83 s of each run's start on the dev box otherwise). What a forked run reports is its own
    `sys.modules`."""
    (tmp_path / "models" / "org").mkdir(parents=True)
    (tmp_path / "models.toml").write_text('[models.installed]\nweights = "org/installed"\n')
    host = Starter(preload="tokenizers", env={"HARVEST_HOME": str(tmp_path), "HARVEST_MODELS_FILE": str(tmp_path / "models.toml")})
    try:
        builder = start_launcher(str(host.path), ["3", "0", "modules"])  # runs 3 s: it "builds" the model meanwhile
        time.sleep(1.0)
        (tmp_path / "models" / "org" / "installed").symlink_to(tiny.path)
        first = builder.finish(time.monotonic() + 60)
        after = _job(host, ["0", "0", "modules"])
        assert first["lines"][1:] == ["tokenizers imported: False"], first
        assert after["lines"][1:] == ["tokenizers imported: True"], (after, host.text())
        assert _proc_status(host.proc.pid)["Threads"] == "1"  # the preload started no thread
    finally:
        host.stop()


def _proc_status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)


def test_a_forked_run_has_its_own_group_and_default_signals(starter):
    launcher = subprocess.Popen([*STARTER, "300", "0"], cwd=REPO,
                                env={**os.environ, STARTER_ENV: str(starter.path)}, stdout=subprocess.PIPE, text=True)
    try:
        _, pid, ppid, pgid = launcher.stdout.readline().split()
        pid = int(pid)
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert (int(stat[1]), int(stat[2])) == (starter.proc.pid, pid) == (int(ppid), int(pgid))
        status = _proc_status(pid)
        mask = sum(1 << (s - 1) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD))
        assert int(status["SigBlk"], 16) & mask == 0 and int(status["SigCgt"], 16) & mask == 0, status
        # The launcher passes a cancel's SIGTERM on (once it knows the pid: its handler is set),
        # the run ends by it, its launcher the same way. Had the run kept the starter's handler,
        # it would have passed it to the starter's worker.
        deadline = time.monotonic() + 60
        while not int(_proc_status(launcher.pid)["SigCgt"], 16) & (1 << (signal.SIGTERM - 1)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == -signal.SIGTERM
        assert not Path(f"/proc/{pid}").exists() or _proc_status(pid)["State"].startswith("Z")
        assert starter.proc.poll() is None and starter.peer_pid() == starter.proc.pid
    finally:
        launcher.kill()
        launcher.wait()


def test_the_launcher_exits_as_its_run_did(starter):
    launcher = subprocess.run([*STARTER, "0", "3"], cwd=REPO,
                              env={**os.environ, STARTER_ENV: str(starter.path)}, capture_output=True, text=True, timeout=60)
    assert launcher.returncode == 3, launcher.stderr
    assert launcher.stdout.split()[2] == str(starter.proc.pid)  # the run's parent


# --- launchers dying anywhere ----------------------------------------------------------------------


def test_launchers_killed_at_random_points_never_take_the_starter_down(starter):
    seed = int.from_bytes(os.urandom(4), "big")
    stat = Path(f"/proc/{starter.proc.pid}/stat")
    start_time = stat.read_text().rsplit(")", 1)[1].split()[19]
    fds = starter.fds()
    # In a small process of its own (`tests.launchers`): its forks are a hundred times cheaper.
    result = subprocess.run([sys.executable, "-m", "tests.launchers", str(starter.path), str(starter.proc.pid), str(seed)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    context = f"seed {seed}; the starter's exit status: {starter.proc.poll()}, its log ends:\n{starter.text()[-1500:]}"
    assert starter.proc.poll() is None, context  # first of all: it is still there
    forked_then_killed = 0
    for killed in outcome["killed"]:  # each killed; its run, if forked, ended with it (its stdout closed)
        assert killed["status"] == -signal.SIGKILL and killed["ended"], (killed, context)
        for line in killed["lines"]:
            _, pid, ppid, pgid = line.split()
            assert ppid == str(starter.proc.pid) and pgid == pid and killed["report"] in ([], [f"pid {pid}"]), (killed, context)
            forked_then_killed += 1
    for job in outcome["jobs"]:  # the jobs among them, and the one through it all
        _assert_job(starter, job, job["code"])
    assert len(outcome["killed"]) >= 100 and forked_then_killed >= 10, (len(outcome["killed"]), forked_then_killed, context)
    # The same starter, serving: its pid on the socket, its start time, no descriptor left over.
    assert starter.peer_pid() == starter.proc.pid
    assert stat.read_text().rsplit(")", 1)[1].split()[19] == start_time
    deadline = time.monotonic() + 30
    while starter.fds() > fds:
        assert time.monotonic() < deadline, (starter.fds(), fds)
        time.sleep(0.1)
    _assert_job(starter, _job(starter, ["0", "9"]), 9)
    assert "Traceback" not in starter.text()


def test_a_forked_run_rebuilds_prefects_settings_only_when_it_changes_one(tmp_path, monkeypatch):
    """Rebuilding Prefect's settings and logging in the child costs most of a warm run's start,
    so it is skipped when the run's Prefect settings are the starter's: the run's identity
    (`PREFECT__…`) and the process worker's ephemeral-server flag (a client with an API URL
    never reads it) do not count; any other setting, or a working directory of its own with a
    settings file, does."""
    from fleet.run_fork import _prefect_settings_changed

    worker = {"PREFECT_API_URL": "http://127.0.0.1:4200/api", "PREFECT_LOGGING_LEVEL": "INFO", "PATH": "/bin"}
    run = {**worker, "PREFECT__FLOW_RUN_ID": "abc", "PREFECT__CONTROL_TOKEN": "t", "PREFECT_SERVER_EPHEMERAL_ENABLED": "True"}
    here = str(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert not _prefect_settings_changed(run, worker, here)
    assert _prefect_settings_changed({**run, "PREFECT_LOGGING_LEVEL": "DEBUG"}, worker, here)
    assert _prefect_settings_changed({k: v for k, v in run.items() if k != "PREFECT_LOGGING_LEVEL"}, worker, here)
    without_url = {k: v for k, v in run.items() if k != "PREFECT_API_URL"}
    assert _prefect_settings_changed(without_url, {k: v for k, v in worker.items() if k != "PREFECT_API_URL"}, here)
    assert not _prefect_settings_changed(run, worker, "/somewhere/else")  # moved, but no settings file here
    (tmp_path / "prefect.toml").write_text("[logging]\nlevel = 'DEBUG'\n")
    assert _prefect_settings_changed(run, worker, "/somewhere/else")
    assert not _prefect_settings_changed(run, worker, here)  # the starter's own directory: already read
