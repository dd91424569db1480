"""The engine servers' pid files (`harvest.warm.protocol`): a pid is signalled only while it
names the process that wrote it. Checked against real processes (`sleep`), their liveness
read from the kernel, not from the code under test."""

from __future__ import annotations

import subprocess

import psutil

from harvest.warm.protocol import GroupFiles, process_started, stop_engine_servers


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_a_pid_file_naming_a_process_that_is_not_the_server_is_never_signalled(tmp_path):
    """The server died and the kernel gave its pid to another process: same pid, another start
    time. Neither the pid file's pid alone (an old file) nor a wrong start time lets it be killed."""
    stranger = _sleeper()
    try:
        files = GroupFiles(tmp_path, "gpu-0")
        for recorded in (f"{stranger.pid} {float(process_started(stranger.pid)) - 3600:.2f}", f"{stranger.pid}"):
            files.pid.write_text(recorded)
            assert files.server_pid() is None
            assert stop_engine_servers(tmp_path, timeout=1) == []
            assert stranger.poll() is None and psutil.Process(stranger.pid).status() != psutil.STATUS_ZOMBIE
    finally:
        stranger.kill()
        stranger.wait()


def test_the_process_that_wrote_the_pid_file_is_stopped(tmp_path):
    server = _sleeper()
    try:
        files = GroupFiles(tmp_path, "cpu")
        files.pid.write_text(f"{server.pid} {process_started(server.pid)}")  # what `record_pid` writes, for it
        assert files.server_pid() == server.pid
        assert stop_engine_servers(tmp_path, timeout=5) == [server.pid]
        assert server.wait(10) == -15  # SIGTERM
    finally:
        server.kill()
        server.wait()
