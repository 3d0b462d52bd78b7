"""SIGTERM and SIGINT end a run within a bounded time (``SignalStop``, via ``run_and_exit``;
docs/reliability.md), and a reward's leftover threads never keep the process alive."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
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
    """The run stopped on SIGTERM or SIGINT (``trained``: its folder was written to)."""

    job_status = "interrupted"

    def __init__(self, signum: int, step: int | None, trained: bool, before: bool = False):
        name = signal.Signals(signum).name
        where = f"after step {step}" if step is not None else "before training started"
        where = "before this run started" if before else where
        self.exit_status = 128 + signum
        self.trained = trained
        super().__init__(f"the run stopped on {name} {where} (exit status {self.exit_status})")


class Interrupt(KeyboardInterrupt):
    """``SignalStop``'s stop at once: Lightning and the scoring code stop as on Ctrl-C."""


class SignalStop:
    """What the process does on SIGTERM and SIGINT (one instance: ``STOP``). Each signal, or
    grace period run out, goes one level further: 1. SIGTERM while fitting: the step ends; 2.
    ``Interrupt`` in the main thread, the run unwinds; 3. logs flushed, ``os._exit``. A
    watchdog thread keeps the time and logs; handlers only set fields (could deadlock)."""

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
        """Handle SIGTERM and SIGINT (a signal already ignored stays ignored)."""
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
                *(STEP_GRACE_S, signal.Signals(self.signum).name),
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

    @contextlib.contextmanager
    def guarding(self, folder: Path | None) -> Iterator[None]:
        """One run: a stop leaves it as ``RunInterrupted``; once a signal came, no run starts."""
        if self.signum is not None:
            raise RunInterrupted(self.signum, None, trained=False, before=True)
        saved = self.folder, self.ckpt_dir, self.trained, self.last_step
        self.folder, self.ckpt_dir, self.trained, self.last_step = folder, None, False, None
        try:
            yield
        except RunInterrupted:
            raise
        except BaseException as exc:
            if self.signum is None and _is_lightning_sigterm(exc):
                self.signum = signal.SIGTERM  # Lightning's handler alone saw it (not ours)
                self.step = self.last_step
            if self.signum is None:
                raise
            self.level = max(self.level, 2)
            self.announce()  # (the watchdog's line, unless it is still to come)
            from mrtpo.run.cli import log_to_files

            log_to_files(logging.INFO, "where the signal stopped the run", exc)
            raise RunInterrupted(self.signum, self.last_step, self.trained) from exc
        finally:
            self.folder, self.ckpt_dir, self.trained, self.last_step = saved

    @contextlib.contextmanager
    def fitting(self, trainer: Any, ckpt_dir: str | Path | None) -> Iterator[None]:
        """While writing the run folder and fitting: a SIGTERM waits for the running step's end."""
        self.trainer, self.trained = trainer, True
        self.ckpt_dir = Path(str(ckpt_dir)) if ckpt_dir else None
        ended = False
        try:
            yield
            ended = True
        finally:
            self.last_step = self._steps_done()
            self.trainer = None
            if self.signum is not None:
                self.level = max(self.level, 2)  # the step has ended: nothing left to wait for
                self._wake.set()
                if ended:
                    log.warning(
                        "the run reached trainer.max_steps=%s before %s could stop it: it is "
                        "complete",
                        *(getattr(trainer, "max_steps", "?"), signal.Signals(self.signum).name),
                    )


def _is_lightning_sigterm(exc: BaseException) -> bool:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    return isinstance(exc, SIGTERMException)


STOP = SignalStop()


def _leftover_threads(grace_s: float) -> list[str]:
    """The names of non-daemon threads still running after waiting up to ``grace_s`` for them."""
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
    """Run ``main`` with ``STOP`` and exit with its status (128 + the signal's after a stop)."""
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
        *(len(left), ", ".join(left)),
    )
    atexit._run_exitfuncs()  # what the interpreter runs at exit: closes the log files
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
