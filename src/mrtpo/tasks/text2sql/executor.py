"""Safe, parallel execution of model-written SQL against SQLite files.

A policy under RL will eventually write queries that try to change the database, attach
files, load extensions or never finish; scoring must stay correct and the trainer must survive
them all. The defences, outside in (docs/tasks/text2sql.md, "Safety model", gives each one's
limits): ``precheck`` in the parent; worker processes started as ``python -S -E executor.py``
(standard library only) under ``memory_mb``, ``RLIMIT_FSIZE = 0`` and ``PR_SET_PDEATHSIG``; a
read-only immutable connection; the authorizer (reads only); SQLite's own limits; a
progress-handler budget of ``timeout_s`` CPU seconds per statement, backed by a CPU-time
timer (``hard_margin_s`` CPU seconds later its ``SIGPROF`` ends the worker) and by the parent's
wall-clock deadline ``wall_margin_s`` after that (the worker is killed and replaced, a crashed
one's job retried once); row and byte caps on results. The budgets count CPU time, so a
loaded machine does not turn a query that finishes into one that timed out.

Every failure carries a kind (``ExecOutcome.pred_error_kind``, one of ``ERROR_KINDS``) so that
the task words it honestly. Results never travel back to the trainer: a worker compares them
(``match.results_match``) and returns a summary; its LRU cache of reference results runs the
reference of a prompt's ``G`` samples once per worker. Unix only (``poll``, ``resource``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pickle
import re
import select
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

if __package__:
    from .match import results_match
else:  # started as a script inside a worker process: only this folder is on sys.path
    from match import results_match  # type: ignore[no-redef]

# ---- Shared settings and data types -----------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Resource limits of one executor (all of them configurable from the task config)."""

    timeout_s: float = 5.0  # CPU seconds per statement (soft: progress handler)
    hard_margin_s: float = 0.5  # CPU seconds past timeout_s before a CPU timer ends the worker
    wall_margin_s: float = 30.0  # then wall seconds before the parent kills a silent worker
    max_rows: int = 100_000
    max_result_bytes: int = 64 * 2**20
    max_value_bytes: int = 16 * 2**20  # SQLITE_LIMIT_LENGTH: longest string/blob/row
    max_query_chars: int = 100_000
    memory_mb: int = 2048  # address-space limit of a worker process (0: none)
    progress_steps: int = 10_000  # VM steps between deadline checks (0: no soft budget)
    gold_cache_size: int = 4096  # reference results kept per worker
    gold_cache_max_rows: int = 20_000  # larger reference results are not cached


@dataclass(frozen=True)
class ExecJob:
    """One unit of work: run ``pred`` (and/or ``gold``) on ``db`` and compare them.

    ``pred`` is checked for executability as written (after the evaluator's clean-up);
    ``pred_match`` / ``gold`` are the texts compared for execution match (DISTINCT removed
    unless the task keeps it). ``pred_match`` defaults to ``pred``.
    """

    db: str
    pred: str | None = None
    gold: str | None = None
    pred_match: str | None = None
    ordered: bool = False
    mode: str = "spider"


#: Why a statement did not give a result (``ExecOutcome.pred_error_kind``): kind -> meaning.
ERROR_KINDS = {
    "sqlite": "SQLite raised an error (syntax, unknown column, the authorizer's denial)",
    "driver": "Python's sqlite3 module refused the text (a NUL character, two statements)",
    "time": "the executor's time budget stopped the statement",
    "memory": "the executor's memory cap stopped the statement",
    "rows": "it ran without error, but its result is over the row cap (not read to the end)",
    "bytes": "it ran without error, but its result is over the size cap (not read to the end)",
    "refused": "refused before running (empty, too long, a writing statement)",
    "crash": "the worker process died",
    "database": "the database file is missing or cannot be opened",
}
#: Kinds whose query ran without error: only its result was too large to read in full.
RESULT_CAP_KINDS = frozenset({"rows", "bytes"})
#: A statement's rows, or ``None`` with the error and its kind.
Result = tuple[list[tuple] | None, str | None, str | None]


@dataclass
class ExecOutcome:
    """What happened to one job. ``None`` fields were not attempted."""

    pred_ok: bool | None = None
    pred_error: str | None = None
    pred_error_kind: str | None = None  # one of ERROR_KINDS when pred_ok is False
    pred_rows: int | None = None
    gold_ok: bool | None = None
    gold_error: str | None = None
    gold_rows: int | None = None
    match: bool | None = None
    match_error: str | None = None  # the DISTINCT-free variant failed while the query ran
    seconds: float = 0.0
    killed: bool = False  # the worker had to be killed (hard deadline) or crashed


#: The fields a prediction-only run fills (merged into an outcome decided before it ran).
_PRED_FIELDS = ("pred_ok", "pred_error", "pred_error_kind", "pred_rows", "seconds", "killed")


# ---- Worker side (runs in the child process) --------------------------------------------

_ALLOWED_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    getattr(sqlite3, "SQLITE_RECURSIVE", 33),
}
_FUNCTION_ACTION = sqlite3.SQLITE_FUNCTION
_DENIED_FUNCTIONS = frozenset(
    {"load_extension", "fts3_tokenizer", "readfile", "writefile", "edit", "sqlite_dbpage"}
)


def _authorize(action: int, arg1: Any, arg2: Any, db_name: Any, trigger: Any) -> int:
    """Allow reading queries only; everything else is denied."""
    if action == _FUNCTION_ACTION:
        name = (arg2 or "").lower()
        return sqlite3.SQLITE_DENY if name in _DENIED_FUNCTIONS else sqlite3.SQLITE_OK
    if action in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def readonly_uri(path: str) -> str:
    """``file:`` URI that opens ``path`` read-only and immutable (no locks, no journal)."""
    return f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro&immutable=1"


def _setlimit(con: sqlite3.Connection, name: str, value: int) -> None:
    if hasattr(con, "setlimit") and hasattr(sqlite3, name):  # Python >= 3.11
        con.setlimit(getattr(sqlite3, name), value)


def open_guarded(path: str, limits: Limits) -> tuple[sqlite3.Connection, list[float]]:
    """A read-only connection with the authorizer, limits and a deadline progress handler,
    and a one-element list holding the deadline (``time.thread_time()``, the CPU time of the
    thread running SQLite) of each statement."""
    con = sqlite3.connect(readonly_uri(path), uri=True, isolation_level=None)
    # The official evaluator decodes text leniently; so do we (also avoids decode errors).
    con.text_factory = lambda b: b.decode(errors="ignore")
    _setlimit(con, "SQLITE_LIMIT_ATTACHED", 0)
    _setlimit(con, "SQLITE_LIMIT_LENGTH", limits.max_value_bytes)
    _setlimit(con, "SQLITE_LIMIT_SQL_LENGTH", max(limits.max_query_chars * 4, 1000))
    if hasattr(con, "enable_load_extension"):
        con.enable_load_extension(False)
    con.execute("PRAGMA temp_store = MEMORY")  # sorts spill to memory, never to temp files
    con.set_authorizer(_authorize)
    deadline = [math.inf]
    if limits.progress_steps > 0:
        con.set_progress_handler(lambda: time.thread_time() > deadline[0], limits.progress_steps)
    return con, deadline


def _value_size(v: Any) -> int:
    return len(v) if isinstance(v, (str, bytes)) else 8


def time_limit_message(limits: Limits) -> str:
    return f"the query did not finish within the executor's {limits.timeout_s:g} s time limit"


def _cpu_cap(limits: Limits | None) -> None:
    """Worker only: a profiling timer (``ITIMER_PROF``, which counts this process's CPU time)
    whose ``SIGPROF`` ends the process once it has used ``timeout_s + hard_margin_s`` more CPU
    seconds; ``None`` disarms it."""
    seconds = 0.0 if limits is None else limits.timeout_s + limits.hard_margin_s
    signal.setitimer(signal.ITIMER_PROF, seconds)


def _friendly_error(exc: BaseException, limits: Limits) -> tuple[str, str]:
    """(message, kind) of an exception raised while running a statement."""
    msg = str(exc).strip() or type(exc).__name__
    if isinstance(exc, MemoryError) or msg == "out of memory":  # ours, or SQLite's malloc
        return f"out of memory (the executor's limit is {limits.memory_mb} MB)", "memory"
    if not isinstance(exc, sqlite3.Error) or isinstance(exc, sqlite3.ProgrammingError):
        # raised by Python's module before SQLite saw the text (a NUL character, two
        # statements, an integer too large for SQLite)
        return msg, "driver"
    if msg == "interrupted":  # only our progress handler interrupts
        return time_limit_message(limits), "time"
    if msg in ("not authorized", "authorization denied") or msg.startswith("not authorized"):
        return f"{msg} (only read-only SELECT queries may run here)", "sqlite"
    if msg == "string or blob too big":
        return f"{msg} (values are capped at {limits.max_value_bytes} bytes)", "sqlite"
    return msg, "sqlite"


def execute_guarded(
    con: sqlite3.Connection, deadline: list[float], sql: str, limits: Limits
) -> Result:
    """Run one statement under the time budget and result caps (``Result``)."""
    deadline[0] = time.thread_time() + limits.timeout_s
    cur = None
    try:
        cur = con.execute(sql)
        rows: list[tuple] = []
        size = 0
        while chunk := cur.fetchmany(1024):
            rows.extend(chunk)
            if len(rows) > limits.max_rows:
                error = f"the result has more than the executor's limit of {limits.max_rows} rows"
                return None, error, "rows"
            size += sum(_value_size(v) for row in chunk for v in row)
            if size > (cap := limits.max_result_bytes):
                error = f"the result is larger than the executor's limit of {cap} bytes"
                return None, error, "bytes"
        return rows, None, None
    except (sqlite3.Error, MemoryError, OverflowError, ValueError, RecursionError) as exc:
        return None, *_friendly_error(exc, limits)
    finally:
        deadline[0] = math.inf
        if cur is not None:
            with contextlib.suppress(sqlite3.Error):
                cur.close()


def _file_key(path: str) -> tuple | None:
    """The file's identity (path, mtime, size): a replaced file gets a new key."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.abspath(path), st.st_mtime_ns, st.st_size


class _WorkerState:
    """Connections (by file identity) and the reference-result cache of one worker."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.connections: OrderedDict[tuple, tuple[sqlite3.Connection, list[float]]] = OrderedDict()
        self.gold_cache: OrderedDict[tuple, Result] = OrderedDict()

    def run(self, db: str, sql: str) -> Result:
        key = _file_key(db)
        if key is None:
            return None, f"database file not found: {db}", "database"
        if key in self.connections:
            self.connections.move_to_end(key)
        else:
            try:
                self.connections[key] = open_guarded(db, self.limits)
            except sqlite3.Error as exc:
                return None, f"cannot open database {db}: {exc}", "database"
            while len(self.connections) > 64:
                self.connections.popitem(last=False)[1][0].close()
        con, deadline = self.connections[key]
        _cpu_cap(self.limits)
        try:
            return execute_guarded(con, deadline, sql, self.limits)
        finally:
            _cpu_cap(None)

    def gold(self, db: str, sql: str, tick) -> Result:
        key = (_file_key(db), sql)
        if key in self.gold_cache:
            self.gold_cache.move_to_end(key)
            return self.gold_cache[key]
        tick("gold")
        result = self.run(db, sql)
        rows = result[0]
        if key[0] is None:  # no such file: nothing to remember
            return result
        if rows is None or len(rows) <= self.limits.gold_cache_max_rows:
            self.gold_cache[key] = result
            while len(self.gold_cache) > self.limits.gold_cache_size:
                self.gold_cache.popitem(last=False)
        return result

    def handle(self, job: ExecJob, tick) -> ExecOutcome:
        t0 = time.perf_counter()
        out = ExecOutcome()
        gold_rows = None
        if job.gold is not None:
            gold_rows, out.gold_error, _ = self.gold(job.db, job.gold, tick)
            out.gold_ok = gold_rows is not None
            out.gold_rows = None if gold_rows is None else len(gold_rows)
        if job.pred is not None:
            tick("pred")
            rows, out.pred_error, out.pred_error_kind = self.run(job.db, job.pred)
            out.pred_ok = rows is not None
            out.pred_rows = None if rows is None else len(rows)
            if rows is not None and job.pred_match is not None and job.pred_match != job.pred:
                tick("pred")
                rows, out.match_error, _ = self.run(job.db, job.pred_match)
            if job.gold is not None:
                if rows is None or gold_rows is None:
                    out.match = False
                else:
                    out.match = results_match(gold_rows, rows, job.ordered, job.mode)
        out.seconds = time.perf_counter() - t0
        return out


def _frame(obj: Any) -> bytes:
    """A length-prefixed pickle: the pipe protocol in both directions."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack(">I", len(data)) + data


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent goes away, even in the middle of a long step
    (elsewhere a worker exits at the next read of its closed pipe)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _apply_process_limits(limits: Limits) -> None:
    try:
        import resource
    except ImportError:  # not on Unix: the other defences still hold
        return
    if limits.memory_mb > 0:
        cap = limits.memory_mb * 2**20
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    # No file may be written by this process; writes fail with EFBIG instead of a signal.
    with contextlib.suppress(ValueError, OSError, AttributeError):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def serve(limits: Limits) -> None:
    """Worker main loop: length-prefixed pickled jobs on stdin, replies on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent
    # The CPU timer's SIGPROF must end this process, whatever the trainer passed on.
    signal.signal(signal.SIGPROF, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGPROF})
    _die_with_parent()
    out_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed by mistake goes to stderr, not into the protocol
    out = os.fdopen(out_fd, "wb", buffering=0)
    inp = sys.stdin.buffer
    _apply_process_limits(limits)
    state = _WorkerState(limits)

    def tick(stage: str) -> None:
        out.write(_frame(("tick", stage)))

    # A buffered pipe's read(n) returns fewer than n bytes only at end of file: the parent
    # closed the pipe (or died).
    while len(header := inp.read(4)) == 4:
        n = struct.unpack(">I", header)[0]
        if len(payload := inp.read(n)) < n:
            return
        try:
            outcome = state.handle(ExecJob(**pickle.loads(payload)), tick)
        except Exception as exc:  # a bug here must not kill the worker
            outcome = ExecOutcome(
                pred_ok=False, pred_error=f"executor error: {exc!r}", pred_error_kind="crash"
            )
        # Only built-in types cross the pipe: the two sides name these classes differently.
        out.write(_frame(("done", asdict(outcome))))


# ---- Parent side ------------------------------------------------------------------------

_FIRST_WORD = re.compile(r"[A-Za-z]+")
_LEADING_NOISE = re.compile(r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/|\()*", re.DOTALL)
# Statements that can only change something. The authorizer denies them anyway; refusing
# them here saves a process round trip and gives a clearer reason. Anything else (a
# typo such as "SELEC" included) goes to SQLite, whose own error message is more useful.
_WRITING_STATEMENTS = frozenset(
    {"insert", "update", "delete", "replace", "upsert", "merge"}  # rows
    | {"drop", "create", "alter", "attach", "detach", "pragma", "vacuum", "reindex", "analyze"}
    | {"begin", "commit", "end", "rollback", "savepoint", "release"}  # transactions
)


def precheck(sql: str, limits: Limits) -> str | None:
    """Reasons to refuse a query without running it (None: go ahead)."""
    if (n := len(sql)) > (cap := limits.max_query_chars):
        return f"the query is {n} characters long, over the {cap}-character limit"
    if not sql.strip():
        return "the query is empty"
    m = _FIRST_WORD.match(sql, _LEADING_NOISE.match(sql).end())
    word = m.group(0).lower() if m else ""
    if word in _WRITING_STATEMENTS:
        return f"not authorized: only read-only SELECT queries may run here, not {word.upper()}"
    return None


class _Worker:
    """One child process and its read buffer."""

    def __init__(self, limits: Limits) -> None:
        # -S -E: no site-packages, no PYTHON* variables; the worker needs only the standard
        # library and match.py (found next to this file, the script's folder).
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-E", os.path.abspath(__file__), json.dumps(asdict(limits))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=os.path.sep,  # relative paths in a query point nowhere writable
            close_fds=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.started = time.monotonic()

    def send(self, frame: bytes) -> None:
        self.proc.stdin.write(frame)
        self.proc.stdin.flush()

    def read_messages(self) -> list[tuple[str, Any]] | None:
        """Messages available now; None at end of file (the worker died)."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buf += chunk
        msgs = []
        while len(self.buf) >= 4:
            n = struct.unpack(">I", self.buf[:4])[0]
            if len(self.buf) < 4 + n:
                break
            msgs.append(pickle.loads(self.buf[4 : 4 + n]))
            self.buf = self.buf[4 + n :]
        return msgs

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # EOF: the worker exits on its own
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        else:
            self.proc.stdout.close()


def _shutdown(workers: list[_Worker]) -> None:
    while workers:
        workers.pop().close()


class SQLExecutor:
    """Runs :class:`ExecJob` batches in parallel through a self-healing worker pool.

    Thread-safe (one batch at a time); picklable (the pool is not copied: a copy starts
    its own workers when first used). Workers start on the first batch and stay up until
    :meth:`close`, garbage collection or interpreter exit.
    """

    #: Jobs queued in one worker at a time (hides the parent's round-trip latency). Only
    #: small jobs are queued behind a running one, so that the queued bytes always fit in
    #: the pipe's buffer (64 KiB on Linux) and writing never blocks.
    PIPELINE = 4
    PIPELINE_MAX_BYTES = 8192

    def __init__(self, workers: int | None = None, **limits: Any) -> None:
        self.limits = Limits(**limits)
        self.n_workers = max(1, int(workers or min(4, os.cpu_count() or 1)))
        self.stats = {"jobs": 0, "killed": 0, "crashed": 0, "restarts": 0}
        self._init_pool()

    def _init_pool(self) -> None:
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        weakref.finalize(self, _shutdown, self._workers)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_workers", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_pool()

    def close(self) -> None:
        """Stop the worker processes (new ones start with the next batch)."""
        with self._lock:
            _shutdown(self._workers)

    # -- public API --------------------------------------------------------------------
    def run(self, jobs: Sequence[ExecJob]) -> list[ExecOutcome]:
        """Execute ``jobs`` in parallel; outcomes come back in the same order.

        Nothing a query does makes this raise: refused, failing, hanging and crashing
        queries all come back as failed outcomes with a reason.
        """
        results: list[ExecOutcome | None] = [None] * len(jobs)
        partial: dict[int, ExecOutcome] = {}  # outcomes decided before running (merged)
        work: dict[int, ExecJob] = {}
        for i, job in enumerate(jobs):
            # Workers run in "/": relative database paths are resolved here.
            job = dataclasses.replace(job, db=os.path.abspath(job.db))
            pred_reason = None if job.pred is None else precheck(job.pred, self.limits)
            gold_reason = None if job.gold is None else precheck(job.gold, self.limits)
            if pred_reason is None and gold_reason is None:
                work[i] = job
                continue
            out = ExecOutcome()
            if gold_reason is not None:
                out.gold_ok, out.gold_error = False, gold_reason
            if pred_reason is not None:
                out.pred_ok, out.pred_error, out.pred_error_kind = False, pred_reason, "refused"
            if job.pred is not None and job.gold is not None:
                out.match = False
            if job.pred is not None and pred_reason is None:
                # The reference is refused but the prediction may run: report executability.
                partial[i] = out
                work[i] = dataclasses.replace(job, gold=None, pred_match=None)
            else:
                results[i] = out
        if work:
            with self._lock:
                _PoolRound(self, work, results, partial).run()
        for i, out in partial.items():
            if (got := results[i]) is not None:
                for name in _PRED_FIELDS:
                    setattr(out, name, getattr(got, name))
            results[i] = out
        lost = ExecOutcome(pred_ok=False, pred_error="lost", pred_error_kind="crash")
        return [r if r is not None else dataclasses.replace(lost) for r in results]

    def check(self, db: str, sql: str) -> ExecOutcome:
        """Executability of one query."""
        return self.run([ExecJob(db=db, pred=sql)])[0]


class _PoolRound:
    """One ``SQLExecutor.run`` call's jobs spread over the executor's worker processes.

    Each worker holds up to ``PIPELINE`` jobs (FIFO) so that it never waits for the parent.
    The head job is the one running; its stage and hard deadline are tracked. A worker
    that dies or passes its deadline is replaced; its queued jobs go back to ``pending``.
    """

    def __init__(
        self,
        ex: SQLExecutor,
        work: dict[int, ExecJob],
        results: list[ExecOutcome | None],
        partial: dict[int, ExecOutcome],
    ) -> None:
        self.ex, self.work, self.results, self.partial = ex, work, results, partial
        self.lim = ex.limits
        self.stage_s = self.lim.timeout_s + self.lim.hard_margin_s + self.lim.wall_margin_s
        self.by_fd = {w.fd: w for w in ex._workers}
        self.queue: dict[int, deque[tuple[int, int]]] = {w.fd: deque() for w in ex._workers}
        while len(ex._workers) < min(ex.n_workers, len(work)):
            self._spawn()
        self.pending = deque((i, 0) for i in work)  # (job index, attempt)
        self.frames: dict[int, bytes] = {}  # encoded jobs
        self.head: dict[int, list[Any]] = {}  # fd -> [deadline, start time, stage]

    def run(self) -> None:
        while self.pending or any(self.queue.values()):
            for w in list(self.ex._workers):
                self._feed(w)
            if not self.head:
                continue
            for fd in self._wait_ready():
                self._read(fd)
            self._expire()

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.ex._workers.remove(w)
        self.by_fd.pop(w.fd, None)
        for i, attempt in reversed(self.queue.pop(w.fd, deque())):
            self.pending.appendleft((i, attempt))  # not started: no attempt used
        self.head.pop(w.fd, None)
        self._spawn()
        self.ex.stats["restarts"] += 1

    def _spawn(self) -> None:
        w = _Worker(self.lim)
        self.ex._workers.append(w)
        self.by_fd[w.fd] = w
        self.queue[w.fd] = deque()

    def _feed(self, w: _Worker) -> None:
        """Send pending jobs to ``w`` until its pipeline is full."""
        q, pending = self.queue[w.fd], self.pending
        while pending and len(q) < self.ex.PIPELINE:
            i, attempt = pending[0]
            if i not in self.frames:  # pickled once, however often the job is sent
                self.frames[i] = _frame(asdict(self.work[i]))
            frame = self.frames[i]
            if q and len(frame) > self.ex.PIPELINE_MAX_BYTES:
                # A busy worker does not read its pipe: a large write would block
                # the parent (and its deadlines) until the running query ends.
                break
            pending.popleft()
            try:
                w.send(frame)
            except OSError:  # the worker is gone already
                pending.appendleft((i, attempt))
                self.ex.stats["crashed"] += 1
                self._replace(w)
                break
            q.append((i, attempt))
            if w.fd not in self.head:
                # A fresh interpreter needs a moment to start before its first tick.
                grace = 5.0 if time.monotonic() - w.started < 5.0 else 0.0
                now = time.monotonic()
                self.head[w.fd] = [now + self.stage_s + grace, now, "start"]

    def _wait_ready(self) -> list[int]:
        """The descriptors of busy workers with something to read, by the first deadline."""
        timeout = max(0.0, min(h[0] for h in self.head.values()) - time.monotonic())
        # poll, not select: a trainer may hold more than FD_SETSIZE (1024) descriptors
        poller = select.poll()
        for fd in self.head:
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        return [fd for fd, _ in poller.poll(math.ceil(timeout * 1000))]

    def _read(self, fd: int) -> None:
        """Take a worker's ticks and finished jobs; a dead worker fails or retries its head."""
        w, queue, head = self.by_fd[fd], self.queue, self.head
        try:
            msgs = w.read_messages()
        except OSError:
            msgs = None
        if msgs is None:  # the worker died under its head job
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=2)
            if w.proc.returncode == -signal.SIGPROF:  # its CPU budget ran out
                self._stop(fd)
                return
            i, attempt = queue[fd].popleft()
            t0 = head[fd][1]
            self.ex.stats["crashed"] += 1
            self._replace(w)
            if attempt < 1:  # retried once
                self.pending.appendleft((i, attempt + 1))
            else:
                self.results[i] = _failed(self.work[i], "the executor process crashed", "crash", t0)
            return
        for kind, payload in msgs:
            now = time.monotonic()
            if kind == "tick":
                head[fd][0], head[fd][2] = now + self.stage_s, payload
            elif kind == "done":
                i, _attempt = queue[fd].popleft()
                self.results[i] = ExecOutcome(**payload)
                self.ex.stats["jobs"] += 1
                if queue[fd]:
                    head[fd] = [now + self.stage_s, now, "start"]
                else:
                    del head[fd]

    def _expire(self) -> None:
        """Stop the workers whose head job passed its deadline."""
        now = time.monotonic()
        for fd, (deadline, _t0, _stage) in list(self.head.items()):
            if now >= deadline:
                self._stop(fd)

    def _stop(self, fd: int) -> None:
        """The head job of worker ``fd`` ran out of time: replace the worker, fail the job
        (a hung reference: record it and still run the prediction)."""
        _deadline, t0, stage = self.head[fd]
        i, attempt = self.queue[fd].popleft()
        self.ex.stats["killed"] += 1
        self._replace(self.by_fd[fd])
        reason = time_limit_message(self.lim) + " (its worker process was stopped)"
        job = self.work[i]
        if stage == "gold" and job.pred is not None:
            # The reference hung: record that, then still check the prediction.
            self.partial[i] = ExecOutcome(gold_ok=False, gold_error=reason, match=False)
            self.work[i] = dataclasses.replace(job, gold=None, pred_match=None)
            self.frames.pop(i, None)
            self.pending.append((i, attempt))
        else:
            self.results[i] = _failed(job, reason, "time", t0)


def _failed(job: ExecJob, reason: str, kind: str, t0: float) -> ExecOutcome:
    out = ExecOutcome(seconds=time.monotonic() - t0, killed=True)
    if job.pred is not None:
        out.pred_ok, out.pred_error, out.pred_error_kind = False, reason, kind
        if job.gold is not None:
            out.match = False
    else:
        out.gold_ok, out.gold_error = False, reason
    return out


if __name__ == "__main__":
    serve(Limits(**json.loads(sys.argv[1])))
