"""SIGTERM and SIGINT end a run within a bounded time (``SignalStop``, via ``run_and_exit``):
one log line, ``job.json`` says interrupted, exit status 128 + the signal's number, and a
reward's leftover threads never keep the process alive."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from mrtpo.core.errors import CompactHydraException

log = logging.getLogger(__name__)


#: How long a SIGTERM lets the running step go on: Lightning stops at the end of a step, but a
#: step held up by a reward that never returns is interrupted after this many seconds.
STEP_GRACE_S = 15.0
#: How long a stopping run may take to write its records and close its files; past it the
#: process exits at once (``os._exit``) after flushing its logs.
EXIT_GRACE_S = 15.0
#: How long the end of a process waits for threads still running (a reward's own threads).
THREAD_GRACE_S = 5.0


class RunInterrupted(CompactHydraException):
    """The run stopped on SIGTERM or SIGINT. An ``Exception`` so Hydra records the job
    (``job_status``) and prints the message alone; ``trained``: the run folder was written to."""

    job_status = "interrupted"

    def __init__(self, signum: int, step: int | None, trained: bool, before: bool = False):
        name = signal.Signals(signum).name
        where = f"after step {step}" if step is not None else "before training started"
        if before:
            where = "before this run started"
        self.exit_status = 128 + signum
        self.trained = trained
        super().__init__(f"the run stopped on {name} {where} (exit status {self.exit_status})")


class Interrupt(KeyboardInterrupt):
    """Raised in the main thread by ``SignalStop`` when the run must stop at once. A
    ``KeyboardInterrupt``, so Lightning and the scoring code stop as they do on Ctrl-C."""


class SignalStop:
    """What the process does on SIGTERM and SIGINT (one instance: ``STOP``). Each signal, or
    grace period run out, goes one level further:

    1. SIGTERM while fitting: the step ends, Lightning's ``received_sigterm`` stops the fit;
    2. SIGINT, a signal outside fitting, a second signal, or a step still running
       ``STEP_GRACE_S`` later: ``Interrupt`` in the main thread; the run unwinds its records;
    3. a signal while unwinding, or ``EXIT_GRACE_S`` later: logs flushed, ``os._exit``.

    A watchdog thread keeps the time and logs; handlers only set fields (starting a thread or
    logging inside one could deadlock)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.step: int | None = None  # steps done when the signal came
        self.level = 0  # 0 running; 1 waiting for the step's end; 2 unwinding; 3 exiting
        self.trainer: Any = None  # while it fits
        self.folder: Path | None = None  # the run folder, for the resume hint
        self.ckpt_dir: Path | None = None
        self.trained = False  # the current run has begun to write its folder
        self.last_step: int | None = None  # steps done when the current run's fit ended
        self.finished = False  # the entry point has returned: only the exit is left
        self._nudged = False
        self._wake = threading.Event()
        self._announced = threading.Lock()
        self._installed = False

    @property
    def exit_status(self) -> int:
        return 128 + int(self.signum or signal.SIGTERM)

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this process (a signal already ignored stays ignored)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        for signum, default in (
            (signal.SIGTERM, signal.SIG_DFL),
            (signal.SIGINT, signal.default_int_handler),
        ):
            if signal.getsignal(signum) is default:
                signal.signal(signum, self._on_signal)
        threading.Thread(target=self._watch, name="mrtpo-stop-watchdog", daemon=True).start()
        self._installed = True

    # -- in the main thread, between two bytecodes: set fields, raise, nothing else

    def _on_signal(self, signum: int, frame: Any) -> None:
        nudge, self._nudged = self._nudged, False
        before = self.level
        if before == 0:
            self.signum, self.step = signum, self._steps_done()
            # Lightning's handler ran first and stops the fit at the end of this step
            fitting = self.trainer is not None and getattr(self.trainer, "received_sigterm", 0)
            self.level = 1 if signum == signal.SIGTERM and fitting else 2
        elif before == 1:
            self.level = 2
        elif not nudge:  # the user insists while the run unwinds: the watchdog exits now
            self.level = 3
        self._wake.set()
        if before < 2 and self.level == 2 and not self.finished:
            raise Interrupt()

    def _steps_done(self) -> int | None:
        try:
            return None if self.trainer is None else int(self.trainer.global_step)
        except Exception:
            return None

    # -- the watchdog thread

    def _watch(self) -> None:
        self._wake.wait()
        self.announce()
        if self._wait_while(1, STEP_GRACE_S):
            log.warning(
                "the step did not end within %g s of %s: interrupting it",
                STEP_GRACE_S,
                signal.Signals(self.signum).name,
            )
            self._nudged = True
            signal.pthread_kill(threading.main_thread().ident, self.signum)
        if self._wait_while(2, EXIT_GRACE_S):
            self._exit_now(f"the run did not stop within {EXIT_GRACE_S:g} s: exiting now")
        self._exit_now("a further signal while the run stops: exiting now")

    def _wait_while(self, level: int, seconds: float) -> bool:
        """Wait while the stop is at ``level``, at most ``seconds``; True when time ran out."""
        deadline = time.monotonic() + seconds
        while self.level <= level:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            self._wake.clear()
            if self.level <= level:
                self._wake.wait(min(left, 0.5))
        return False

    def announce(self) -> None:
        """The one log line of a stop: the signal, the step, how to go on."""
        if self.signum is None or not self._announced.acquire(blocking=False):
            return
        if any(os.environ.get(v, "0") != "0" for v in ("RANK", "LOCAL_RANK")):
            return  # a DDP worker: the launching process says it
        name = signal.Signals(self.signum).name
        where = f"at step {self.step}" if self.step is not None else "before training started"
        log.warning("received %s %s: stopping; %s", name, where, self._resume_hint())

    def _resume_hint(self) -> str:
        if self.folder is None:
            return "the run has no folder to resume"
        ckpt_dir = self.ckpt_dir or self.folder / "checkpoints"
        if (Path(ckpt_dir) / "last.ckpt").is_file():
            from mrtpo.run.resume import resume_command

            return f"resume with {resume_command(self.folder)}"
        return f"{self.folder} holds no checkpoint yet: start the run again"

    def _exit_now(self, why: str) -> NoReturn:
        """Log ``why``, flush the logs and the console (3 s at most), end the process."""

        def flush() -> None:
            log.error("%s (exit status %d)", why, self.exit_status)
            for handler in logging.getLogger().handlers:
                handler.flush()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()

        flusher = threading.Thread(target=flush, name="mrtpo-stop-flush", daemon=True)
        flusher.start()
        flusher.join(3.0)  # a lock held for ever by the stuck main thread must not hold us
        os._exit(self.exit_status)

    # -- around a run (mrtpo.lightning.pipeline.train) and its fit

    def guarding(self, folder: Path | None) -> _Guard:
        """A context for one run: a stop for a signal leaves it as ``RunInterrupted``, and a
        run does not start once a signal came (the next job of a sweep, a warm start)."""
        return _Guard(self, folder)

    def fitting(self, trainer: Any, ckpt_dir: str | Path | None) -> _Fitting:
        """A context for writing the run folder and fitting: a SIGTERM then waits for the end
        of the running step."""
        return _Fitting(self, trainer, ckpt_dir)


class _Guard:
    def __init__(self, stop: SignalStop, folder: Path | None) -> None:
        self.stop, self.folder = stop, folder

    def __enter__(self) -> None:
        stop = self.stop
        if stop.signum is not None:
            raise RunInterrupted(stop.signum, None, trained=False, before=True)
        self.saved = stop.folder, stop.ckpt_dir, stop.trained, stop.last_step
        stop.folder, stop.ckpt_dir, stop.trained, stop.last_step = self.folder, None, False, None

    def __exit__(self, kind, exc, tb) -> None:
        stop = self.stop
        try:
            if exc is None or isinstance(exc, RunInterrupted):
                return
            if stop.signum is None and _is_lightning_sigterm(exc):
                stop.signum = signal.SIGTERM  # Lightning's handler alone saw it (not ours)
                stop.step = stop.last_step
            if stop.signum is None:
                return
            stop.level = max(stop.level, 2)
            stop.announce()  # (the watchdog's line, unless it is still to come)
            from mrtpo.run.cli import log_to_files

            log_to_files(logging.INFO, "where the signal stopped the run", exc)
            raise RunInterrupted(stop.signum, stop.last_step, stop.trained) from exc
        finally:
            stop.folder, stop.ckpt_dir, stop.trained, stop.last_step = self.saved


class _Fitting:
    def __init__(self, stop: SignalStop, trainer: Any, ckpt_dir: str | Path | None) -> None:
        self.stop, self.trainer = stop, trainer
        self.ckpt_dir = Path(str(ckpt_dir)) if ckpt_dir else None

    def __enter__(self) -> None:
        stop = self.stop
        stop.trainer, stop.ckpt_dir, stop.trained = self.trainer, self.ckpt_dir, True

    def __exit__(self, kind, exc, tb) -> None:
        stop = self.stop
        stop.last_step = stop._steps_done()
        stop.trainer = None
        if stop.signum is None:
            return
        stop.level = max(stop.level, 2)  # the step has ended: nothing left to wait for
        stop._wake.set()
        if exc is None:
            log.warning(
                "the run reached trainer.max_steps=%s before %s could stop it: it is complete",
                getattr(self.trainer, "max_steps", "?"),
                signal.Signals(stop.signum).name,
            )


def _is_lightning_sigterm(exc: BaseException) -> bool:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    return isinstance(exc, SIGTERMException)


STOP = SignalStop()


def _leftover_threads(grace_s: float) -> list[str]:
    """Wait up to ``grace_s`` for the non-daemon threads still running; the names of those
    that are still running then."""
    deadline = time.monotonic() + grace_s
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]


def _status(code: Any) -> int:
    """The exit status of ``SystemExit(code)``, as Python gives it (text is printed, then 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_and_exit(main: Callable[[], Any]) -> NoReturn:
    """Run ``main`` with ``STOP`` installed and end the process with its status (128 + the
    signal's number after a stop). Non-daemon threads still running ``THREAD_GRACE_S`` later
    are named in a warning and not waited for."""
    STOP.install()
    try:
        main()
        status = 0
    except SystemExit as exc:
        status = _status(exc.code)
    except KeyboardInterrupt:
        status = 130
        if STOP.signum is None:
            traceback.print_exc()
    except BaseException:  # (HYDRA_FULL_ERROR=1: Hydra lets the exception through)
        traceback.print_exc()
        status = 1
    STOP.finished = True
    if STOP.signum is not None and status != 0:
        status = STOP.exit_status
    left = _leftover_threads(THREAD_GRACE_S)
    if not left:
        sys.exit(status)
    log.warning(
        "exiting without waiting for %d thread(s) still running after the run ended: %s "
        "(started by a reward or other user code; give such threads daemon=True, or end them)",
        len(left),
        ", ".join(left),
    )
    atexit._run_exitfuncs()  # what the interpreter runs at exit: closes the log files
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
