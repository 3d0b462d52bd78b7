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

The same timer gives a custom task's reward, block and success functions their budget
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
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BUDGET_S = 86400.0  # one day: the largest budget a config may give one call
_ARMED: list[object] = []  # the token of the call whose timer is running (at most one)
_WARNED: set[str] = set()


class CheckTimeout(Exception):
    """A verifier call ran past its time budget (the check counts as failed)."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"{what} ran past its time budget of {seconds:g} s")
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


def _on_alarm(signum: int, frame: Any) -> None:
    if _ARMED:  # a late signal after the call ended must not raise anywhere else
        raise _Expired()


def _why_unbudgeted() -> str | None:
    if not hasattr(signal, "setitimer") or not hasattr(signal, "SIGALRM"):
        return "this platform has no SIGALRM"
    if threading.current_thread() is not threading.main_thread():
        return "scoring runs outside the main thread, where no signal arrives"
    if _ARMED or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return "another interval timer of this process is running"
    return None


def call_with_budget(fn: Callable[..., T], *args: Any, seconds: float | None, what: str) -> T:
    """``fn(*args)``, interrupted with ``CheckTimeout`` after ``seconds`` (None: no budget).

    ``what`` names the call in the error (``instruction 'x' checker``).
    """
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
    token = object()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    _ARMED.append(token)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, float(seconds))
            return fn(*args)
        finally:
            _disarm(old)
    except _Expired:
        _disarm(old)  # the signal may have landed inside the first _disarm
        raise CheckTimeout(what, float(seconds)) from None


def _disarm(old: Any) -> None:
    _ARMED.clear()
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)
