"""Hostile queries through the full task: each fails executability with a reason, within the
time budget + 1 s; no database byte changes, no file appears, and the process goes on."""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from mrtpo.tasks.base import Example
from mrtpo.tasks.text2sql import Text2SQLTask

BUDGET_S = 0.5


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(*roots: Path) -> dict[str, str]:
    """Every file under ``roots`` with its hash."""
    return {str(p): sha256(p) for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def make_big_db(path: Path) -> None:
    path.parent.mkdir(parents=True)
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE big (id INTEGER PRIMARY KEY, v TEXT)")
    con.executemany("INSERT INTO big VALUES (?, ?)", [(i, f"row{i}") for i in range(3000)])
    con.commit()
    con.close()


def hostile_queries(tmp: Path, table: str) -> dict[str, str]:
    new_file = tmp / "evil.sqlite"
    return {
        "drop": f"DROP TABLE {table}",
        "delete": f"DELETE FROM {table}",
        "update": f"UPDATE {table} SET rowid = rowid + 1",
        "insert": f"INSERT INTO {table} DEFAULT VALUES",
        "with_delete": f"WITH x AS (SELECT 1) DELETE FROM {table}",
        "two_statements": f"SELECT 1; DROP TABLE {table}",
        "attach": f"ATTACH DATABASE '{new_file}' AS evil",
        "attach_create": f"ATTACH '{new_file}' AS e; CREATE TABLE e.t (x)",
        "vacuum_into": f"VACUUM INTO '{new_file}'",
        "writable_schema": "PRAGMA writable_schema = 1",
        "load_extension": f"SELECT load_extension('{tmp / 'libevil.so'}')",
        "infinite_cte": (
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
        ),
        # a cartesian product of 12 copies: > 10^9 rows even for a 6-row table
        "cross_join": "SELECT count(*) FROM " + ", ".join(f"{table} t{i}" for i in range(12)),
        "randomblob_1gb": "SELECT randomblob(1000000000)",
        "printf_1gb": "SELECT printf('%.*c', 1000000000, 'x')",  # one uninterruptible step
        "query_1mb": "SELECT " + "1 + " * 262_144 + "1",
        "syntax_error": f"SELEC * FROM {table}",
    }


#: who stops each hostile query (``executor.ERROR_KINDS``)
EXPECTED_KINDS = {
    **dict.fromkeys(
        ["drop", "delete", "update", "insert", "attach", "attach_create", "vacuum_into",
         "writable_schema", "query_1mb"],
        "refused",
    ),  # refused in the parent, unrun
    **dict.fromkeys(["with_delete", "load_extension", "randomblob_1gb", "syntax_error"], "sqlite"),
    "two_statements": "driver",  # Python's sqlite3 module runs one statement only
    **dict.fromkeys(["infinite_cte", "cross_join", "printf_1gb"], "time"),
}  # fmt: skip
BLOCK_STARTS = {
    "refused": "This query was not executed: ",
    "sqlite": "When this query was executed on this database, SQLite raised: ",
    "driver": "This query could not be given to SQLite: Python's sqlite3 module raised: ",
    "time": "When this query was executed on this database, the executor stopped it: the query "
    "did not finish within the executor's 0.5 s time limit",
}


def wrap(sql: str) -> str:
    return f"<think>attack</think><answer>\n```sql\n{sql}\n```\n</answer>"


@pytest.fixture(scope="module")
def task():
    t = Text2SQLTask(
        splits={}, executor={"workers": 2, "timeout_s": BUDGET_S, "hard_margin_s": 0.5}
    )
    yield t
    t.close()


def example(db: Path, gold: str) -> Example:
    return Example(
        id="0",
        messages=[{"role": "user", "content": "q"}],
        data={"db_id": db.stem, "db_path": str(db), "query": gold, "match": "spider"},
    )


def run_hostile(
    task: Text2SQLTask, db: Path, table: str, gold: str, tmp: Path, watched: list[Path]
):
    ex = example(db, gold)
    assert task.score(ex, wrap(gold)).rewards["execution"] == 1.0  # warm pool, sane gold
    before = snapshot(*watched)
    timings = {}
    for name, sql in hostile_queries(tmp, table).items():
        t0 = time.monotonic()
        s = task.score(ex, wrap(sql))
        took = time.monotonic() - t0
        timings[name] = took
        assert s.error is None, name
        assert s.rewards["executability"] == 0.0, (name, s.reasons)
        assert s.rewards["execution"] == 0.0, name
        assert s.reasons["executability"], name
        # the block says who stopped the query: SQLite, the sqlite3 module, or the executor
        assert (name, s.checks["error_kind"]) in EXPECTED_KINDS.items(), (name, s.checks)
        block = s.blocks["executability"]
        assert block.startswith(BLOCK_STARTS[s.checks["error_kind"]]), (name, block)
        assert took <= BUDGET_S + 20.0, (name, took)  # bounded; slack for a loaded CI machine
    assert snapshot(*watched) == before  # same files, same bytes
    assert not (tmp / "evil.sqlite").exists()
    # the executor still works after all of it
    assert task.score(ex, wrap(gold)).rewards["execution"] == 1.0
    return timings


def test_hostile_queries_on_a_test_made_database(task, tmp_path):
    db = tmp_path / "db" / "big" / "big.sqlite"
    make_big_db(db)
    timings = run_hostile(task, db, "big", "SELECT count(*) FROM big", tmp_path, [tmp_path])
    print("hostile query seconds:", {k: round(v, 3) for k, v in timings.items()})
    assert task.executor.stats["killed"] >= 1  # printf needed the hard deadline


def test_hostile_queries_on_a_copy_of_a_spider_database(task, tmp_path, shared_data):
    src = shared_data / "spider" / "database" / "concert_singer" / "concert_singer.sqlite"
    if not src.is_file():
        pytest.skip(f"{src} not found")
    shared_before = sha256(src)
    db = tmp_path / "db" / "concert_singer" / "concert_singer.sqlite"
    db.parent.mkdir(parents=True)
    shutil.copy(src, db)
    run_hostile(task, db, "singer", "SELECT count(*) FROM singer", tmp_path, [tmp_path])
    # and the shared file itself, read directly
    run_hostile(
        task, src, "singer", "SELECT count(*) FROM singer", tmp_path, [tmp_path, src.parent]
    )
    assert sha256(src) == shared_before


def test_hostile_batch_runs_in_parallel_with_honest_queries(task, tmp_path):
    db = tmp_path / "db" / "big" / "big.sqlite"
    make_big_db(db)
    before = snapshot(tmp_path)
    ex = example(db, "SELECT count(*) FROM big")
    hostile = list(hostile_queries(tmp_path, "big").values())
    responses = [wrap(q) for q in hostile] + [wrap("SELECT COUNT(id) FROM big")] * 10
    t0 = time.monotonic()
    scores = task.score_many([ex] * len(responses), responses)
    took = time.monotonic() - t0
    assert [s.rewards["execution"] for s in scores] == [0.0] * len(hostile) + [1.0] * 10
    # slow ones (4 budget-bound queries) run side by side on 2 workers
    assert took < 4 * (BUDGET_S + 0.6) + 30.0
    assert snapshot(tmp_path) == before
