"""A supervisor (`fleet.processes.Supervisor`, what every role and `harvest up` run) restarts a
child that dies, alone, a bounded number of times within its window, saying so each time;
past the bound it gives up (and its role then stops everything). The whole-stack case, an
API replica killed under `harvest up`, is in tests/test_stack.py."""

from __future__ import annotations

import pytest

from fleet.processes import Managed
from fleet.processes import Supervisor


@pytest.fixture
def crasher(tmp_path):
    child = Managed("crasher", ["sh", "-c", "echo started; exit 3"], {"PATH": "/usr/bin:/bin"}, tmp_path / "crasher.log")
    yield child
    Managed.started.remove(child)


def test_a_child_that_keeps_dying_is_restarted_a_bounded_number_of_times(crasher, capsys):
    supervisor = Supervisor("test", restart_limit=3, restart_window_s=300)
    pids = {crasher.pid}
    for n in range(1, 4):
        crasher.proc.wait(timeout=10)
        assert supervisor.restart(crasher)
        pids.add(crasher.pid)
        assert f"crasher exited with 3; restarted as pid {crasher.pid} ({n} of 3 in 300 s" in capsys.readouterr().err
    crasher.proc.wait(timeout=10)
    assert not supervisor.restart(crasher)  # a fourth death within the window: give up
    assert "crasher exited with 3 after 3 restarts in 300 s; stopping" in capsys.readouterr().err
    assert len(pids) == 4  # three new processes, each the same command
    assert crasher.log_path.read_text().split() == ["started"] * 4
