"""The sandboxed SQLite executor: each defence on its own, and the self-healing worker pool."""

from __future__ import annotations

import os
import pickle
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from mrtpo.tasks.text2sql.executor import (
    ExecJob,
    Limits,
    SQLExecutor,
    execute_guarded,
    open_guarded,
    precheck,
)

HANG = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


@pytest.fixture
def db(tmp_path) -> Path:
    path = tmp_path / "db" / "t.sqlite"
    path.parent.mkdir()
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (a INTEGER, b TEXT)")
    con.executemany("INSERT INTO t VALUES (?, ?)", [(i, f"v{i}") for i in range(50)])
    con.commit()
    con.close()
    return path


@pytest.fixture
def executor():
    ex = SQLExecutor(workers=2, timeout_s=1.0, hard_margin_s=0.5)
    yield ex
    ex.close()


# ---- defences inside SQLite (no parent-side precheck involved) --------------------------------


@pytest.mark.parametrize(
    ("sql", "needle"),
    [
        ("DROP TABLE t", "not authorized"),
        ("DELETE FROM t", "not authorized"),
        ("UPDATE t SET a = 0", "not authorized"),
        ("INSERT INTO t VALUES (1, 'x')", "not authorized"),
        ("WITH x AS (SELECT 1) INSERT INTO t SELECT 1, 'y' FROM x", "not authorized"),
        ("CREATE TABLE u (x)", "not authorized"),
        ("ATTACH DATABASE '{new}' AS evil", ""),
        ("VACUUM INTO '{new}'", ""),
        ("PRAGMA writable_schema = 1", "not authorized"),
        ("PRAGMA journal_mode = WAL", "not authorized"),
        ("SELECT load_extension('{new}')", "load_extension"),
        ("BEGIN IMMEDIATE", "not authorized"),
        ("SELECT * FROM pragma_database_list", "not authorized"),
        ("SELECT randomblob(1000000000)", "too big"),
    ],
)
def test_connection_refuses_everything_but_reading(db, tmp_path, sql, needle):
    new = tmp_path / "new.sqlite"
    limits = Limits(timeout_s=1.0)
    con, deadline = open_guarded(str(db), limits)
    before = db.read_bytes()
    rows, err, kind = execute_guarded(con, deadline, sql.format(new=new), limits)
    assert rows is None and err and needle in err
    assert kind == "sqlite"  # SQLite itself (its authorizer or its length limit) raised
    assert not new.exists()
    assert db.read_bytes() == before
    assert sorted(p.name for p in db.parent.iterdir()) == ["t.sqlite"]  # no journal, no -wal
    # the connection is still usable afterwards
    assert execute_guarded(con, deadline, "SELECT count(*) FROM t", limits) == (
        [(50,)],
        None,
        None,
    )
    con.close()


def test_progress_handler_interrupts_within_budget(db):
    limits = Limits(timeout_s=0.5)
    con, deadline = open_guarded(str(db), limits)
    t0 = time.monotonic()
    rows, err, kind = execute_guarded(con, deadline, HANG, limits)
    assert rows is None and kind == "time"
    assert err == "the query did not finish within the executor's 0.5 s time limit"
    assert time.monotonic() - t0 < 5.0
    con.close()


def test_row_and_size_caps(db):
    limits = Limits(max_rows=10)
    con, deadline = open_guarded(str(db), limits)
    _, err, kind = execute_guarded(con, deadline, "SELECT * FROM t", limits)
    assert (err, kind) == ("the result has more than the executor's limit of 10 rows", "rows")
    limits = Limits(max_result_bytes=100)
    con2, deadline2 = open_guarded(str(db), limits)
    _, err, kind = execute_guarded(con2, deadline2, "SELECT * FROM t", limits)
    assert "larger than the executor's limit of 100 bytes" in err and kind == "bytes"
    # Python's sqlite3 module, not SQLite, refuses a NUL character and two statements
    _, err, kind = execute_guarded(con2, deadline2, "SELECT 1\x00", limits)
    assert kind == "driver" and "null character" in err
    _, err, kind = execute_guarded(con2, deadline2, "SELECT 1; SELECT 2", limits)
    assert kind == "driver" and "one statement at a time" in err
    con.close()
    con2.close()


def test_precheck():
    lim = Limits(max_query_chars=1000)
    assert "1001 characters" in precheck("S" * 1001, lim)
    assert precheck("   ", lim) == "the query is empty"
    assert "DROP" in precheck("/* hi */ (DROP TABLE t", lim)
    assert "ATTACH" in precheck("-- x\n attach 'a' as b", lim)
    assert precheck("WITH a AS (SELECT 1) SELECT * FROM a", lim) is None
    assert precheck("SELEC 1", lim) is None  # SQLite's own syntax error is more useful


# ---- the worker pool ------------------------------------------------------------------------


def test_parallel_batch_in_order(executor, db):
    jobs = [
        ExecJob(db=str(db), pred=f"SELECT a FROM t WHERE a = {i}", gold=f"SELECT {i}")
        for i in range(40)
    ]
    jobs.append(ExecJob(db=str(db), pred="SELECT nope FROM t", gold="SELECT 1"))
    outs = executor.run(jobs)
    assert [o.match for o in outs[:40]] == [True] * 40
    assert outs[40].pred_ok is False and outs[40].match is False
    assert "no such column" in outs[40].pred_error and outs[40].pred_error_kind == "sqlite"
    assert outs[0].gold_ok and outs[0].gold_rows == 1


def test_hung_worker_is_killed_and_replaced(db):
    # progress_steps=0 disables the in-SQLite budget: only the CPU-time timer can stop it (the wall
    # clock's backstop is 30 s away, past the bound below)
    ex = SQLExecutor(workers=1, timeout_s=0.5, hard_margin_s=0.5, progress_steps=0)
    try:
        ex.check(str(db), "SELECT 1")  # warm
        t0 = time.monotonic()
        out = ex.check(str(db), HANG)
        took = time.monotonic() - t0
        assert out.pred_ok is False and out.killed
        assert "process was stopped" in out.pred_error and out.pred_error_kind == "time"
        assert took < 25.0
        assert ex.stats["killed"] == 1 and ex.stats["crashed"] == 0  # not retried as a crash
        assert ex.check(str(db), "SELECT count(*) FROM t").pred_ok  # the pool healed
    finally:
        ex.close()


COUNT_TO = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {n}) "
COUNT_TO += "SELECT count(*) FROM c"


def _cpu_ticks(pid: int) -> int:
    """User + system CPU clock ticks of ``pid`` so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _starve_mid_statement(pid: int, seconds: float) -> threading.Thread:
    """SIGSTOP ``pid`` once it has used 5 more clock ticks of CPU (it is inside the
    statement, whatever the machine's load) and SIGCONT it ``seconds`` later: a worker that
    gets no CPU, as on a machine loaded far beyond its cores."""
    start = _cpu_ticks(pid)

    def pause():
        give_up = time.monotonic() + 120.0  # a hang guard only: the statement ended first
        while _cpu_ticks(pid) < start + 5:
            if time.monotonic() > give_up:
                return
            time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=pause)
    thread.start()
    return thread


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_the_time_budget_counts_cpu_seconds_not_a_loaded_machines_wall_clock(db):
    """A statement that needs well under its budget of CPU still finishes when the worker is
    starved of CPU for longer than the budget (it was stopped as timed out when the budget
    was wall-clock time: the result then depended on the machine's load)."""
    ex = SQLExecutor(workers=1, timeout_s=4.0)
    try:
        ex.check(str(db), "SELECT 1")  # warm
        sql = COUNT_TO.format(n=1_500_000)  # 0.25 s of CPU here
        pid = ex._workers[0].proc.pid
        before = _cpu_ticks(pid)
        assert ex.check(str(db), sql).pred_ok
        cpu = (_cpu_ticks(pid) - before) / os.sysconf("SC_CLK_TCK")  # CPU: load-independent
        assert cpu < 2.0, f"the statement took {cpu:.2f} CPU seconds here: make it smaller"
        thread = _starve_mid_statement(pid, seconds=5.0)
        out = ex.check(str(db), sql)
        thread.join(timeout=300)
        assert not thread.is_alive()
        assert out.seconds > 4.0  # wall time past the budget ...
        assert out.pred_ok, out.pred_error  # ... and still not stopped
        assert ex.stats["killed"] == 0
    finally:
        ex.close()


def test_a_worker_that_stops_using_cpu_is_killed_by_the_wall_clock_backstop(db):
    ex = SQLExecutor(workers=1, timeout_s=0.5, hard_margin_s=0.5, wall_margin_s=1.0)
    try:
        ex.check(str(db), "SELECT 1")  # warm
        time.sleep(5.0)  # past the start-up grace of a fresh worker
        (w,) = ex._workers
        os.kill(w.proc.pid, signal.SIGSTOP)  # no CPU used: neither CPU budget ever fires
        t0 = time.monotonic()
        out = ex.check(str(db), "SELECT 2")
        assert out.pred_ok is False and out.pred_error_kind == "time" and out.killed
        assert "process was stopped" in out.pred_error
        assert 2.0 <= time.monotonic() - t0 < 30.0
        assert ex.stats["killed"] == 1 and w.proc.poll() is not None
        assert ex.check(str(db), "SELECT 3").pred_ok
    finally:
        ex.close()


def test_a_hung_query_does_not_block_the_others(db):
    ex = SQLExecutor(workers=2, timeout_s=0.5, hard_margin_s=0.3, progress_steps=0)
    try:
        jobs = [ExecJob(db=str(db), pred=HANG)] + [
            ExecJob(db=str(db), pred=f"SELECT {i}", gold=f"SELECT {i}") for i in range(20)
        ]
        outs = ex.run(jobs)
        assert outs[0].pred_ok is False
        assert all(o.match for o in outs[1:])
    finally:
        ex.close()


def test_crashed_worker_is_replaced_and_the_job_retried(executor, db):
    executor.check(str(db), "SELECT 1")
    victims = [w.proc.pid for w in executor._workers]

    def kill_soon():
        time.sleep(0.3)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon).start()
    out = executor.check(str(db), HANG)  # interrupted after 1 s, killed at 0.3 s, retried
    assert out.pred_ok is False and out.pred_error_kind == "time"
    assert out.pred_error.startswith("the query did not finish within")
    assert executor.stats["crashed"] >= 1
    assert all(w.proc.pid not in victims for w in executor._workers)
    assert executor.check(str(db), "SELECT 2").pred_ok


def test_gold_results_are_cached_per_worker(db):
    ex = SQLExecutor(workers=1, timeout_s=2.0)
    try:
        slow_gold = (
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 300000) "
            "SELECT count(*) FROM c"
        )
        first = ex.run([ExecJob(db=str(db), pred="SELECT 300000", gold=slow_gold)])[0]
        again = ex.run([ExecJob(db=str(db), pred="SELECT 300000", gold=slow_gold)] * 5)
        assert first.match and all(o.match for o in again)
        assert max(o.seconds for o in again) < first.seconds / 3
    finally:
        ex.close()


def test_missing_database_is_a_reason_not_an_error(executor, tmp_path):
    out = executor.check(str(tmp_path / "nope.sqlite"), "SELECT 1")
    assert out.pred_ok is False and "not found" in out.pred_error


def test_executor_pickles_without_workers(executor, db):
    executor.check(str(db), "SELECT 1")
    clone = pickle.loads(pickle.dumps(executor))
    assert clone._workers == []
    assert clone.check(str(db), "SELECT 1").pred_ok
    clone.close()


def test_workers_load_no_trainer_libraries(db):
    """Workers run the executor file with -S -E: standard library only, no torch or CUDA
    (a forked child of a trainer would map them)."""
    ex = SQLExecutor(workers=1)
    try:
        ex.check(str(db), "SELECT 1")
        (w,) = ex._workers
        assert w.proc.args[1:3] == ["-S", "-E"] and w.proc.args[3].endswith("executor.py")
        maps = Path(f"/proc/{w.proc.pid}/maps")
        if maps.exists():
            loaded = maps.read_text()
            assert "_sqlite3" in loaded
            assert "torch" not in loaded and "cuda" not in loaded.lower()
    finally:
        ex.close()


def test_relative_database_paths_resolve_against_the_callers_directory(executor, db, monkeypatch):
    monkeypatch.chdir(db.parent.parent)
    out = executor.check("db/t.sqlite", "SELECT count(*) FROM t")
    assert out.pred_ok, out.pred_error


def test_worker_memory_limit_turns_a_huge_sort_into_an_error(tmp_path):
    path = tmp_path / "m.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE big (id INTEGER PRIMARY KEY, v TEXT)")
    con.executemany("INSERT INTO big VALUES (?, ?)", [(i, "x" * 50) for i in range(3000)])
    con.commit()
    con.close()
    ex = SQLExecutor(workers=1, timeout_s=10.0, memory_mb=256)
    try:
        # 9 million 100-byte strings sorted in memory (temp_store = MEMORY): about 1 GB
        sql = "SELECT count(*) FROM (SELECT a.v || b.v AS s FROM big a, big b ORDER BY s)"
        out = ex.check(str(path), sql)
        assert out.pred_ok is False and "out of memory" in out.pred_error
        assert out.pred_error_kind == "memory"
        assert ex.check(str(path), "SELECT count(*) FROM big").pred_ok
    finally:
        ex.close()


def test_pool_works_when_the_trainer_holds_many_file_descriptors(db):
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1300:
        pytest.skip(f"RLIMIT_NOFILE is {soft}")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    ex = SQLExecutor(workers=1)
    try:
        out = ex.check(str(db), "SELECT count(*) FROM t")
        assert ex._workers[0].fd > 1024  # beyond select()'s FD_SETSIZE
        assert out.pred_ok, out.pred_error
    finally:
        ex.close()
        for fd in held:
            os.close(fd)


def test_a_large_job_is_not_queued_behind_a_hung_one(db):
    """Writing 190 KB to a worker that is stuck in a query would block the parent (pipe
    buffers hold 64 KiB) and with it every deadline; large jobs wait for an idle worker."""
    ex = SQLExecutor(workers=1, timeout_s=0.5, hard_margin_s=0.3, progress_steps=0)
    try:
        big = "SELECT count(*) FROM t /*" + "x" * 95_000 + "*/"
        t0 = time.monotonic()
        outs = ex.run([ExecJob(db=str(db), pred=HANG), ExecJob(db=str(db), pred=big, gold=big)])
        assert outs[0].pred_ok is False and outs[0].killed
        assert outs[1].match is True
        assert time.monotonic() - t0 < 50.0
    finally:
        ex.close()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux only (PR_SET_PDEATHSIG)")
def test_workers_die_with_a_killed_trainer(db):
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from mrtpo.tasks.text2sql.executor import SQLExecutor\n"
        "ex = SQLExecutor(workers=1, timeout_s=20)\n"  # a bounded hang, even if this fails
        "ex.check(sys.argv[1], 'SELECT 1')\n"
        "print(ex._workers[0].proc.pid, flush=True)\n"
        f"ex.check(sys.argv[1], {HANG!r})\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(db)], stdout=subprocess.PIPE)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.5)  # the worker is now deep in a 20-second query

        def alive() -> bool:
            try:
                return Path(f"/proc/{worker}/stat").read_text().split()[2] != "Z"
            except (FileNotFoundError, IndexError):
                return False

        assert alive()
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 50
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive()
    finally:
        parent.kill()
        parent.stdout.close()
