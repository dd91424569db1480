"""A scenario that mostly waits (Prefect's heartbeat windows, its automations' ticks) run in a
thread of its own, so that its test process runs other modules meanwhile (tests/conftest.py,
RUN_TOGETHER): the test that needs its outcome waits for it there."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Background", "start_if_awaited"]

T = TypeVar("T")


class Background(Generic[T]):
    """`scenario()` running in a daemon thread from the moment this is made, in a copy of the
    maker's context (Prefect's settings, the session server's address among them, are context
    variables, which a new thread would not see)."""

    def __init__(self, name: str, scenario: Callable[[], T]):
        self.name = name
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(self._run, scenario), name=name, daemon=True).start()

    def _run(self, scenario: Callable[[], T]) -> None:
        try:
            self._result = scenario()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the outcome
            self._error = exc
        finally:
            self._done.set()

    def outcome(self, timeout: float) -> T:
        """What the scenario returned, or its exception (an assertion included), raised here."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background scenario {self.name!r} did not end in {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        return self._result


def start_if_awaited(request, fixture: str, verdict: str) -> None:
    """Set up the session fixture `fixture` (a `Background`) now, from the test `request` is
    for, if the test `verdict`, which waits for it, is among this session's tests; else no one
    would wait for it."""
    if any(item.name == verdict for item in request.session.items):
        request.getfixturevalue(fixture)
