"""Small stand-ins for the public data, built by the tests themselves.

A user's clone has no ``../shared/data``. These builders write a folder laid out like it,
with just enough of each file for the text-to-SQL and tool-calling verifiers to run:
``spider/`` (SQLite databases made here, ``dev.json``), ``spider_syn/train_spider.json``,
and ``toolrl_rlla/`` (a few RLLA rows in the RL layout, ``.jsonl``, and the SFT layout,
``.json``). Point ``paths.data_dir`` at the folder and the real task configs load it.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

# ---- text-to-SQL ---------------------------------------------------------------------------

SINGERS = [
    (1, "Joe Sharp", "Netherlands", 52),
    (2, "Timbaland", "United States", 32),
    (3, "Justin Brown", "France", 29),
    (4, "Rose White", "France", 41),
    (5, "John Nizinik", "France", 43),
]
CONCERTS = [(1, 1, 2014), (2, 2, 2014), (3, 2, 2015), (4, 4, 2015), (5, 5, 2015)]

#: (question, reference query) on the ``concert_singer`` database
CONCERT_QUESTIONS = [
    ("How many singers are there?", "SELECT count(*) FROM singer"),
    ("List the names of singers from France.", "SELECT name FROM singer WHERE country = 'France'"),
    ("What are the distinct countries of the singers?", "SELECT DISTINCT country FROM singer"),
    (
        "Show the names of singers ordered by age.",
        "SELECT name FROM singer ORDER BY age DESC",
    ),
    (
        "How many concerts were held in each year?",
        "SELECT year, count(*) FROM concert GROUP BY year",
    ),
    (
        "What is the name of the singer of concert 3?",
        "SELECT T2.name FROM concert AS T1 JOIN singer AS T2 ON T1.singer_id = T2.singer_id "
        "WHERE T1.concert_id = 3",
    ),
]
#: tables of the ``wide_db`` database: its schema alone is thousands of tokens long
WIDE_TABLES = 60
WIDE_COLUMNS = 12


def make_concert_db(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, "
        "age INTEGER);\n"
        "CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, singer_id INTEGER, "
        "year INTEGER, FOREIGN KEY (singer_id) REFERENCES singer(singer_id));"
    )
    con.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", SINGERS)
    con.executemany("INSERT INTO concert VALUES (?, ?, ?)", CONCERTS)
    con.commit()
    con.close()
    return path


def make_wide_db(path: Path) -> Path:
    """A database whose full schema (with sample values) is far over 4,096 tokens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    for t in range(WIDE_TABLES):
        cols = ", ".join(f"measurement_{c}_of_table_{t} TEXT" for c in range(WIDE_COLUMNS))
        con.execute(f"CREATE TABLE table_{t} (id INTEGER PRIMARY KEY, {cols})")
        row = [f"value {t}.{c} spelled out in words" for c in range(WIDE_COLUMNS)]
        con.execute(f"INSERT INTO table_{t} VALUES (1, {', '.join('?' * WIDE_COLUMNS)})", row)
    con.commit()
    con.close()
    return path


def make_spider(data_dir: Path) -> Path:
    """``spider/database/{concert_singer,wide_db}``, ``spider/dev.json`` and
    ``spider_syn/train_spider.json`` (with one reference that fails and one question whose
    database is missing, both dropped at load). Returns ``data_dir``."""
    db_dir = data_dir / "spider" / "database"
    make_concert_db(db_dir / "concert_singer" / "concert_singer.sqlite")
    make_wide_db(db_dir / "wide_db" / "wide_db.sqlite")
    dev = [{"db_id": "concert_singer", "question": q, "query": s} for q, s in CONCERT_QUESTIONS]
    dev.append({"db_id": "wide_db", "question": "How many rows has table 0?",
                "query": "SELECT count(*) FROM table_0"})  # fmt: skip
    (data_dir / "spider" / "dev.json").write_text(json.dumps(dev, indent=1))
    train = [
        {"db_id": "concert_singer", "SpiderQuestion": q, "SpiderSynQuestion": q + " (syn)",
         "query": s}
        for q, s in CONCERT_QUESTIONS
    ]  # fmt: skip
    train += [
        {"db_id": "wide_db", "SpiderQuestion": f"What is in table {t}?",
         "SpiderSynQuestion": f"What does table {t} hold?", "query": f"SELECT * FROM table_{t}"}
        for t in range(3)
    ]  # fmt: skip
    train.append(
        {"db_id": "concert_singer", "SpiderQuestion": "Broken reference.",
         "SpiderSynQuestion": "Broken reference.", "query": "SELECT no_such_column FROM singer"}
    )  # fmt: skip
    train.append(
        {"db_id": "missing_db", "SpiderQuestion": "No database.",
         "SpiderSynQuestion": "No database.", "query": "SELECT 1"}
    )  # fmt: skip
    (data_dir / "spider_syn").mkdir(parents=True, exist_ok=True)
    (data_dir / "spider_syn" / "train_spider.json").write_text(json.dumps(train, indent=1))
    return data_dir


# ---- tool calling (RLLA) -----------------------------------------------------------------------

RLLA_TOOLS = [
    {
        "name": "GetNews",
        "description": "Retrieve news articles.",
        "parameters": {
            "page": {"description": "The page number.", "type": "int", "default": ""},
            "topic": {"description": "Topic to search.", "type": "string", "default": ""},
        },
    },
    {
        "name": "SetAlarm",
        "description": "Set an alarm.",
        "parameters": {
            "hour": {"description": "Hour of the day.", "type": "int", "default": 7},
            "repeat": {"description": "Every day.", "type": "bool", "default": False},
            "volume": {"description": "Volume 0..1.", "type": "float, optional", "default": 0.5},
        },
    },
]
_PLACEHOLDER = (
    "<think> I should use the appropriate tool with proper parameters to respond to the "
    "user's need. </think>"
)
#: (user turn, gold answer after the reasoning)
RLLA_TURNS = [
    (
        "Latest Azure news, please.",
        '<tool_call>\n{"name": "GetNews", "parameters": {"page": "1"}}\n</tool_call>',
    ),
    (
        "Wake me at 6 every day, quietly, and show AI news.",
        "<tool_call>\n"
        '{"name": "SetAlarm", "parameters": {"hour": "6", "repeat": "true", "volume": "0.2"}}\n'
        '{"name": "GetNews", "parameters": {"topic": "AI"}}\n</tool_call>',
    ),
    ("Thanks, that is all.", "<response> You are welcome! </response>"),
    (
        "Set an alarm for 8 and tell me.",
        '<tool_call>\n{"name": "SetAlarm", "parameters": {"hour": 8}}\n</tool_call>\n'
        "<response> Your alarm is set for 8. </response>",
    ),
    # a gold answer that cannot be parsed: the loader drops it (counted in the log)
    ("Broken gold.", '<tool_call>\n{"name": "GetNews", "parameters": {\n</tool_call>'),
]


def rlla_rows() -> list[dict[str, Any]]:
    """The turns above in ToolRL's RL layout (``rlla_4k``: prompt + reward_model)."""
    from mrtpo.tasks.toolcall.parsing import system_prompt

    system = system_prompt(RLLA_TOOLS)
    rows = []
    for i, (user, gold) in enumerate(RLLA_TURNS):
        content = f"**Dialogue Records History**\n<user> {user} </user>"
        output = f"{_PLACEHOLDER}\n{gold}"
        rows.append(
            {
                "data_source": "rlla",
                "prompt": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": content},
                ],
                "ability": "rlla",
                "reward_model": {"ground_truth": output, "style": "rule"},
                "extra_info": {
                    "index": i,
                    "instruction": system,
                    "input": content,
                    "output": output,
                    "split": "train",
                },
            }
        )
    return rows


def make_rlla(data_dir: Path) -> Path:
    """``toolrl_rlla/rlla_4k_test.jsonl`` (RL layout) and ``toolrl_rlla/rlla_sft.json`` (SFT
    layout) holding the same rows, the file names of the task config. Returns ``data_dir``."""
    folder = data_dir / "toolrl_rlla"
    folder.mkdir(parents=True, exist_ok=True)
    rows = rlla_rows()
    (folder / "rlla_4k_test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sft = [{k: r["extra_info"][k] for k in ("instruction", "input", "output")} for r in rows]
    (folder / "rlla_sft.json").write_text(json.dumps(sft, indent=1))
    return data_dir


def make_omnisql(data_dir: Path) -> Path:
    """``omnisql/train_spider_enhanced_with_cot.json``: OmniSQL's layout (Spider train rows with
    a ``cot`` ending in a SQL block) for every usable concert_singer training question of
    ``make_spider``. Returns the file."""
    rows = [
        {"db_id": "concert_singer", "question": q, "query": s,
         "cot": f"Step 1: read the question.\nStep 2: write it.\n```sql\n{s}\n```"}
        for q, s in CONCERT_QUESTIONS
    ]  # fmt: skip
    path = data_dir / "omnisql" / "train_spider_enhanced_with_cot.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    return path


def make_public_data(data_dir: Path) -> Path:
    """Every stand-in above under one ``paths.data_dir``."""
    make_spider(data_dir)
    make_omnisql(data_dir)
    make_rlla(data_dir)
    return data_dir
