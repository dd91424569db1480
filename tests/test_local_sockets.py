"""Local sockets are never handed to another user of the host.

- A socket whose path would be too long lives in a fallback folder under /tmp
  (`harvest.warm.protocol.unix_socket_path`): used only when it is ours and 0700, refused when
  someone else made it or left it open.
- The run launcher sends the worker's whole environment to the run starter's socket: it
  checks first, with SO_PEERCRED, that the process listening there runs as us.

The foreign owner is a real one: this machine runs the tests as root, which can chown a folder
and start a listener as `nobody` (a forked child that drops to its uid).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from fleet.run_starter import connect_to_starter
from harvest.private_files import NotPrivate
from harvest.warm.protocol import unix_socket_path

NOBODY = 65534


@pytest.fixture
def deep_dir(tmp_path):
    """A folder too deep for a socket path, and the fallback folder it maps to (removed after)."""
    deep = tmp_path / ("d" * 120)
    fallback = Path("/tmp") / f"harvest-engines-{hashlib.sha1(str(deep).encode()).hexdigest()[:12]}"
    shutil.rmtree(fallback, ignore_errors=True)
    yield deep, fallback
    shutil.rmtree(fallback, ignore_errors=True)


def test_the_fallback_folder_is_made_private(deep_dir):
    deep, fallback = deep_dir
    path = unix_socket_path(deep, "cpu")
    assert path == fallback / "cpu.sock"
    info = fallback.stat()
    assert info.st_mode & 0o777 == 0o700 and info.st_uid == os.getuid()


def test_a_fallback_folder_open_to_others_is_refused(deep_dir):
    deep, fallback = deep_dir
    fallback.mkdir()
    fallback.chmod(0o755)
    with pytest.raises(NotPrivate, match="mode 755"):
        unix_socket_path(deep, "cpu")


def test_a_fallback_folder_of_another_user_is_refused(deep_dir):
    deep, fallback = deep_dir
    fallback.mkdir(mode=0o700)
    os.chown(fallback, NOBODY, NOBODY)
    with pytest.raises(NotPrivate, match=f"uid {NOBODY}"):
        unix_socket_path(deep, "cpu")


def test_a_fallback_link_is_refused(deep_dir, tmp_path):
    deep, fallback = deep_dir
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    fallback.symlink_to(target)
    try:
        with pytest.raises(NotPrivate, match="not a folder"):
            unix_socket_path(deep, "cpu")
    finally:
        fallback.unlink()


def _listener(path: Path, uid: int | None) -> tuple[int, int]:
    """A fake starter on `path` in a forked child (as `uid`, when given); returns its pid and a
    pipe that receives how many bytes the first connection sent it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but socket calls, then _exit
        code = 1
        try:
            os.close(read_end)
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(str(path))
            server.listen(1)  # the peer credentials a client sees are the ones at listen()
            server.settimeout(30)
            conn, _ = server.accept()
            conn.settimeout(5)
            received = 0
            try:
                while chunk := conn.recv(65536):
                    received += len(chunk)
            except socket.timeout:
                pass
            os.write(write_end, str(received).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline, "the fake listener never listened"
        time.sleep(0.05)
    return pid, read_end


def _received(pid: int, read_end: int) -> int:
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with os.fdopen(read_end) as pipe:
        return int(pipe.read())


def test_the_launcher_sends_nothing_to_a_starter_of_another_user(capfd):
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="harvest-test-peer-"))
    try:
        os.chown(folder, NOBODY, NOBODY)  # where `nobody` can listen
        path = folder / "runs.sock"
        pid, read_end = _listener(path, NOBODY)
        assert connect_to_starter(str(path)) is None
        assert _received(pid, read_end) == 0
        assert f"served by uid {NOBODY}, not by us" in capfd.readouterr().err

        path.unlink()
        pid, read_end = _listener(path, None)  # the same listener as ourselves is used
        sock = connect_to_starter(str(path))
        assert sock is not None
        sock.sendall(b"hello")
        sock.close()
        assert _received(pid, read_end) == 5
    finally:
        shutil.rmtree(folder, ignore_errors=True)
