"""A time budget for one call of a verifier we do not own (docs/tasks/instructions.md, time
budget per checker call).

Each call runs under a ``SIGALRM`` timer (the interpreter and ``re`` both stop for signals; no
process is started). The interrupt is a ``BaseException``, so a checker's ``except Exception``
cannot swallow it; the caller sees ``CheckTimeout``. ``clock="cpu"`` (``task.checker_timeout_s``)
counts the calling thread's CPU time, so verdicts barely depend on load (issue 47); the wall
timer is re-armed with the CPU time left, and a call that waits without computing is cut after
``WALL_GUARD_FACTOR`` times the budget. ``clock="wall"`` budgets a custom task's functions
(``task.reward_timeout_s``). Off the main thread, without ``SIGALRM``, or while another timer
runs, a call runs unbudgeted, logged once. The timer overflows near 1e9 s: ``MAX_BUDGET_S``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BUDGET_S = 86400.0  # one day: the largest budget a config may give one call
WALL_GUARD_FACTOR = 30.0  # clock="cpu": wall-clock seconds per budgeted CPU second, at most
CLOCKS = ("wall", "cpu")
_ARMED: list[_Budget] = []  # the budget of the call whose timer is running (at most one)
_WARNED: set[str] = set()


class CheckTimeout(Exception):
    """A verifier call ran past its time budget (the check counts as failed)."""

    def __init__(self, what: str, seconds: float, why: str = "") -> None:
        super().__init__(f"{what} ran past its time budget of {seconds:g} s{why}")
        self.seconds = seconds


class _Expired(BaseException):
    """Raised by the timer inside the interrupted call; turned into ``CheckTimeout``."""


def budget_seconds(value: Any, key: str) -> float | None:
    """A config value as a time budget in seconds (None: no budget), or a ``ValueError``
    naming ``key`` and the allowed range (``inf``, ``1e12``, ``0``, ``nan``, text)."""
    if value is None:
        return None
    try:
        seconds = None if isinstance(value, (bool, str)) else float(value)
    except (TypeError, ValueError, OverflowError):
        seconds = None
    if seconds is None or not 0 < seconds <= MAX_BUDGET_S:  # NaN fails this too
        raise ValueError(
            f"{key}={value} is not allowed: seconds per call in (0, {MAX_BUDGET_S:g}], or "
            "null for no time budget"
        )
    return seconds


class _Budget:
    """What one call may spend, on its clock, from when it started."""

    def __init__(self, seconds: float, clock: str) -> None:
        self.seconds, self.cpu = seconds, clock == "cpu"
        self.guard = WALL_GUARD_FACTOR * seconds
        self.cpu0, self.wall0 = time.thread_time(), time.monotonic()

    def left(self) -> float:
        """Wall-clock seconds before the budget can run out; <= 0: it has. On the CPU clock
        this is the CPU time left (a thread cannot spend it faster), within the guard."""
        if not self.cpu:
            return 0.0  # the timer was set to the budget itself
        waited = time.monotonic() - self.wall0
        return min(self.seconds - (time.thread_time() - self.cpu0), self.guard - waited)

    def why(self) -> str:
        """How the budget ran out, for ``CheckTimeout``'s message."""
        if not self.cpu:
            return ""
        used = time.thread_time() - self.cpu0
        if used >= self.seconds:
            return " of CPU time"
        return (f": no result after {self.guard:g} s of wall-clock time ({WALL_GUARD_FACTOR:g} "
                f"times the budget) having used {used:.3g} s of CPU; it waits on something")  # fmt: skip


def _on_alarm(signum: int, frame: Any) -> None:
    if not _ARMED:  # a late signal after the call ended must not raise anywhere else
        return
    left = _ARMED[0].left()
    if left > 0:  # CPU clock: the call spent part of the wait off the CPU
        signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
        return
    raise _Expired()


def _why_unbudgeted() -> str | None:
    if not hasattr(signal, "setitimer") or not hasattr(signal, "SIGALRM"):
        return "this platform has no SIGALRM"
    if threading.current_thread() is not threading.main_thread():
        return "scoring runs outside the main thread, where no signal arrives"
    if _ARMED or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return "another interval timer of this process is running"
    return None


def call_with_budget(
    fn: Callable[..., T], *args: Any, seconds: float | None, what: str, clock: str = "wall"
) -> T:
    """``fn(*args)``, interrupted with ``CheckTimeout`` (naming ``what``) after ``seconds``
    (None: no budget) of ``clock``: ``"wall"``, or ``"cpu"`` (with the wall guard)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: one of {CLOCKS}")
    if seconds is None:
        return fn(*args)
    why = _why_unbudgeted()
    if why is not None:
        if why not in _WARNED:
            _WARNED.add(why)
            log.warning(
                "verifier and reward calls run without their time budget "
                "(task.checker_timeout_s, task.reward_timeout_s): %s",
                why,
            )
        return fn(*args)
    budget = _Budget(float(seconds), clock)
    old = signal.signal(signal.SIGALRM, _on_alarm)
    _ARMED.append(budget)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, float(seconds))
            return fn(*args)
        finally:
            _disarm(old)
    except _Expired:
        _disarm(old)  # the signal may have landed inside the first _disarm
        raise CheckTimeout(what, float(seconds), budget.why()) from None


def _disarm(old: Any) -> None:
    _ARMED.clear()
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)
