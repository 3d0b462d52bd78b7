"""A time budget for one call of a verifier we do not own.

The official instruction checkers (lm-eval's IFEval port, if-verifiable's IFBench port, the
MulDimIF authors' classes) are imported unchanged, and some of them take seconds on text a
policy can write: ``number_placeholders`` on 16k ``[`` characters, ``number_bullet_lists`` on
a long run of newlines, MulDimIF's ``Length_Sentences`` on ordinary long text. We cannot fix
them, so each call runs under a deadline instead: a ``SIGALRM`` timer interrupts the call
(the interpreter and the ``re`` engine both stop for signals), and the caller scores that
check as failed, with the reason.

The interrupt is a ``BaseException`` inside the checker, so a checker's own ``except
Exception`` cannot swallow it; the caller sees an ordinary ``CheckTimeout``. No process is
started: arming and clearing the timer costs a few system calls per check.

Two clocks. ``clock="wall"`` counts wall-clock seconds. ``clock="cpu"`` (the checkers'
``task.checker_timeout_s``) counts the CPU time of the calling thread, so a verdict is
largely independent of how busy the machine is: on a loaded one a check waits for a core,
and waiting costs no CPU time (issue 47: 6,412/6,413 MulDimIF verdicts agreed loaded, 6,413
quiet). Largely, not wholly: a thread whose core's caches or hyperthread sibling are busy
with other work still spends more CPU time on the same check (tens of per cent is
plausible), so a check that needs close to its budget can still flip under load. The guard
against that is the budget's size: it is meant to sit several times above what an ordinary
check costs (the load test uses five times), cutting only runaway checks. The wall timer
still drives the CPU clock: when it fires, the CPU time left (a lower bound on the wall time
it needs) is armed again. A call that waits on something without computing is cut by a
guard of ``WALL_GUARD_FACTOR`` times the budget in wall-clock time, far above the slowdown
any load gives (a thread on a 2-core machine at load 7 gets about a third of a core).

The wall clock gives a custom task's reward, block and success functions their budget
(``task.reward_timeout_s``): a user's function that sleeps or loops forever is cut off like a
slow checker, and that reward is None for that call, with the reason.

Signals reach only the main thread. Off it (a trainer run in a thread), on a platform without
``SIGALRM``, or while another timer of the process is running (we never move someone else's
alarm), the call runs without a budget, and that is logged once.

A budget is a number of seconds in (0, ``MAX_BUDGET_S``] or None (no budget);
``budget_seconds`` checks a config value when the task is built, before any model loads: the
timer cannot take much more than 1e9 s (``OverflowError`` on every call), and a budget of a
day or more per call is better written as null.
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
    """``fn(*args)``, interrupted with ``CheckTimeout`` after ``seconds`` (None: no budget)
    on ``clock``: ``"wall"``, or ``"cpu"`` (the calling thread's CPU time, with the wall
    guard).

    ``what`` names the call in the error (``instruction 'x' checker``).
    """
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
