"""Text-to-SQL rewards, verifier blocks, contexts and metrics on a small database made here."""

from __future__ import annotations

import json
import pickle
import sqlite3
from pathlib import Path

import pytest

from mrtpo.tasks.base import Score, append_to_last_user
from mrtpo.tasks.text2sql import Text2SQLTask
from mrtpo.tasks.text2sql.rewards import (
    FORMAT_BLOCK,
    NO_SQL_BLOCK,
    check_format,
    error_block,
    extract_sql,
    parse_response,
    reference_block,
)

QUESTIONS = [
    {
        "db_id": "shop",
        "question": "How many items are there?",
        "query": "SELECT count(*) FROM item",
    },
    {
        "db_id": "shop",
        "question": "List item names by price.",
        "query": "SELECT name FROM item ORDER BY price",
    },
    {"db_id": "ghost", "question": "Missing database.", "query": "SELECT 1"},
    {
        "db_id": "shop",
        "question": "Price of the widget?",
        "query": "SELECT price FROM item WHERE name = 'widget';",
    },
]


def make_shop(root: Path) -> Path:
    path = root / "shop" / "shop.sqlite"
    path.parent.mkdir(parents=True)
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT, price REAL, stock INT)")
    con.executemany(
        "INSERT INTO item VALUES (?, ?, ?, ?)",
        [(1, "widget", 2.5, 10), (2, "gadget", 1.0, None), (3, "doohickey", 7.0, 3)],
    )
    con.commit()
    con.close()
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Text2SQLTask:
    root = tmp_path_factory.mktemp("t2s")
    make_shop(root / "db")
    (root / "dev.json").write_text(json.dumps(QUESTIONS))
    t = Text2SQLTask(
        splits={"dev": {"file": str(root / "dev.json"), "db_dir": [str(root / "db")]}},
        val_split="dev",
        executor={"workers": 2, "timeout_s": 2.0},
    )
    yield t
    t.close()


def wrap(sql: str, think: str = "reasoning") -> str:
    return f"<think>{think}</think>\n<answer>\n```sql\n{sql}\n```\n</answer>"


# ---- parsing and format ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "problem"),
    [
        ("<think>a</think><answer>```sql\nSELECT 1\n```</answer>", None),
        ("  <think>a</think>\n\n<answer>\n```sql\nSELECT 1\n```\n</answer>\n", None),
        ("<answer>```sql\nSELECT 1\n```</answer>", "<think> appears 0 times"),
        (
            "<think>a</think><think>b</think><answer>```sql\nSELECT 1\n```</answer>",
            "<think> appears 2",
        ),
        ("<answer>```sql\nSELECT 1\n```</answer><think>a</think>", "out of order"),
        ("hi <think>a</think><answer>```sql\nSELECT 1\n```</answer>", "text before <think>"),
        ("<think>a</think><answer>```sql\nSELECT 1\n```</answer> bye", "text after </answer>"),
        ("<think>a</think> so <answer>```sql\nSELECT 1\n```</answer>", "between </think>"),
        ("<think> </think><answer>```sql\nSELECT 1\n```</answer>", "empty <think>"),
        ("<think>a</think><answer>SELECT 1</answer>", "0 code blocks"),
        ("<think>a</think><answer>```sql\nA\n```\n```sql\nB\n```</answer>", "2 code blocks"),
        ("<think>a</think><answer>```python\nSELECT 1\n```</answer>", "labelled 'python'"),
        ("<think>a</think><answer>```sql\n\n```</answer>", "empty"),
        (
            "<think>a</think><answer>Here: ```sql\nSELECT 1\n```</answer>",
            "outside the SQL code block",
        ),
    ],
)
def test_format_rule(response, problem):
    got = check_format(response)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


def test_sql_is_taken_from_the_last_block_of_the_answer_even_when_format_fails():
    r = "<think>```sql\nSELECT 0\n```</think><answer>```sql\nSELECT 1\n```\n```sql\nSELECT 2;\n```</answer>"
    assert extract_sql(r) == ("SELECT 2;", None)
    assert extract_sql("<answer>```\nSELECT 3\n```</answer>") == ("SELECT 3", None)
    assert extract_sql("no tags ```sql\nSELECT 1\n```")[0] is None
    assert extract_sql("<think>x</think><answer>SELECT 1</answer>")[0] is None


def test_parse_never_raises_on_garbage():
    for junk in ["", "```", "<answer>", "</answer><answer>```sql", "x" * 100_000, None, 42]:
        p = parse_response(junk)  # type: ignore[arg-type]
        assert not p.format_ok


def test_block_texts():
    assert error_block("no such column: nme") == (
        "When this query was executed on this database, SQLite raised: no such column: nme."
    )
    assert error_block("x" * 1000).endswith("….")
    assert reference_block("SELECT 1 ;  ") == "The reference query for this question is: SELECT 1."


# ---- data ---------------------------------------------------------------------------------


def test_examples_ids_prompt_and_missing_database(task):
    exs = task.examples("val")
    assert [e.id for e in exs] == ["0", "1", "3"]  # file positions; 'ghost' has no database
    assert task.load_stats["dev"]["missing_databases"] == {"ghost": 1}
    user = exs[0].messages[-1]["content"]
    assert exs[0].messages[0]["role"] == "system"
    assert "CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT, price REAL, stock INT);" in user
    assert "name: 'widget', 'gadget', 'doohickey'" in user
    assert "Question: How many items are there?" in user
    assert "<think>" in user and "<answer>" in user and "```sql" in user


def test_unknown_split_names_the_config_key(task):
    with pytest.raises(ValueError, match=r"task\.splits"):
        task.examples("spider_test")


def test_missing_file_names_the_config_key(tmp_path):
    t = Text2SQLTask(splits={"bird_dev": {"file": str(tmp_path / "nope.json"), "format": "bird"}})
    with pytest.raises(FileNotFoundError, match=r"task\.splits\.bird_dev\.file"):
        t.examples("bird_dev")


def test_unknown_split_key_is_rejected():
    with pytest.raises(ValueError, match="unknown keys"):
        Text2SQLTask(splits={"dev": {"fiel": "x"}})


# ---- rewards and blocks ----------------------------------------------------------------------


def test_reference_responses_score_full_marks(task):
    exs = task.examples("val")
    scores = task.score_many(exs, [e.reference for e in exs])
    for s in scores:
        assert s.rewards == {"format": 1.0, "executability": 1.0, "execution": 1.0}, s.reasons
        assert s.blocks["executability"] is None
        assert s.blocks["format"] == FORMAT_BLOCK


def test_wrong_but_running_query(task):
    ex = task.examples("val")[0]
    s = task.score(ex, wrap("SELECT count(*) FROM item WHERE price > 2"))
    assert s.rewards == {"format": 1.0, "executability": 1.0, "execution": 0.0}
    assert "differs" in s.reasons["execution"]
    assert (
        s.blocks["execution"]
        == "The reference query for this question is: SELECT count(*) FROM item."
    )


def test_failing_query_reports_its_own_error(task):
    ex = task.examples("val")[0]
    s = task.score(ex, wrap("SELECT count(*) FROM itm"))
    assert s.rewards == {"format": 1.0, "executability": 0.0, "execution": 0.0}
    assert s.blocks["executability"] == (
        "When this query was executed on this database, SQLite raised: no such table: itm."
    )
    assert s.reasons["executability"] == "no such table: itm"


def test_no_sql_block(task):
    ex = task.examples("val")[0]
    s = task.score(ex, "<think>hmm</think><answer>SELECT count(*) FROM item</answer>")
    assert s.rewards == {"format": 0.0, "executability": 0.0, "execution": 0.0}
    assert s.blocks["executability"] == NO_SQL_BLOCK
    assert set(s.reasons) == {"format", "executability", "execution"}


def test_bad_format_still_gets_execution_credit(task):
    ex = task.examples("val")[0]
    s = task.score(ex, "Sure!\n<answer>```sql\nSELECT COUNT(*) FROM item;\n```</answer>")
    assert s.rewards == {"format": 0.0, "executability": 1.0, "execution": 1.0}


def test_order_and_column_semantics_through_the_task(task):
    by_price = task.examples("val")[1]  # reference has ORDER BY
    assert (
        task.score(by_price, wrap("SELECT name FROM item ORDER BY price DESC")).rewards["execution"]
        == 0.0
    )
    assert (
        task.score(by_price, wrap("SELECT name FROM item ORDER BY price")).rewards["execution"]
        == 1.0
    )
    count = task.examples("val")[0]
    # DISTINCT is removed before comparing (official default); 1 row either way here
    assert task.score(count, wrap("SELECT DISTINCT count(*) FROM item")).rewards["execution"] == 1.0
    widget = task.examples("val")[2]
    assert (
        task.score(widget, wrap("SELECT price FROM item WHERE id = 1")).rewards["execution"] == 1.0
    )
    assert task.score(widget, wrap("SELECT 2.5")).rewards["execution"] == 1.0
    assert task.score(widget, wrap("SELECT '2.5'")).rewards["execution"] == 0.0


def test_malformed_responses_never_raise(task):
    exs = task.examples("val")
    junk = [
        "",
        "<answer>```sql\n```</answer>",
        "<answer>```sql\nDROP TABLE item\n```</answer>",
        None,
    ]
    scores = task.score_many([exs[0]] * len(junk), junk)  # type: ignore[list-item]
    for s in scores:
        assert s.error is None
        assert s.rewards["executability"] == 0.0 and s.rewards["execution"] == 0.0
        assert s.reasons["executability"]


# ---- contexts (method.md §1) -------------------------------------------------------------


def test_contexts_differ_exactly_by_each_block(task):
    ex = task.examples("val")[0]
    s = task.score(ex, wrap("SELECT count(*) FROM itm"))
    assert all(s.blocks[k] for k in task.reward_names)  # a three-block sample
    ctx = task.contexts(ex, s)
    blocks = [s.blocks[k] for k in task.reward_names]
    assert ctx.all == append_to_last_user(ex.messages, "\n\n".join(blocks))
    assert ctx.none == ex.messages
    for k, block in zip(task.reward_names, blocks):
        without = ctx.without[k][-1]["content"]
        full = ctx.all[-1]["content"]
        others = [b for b in blocks if b != block]
        assert without == ex.messages[-1]["content"] + "\n\n" + "\n\n".join(others)
        # removing Z_k from P_all gives P_\k: the decoded texts differ by Z_k alone
        i = full.index(block)
        removed = full[:i] + full[i + len(block) :]
        assert removed.replace("\n\n\n\n", "\n\n").rstrip("\n") == without
        assert ctx.all[:-1] == ctx.without[k][:-1]  # system message untouched


def test_runnable_query_has_no_executability_block(task):
    ex = task.examples("val")[0]
    s = task.score(ex, wrap("SELECT 1"))
    ctx = task.contexts(ex, s)
    assert set(ctx.without) == {"format", "execution"}


# ---- metrics -------------------------------------------------------------------------------


def test_summarize_exec_acc_overall_and_per_database(task):
    exs = task.examples("val")
    scores = [
        Score(rewards={"format": 1.0, "executability": 1.0, "execution": 1.0}),
        Score(rewards={"format": 0.0, "executability": 1.0, "execution": 0.0}),
        Score(rewards=dict.fromkeys(task.reward_names), error="boom"),
    ]
    m = task.summarize(exs, scores)
    assert m["exec_acc"] == pytest.approx(1 / 3)
    assert m["exec_acc/shop"] == pytest.approx(1 / 3)
    assert m["reward/format"] == 0.5
    assert m["reward/executability"] == 1.0


def test_task_pickles_without_its_worker_pool(task):
    exs = task.examples("val")
    task.score(exs[0], exs[0].reference)  # pool running
    clone = pickle.loads(pickle.dumps(task))
    assert clone._executor is None
    assert clone.score(exs[0], exs[0].reference).rewards["execution"] == 1.0
    clone.close()


def test_training_reference_check_is_cached_until_a_database_changes(tmp_path):
    db = make_shop(tmp_path / "db")
    rows = [*QUESTIONS, {"db_id": "shop", "question": "Broken.", "query": "SELECT nope FROM item"}]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    splits = {
        "train": {
            "file": str(tmp_path / "train.json"),
            "db_dir": [str(tmp_path / "db")],
            "drop_failing_gold": True,
        }
    }

    def load() -> Text2SQLTask:
        t = Text2SQLTask(splits=splits, cache_dir=str(tmp_path / "cache"))
        assert [e.id for e in t.examples("train")] == ["0", "1", "3"]  # 2: no db, 4: fails
        t.close()
        return t

    first = load()
    assert first._executor is not None  # references were executed
    assert first.load_stats["train"]["gold_failures"] == [("4", "no such column: nope")]
    assert load()._executor is None  # read from the cache
    con = sqlite3.connect(db)
    con.execute("INSERT INTO item VALUES (4, 'gizmo', 9.0, 1)")
    con.commit()
    con.close()
    assert load()._executor is not None  # the database changed: checked again


# ---- the executor's limits, worded as what they are --------------------------------------------
HANG = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


@pytest.fixture(scope="module")
def tight(tmp_path_factory) -> Text2SQLTask:
    """The shop questions under small limits: 2 rows, 0.5 s."""
    root = tmp_path_factory.mktemp("t2s_tight")
    make_shop(root / "db")
    (root / "dev.json").write_text(json.dumps(QUESTIONS))
    t = Text2SQLTask(
        splits={"dev": {"file": str(root / "dev.json"), "db_dir": [str(root / "db")]}},
        val_split="dev",
        executor={"workers": 1, "timeout_s": 0.5, "max_rows": 2},
    )
    yield t
    t.close()


def test_a_result_over_the_row_cap_is_executable_but_not_compared(tight):
    ex = tight.examples("val")[1]  # reference: 3 names
    s = tight.score(ex, wrap("SELECT name FROM item"))
    # SQLite ran it without an error; only the executor stopped reading the result
    assert s.rewards == {"format": 1.0, "executability": 1.0, "execution": 0.0}
    assert s.blocks["executability"] is None
    assert s.reasons["execution"] == (
        "not compared: the result has more than the executor's limit of 2 rows"
    )
    assert s.checks["error_kind"] == "rows"


@pytest.mark.parametrize(
    ("sql", "kind", "block"),
    [
        (
            HANG,
            "time",
            "When this query was executed on this database, the executor stopped it: the query "
            "did not finish within the executor's 0.5 s time limit.",
        ),
        (
            "DROP TABLE item",
            "refused",
            "This query was not executed: not authorized: only read-only SELECT queries may run "
            "here, not DROP.",
        ),
        (
            "SELECT 1; SELECT 2",
            "driver",
            "This query could not be given to SQLite: Python's sqlite3 module raised: You can "
            "only execute one statement at a time.",
        ),
        (
            "SELECT nme FROM item",
            "sqlite",
            "When this query was executed on this database, SQLite raised: no such column: nme.",
        ),
    ],
)
def test_each_failure_is_worded_by_who_stopped_the_query(tight, sql, kind, block):
    s = tight.score(tight.examples("val")[0], wrap(sql))
    assert s.rewards["executability"] == 0.0 and s.rewards["execution"] == 0.0
    assert s.checks["error_kind"] == kind
    assert s.blocks["executability"] == block
    assert ("SQLite raised" in block) == (kind == "sqlite")


# ---- execution match: the official CLI's DISTINCT rule, or the stricter one -------------------
def test_keep_distinct_gives_the_stricter_comparison(tmp_path):
    db = tmp_path / "db" / "pets" / "pets.sqlite"
    db.parent.mkdir(parents=True)
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE pet (id INTEGER PRIMARY KEY, kind TEXT)")
    con.executemany("INSERT INTO pet VALUES (?, ?)", [(1, "cat"), (2, "dog"), (3, "cat")])
    con.commit()
    con.close()
    rows = [
        {"db_id": "pets", "question": "Kinds of pets?", "query": "SELECT DISTINCT kind FROM pet"}
    ]
    (tmp_path / "dev.json").write_text(json.dumps(rows))
    splits = {"dev": {"file": str(tmp_path / "dev.json"), "db_dir": [str(tmp_path / "db")]}}
    without_distinct = wrap("SELECT kind FROM pet")  # cat, dog, cat
    with_distinct = wrap("SELECT DISTINCT kind FROM pet")
    official = Text2SQLTask(splits=splits, val_split="dev", executor={"workers": 1})
    strict = Text2SQLTask(
        splits=splits, val_split="dev", keep_distinct=True, executor={"workers": 1}
    )
    try:
        ex = official.examples("val")[0]
        # official CLI: DISTINCT removed from both, so the bags {cat, dog, cat} are compared
        assert official.score(ex, without_distinct).rewards["execution"] == 1.0
        assert official.score(ex, with_distinct).rewards["execution"] == 1.0
        ex = strict.examples("val")[0]
        assert strict.score(ex, without_distinct).rewards["execution"] == 0.0
        assert strict.score(ex, with_distinct).rewards["execution"] == 1.0
    finally:
        official.close()
        strict.close()


# ---- prompts: full schemas by default, a character budget on request ---------------------------
def test_full_schema_by_default_truncation_is_opt_in(tmp_path):
    from tests.task_fixtures import WIDE_TABLES, make_wide_db

    make_wide_db(tmp_path / "db" / "wide_db" / "wide_db.sqlite")
    rows = [{"db_id": "wide_db", "question": "Rows of table 0?", "query": "SELECT * FROM table_0"}]
    (tmp_path / "dev.json").write_text(json.dumps(rows))
    splits = {"dev": {"file": str(tmp_path / "dev.json"), "db_dir": [str(tmp_path / "db")]}}
    full = Text2SQLTask(splits=splits, val_split="dev").examples("val")[0]
    text = full.messages[-1]["content"]
    assert all(f"CREATE TABLE table_{t} " in text for t in range(WIDE_TABLES))
    assert "Sample values of table_59" in text and "not shown" not in text
    cut = Text2SQLTask(splits=splits, val_split="dev", schema_max_chars=3000).examples("val")[0]
    short = cut.messages[-1]["content"]
    assert len(short) < 4000 < len(text)
    assert "more tables are not shown (schema too long)" in short
