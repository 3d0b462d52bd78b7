"""Question files of the Spider family and BIRD, where their databases live, and the
databases' schema text for prompts.

Spider-family files are JSON lists of ``{"db_id", "query", "question", ...}`` (Spider-Syn's
question field is ``SpiderQuestion`` / ``SpiderSynQuestion``); BIRD's (``format: bird``) rows
are ``{"question_id", "db_id", "question", "evidence", "SQL", "difficulty"}``. Databases are
``<db_dir>/<db_id>/<db_id>.sqlite``; ``db_dir``, ``hub``, ids: docs/tasks/text2sql.md, "Data".

The schema text is CREATE TABLE statements read from the SQLite file itself, so the model sees
exactly the names and types its query will run against, plus sample values that tell it how
data is spelled (``'USA'`` or ``'United States'``). An opt-in character budget drops sample
values, then whole tables.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sqlite3
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .executor import readonly_uri

QUESTION_FIELDS = ("question", "SpiderQuestion", "SpiderSynQuestion")
QUERY_FIELDS = ("query", "SQL", "sql_query")


@dataclass
class SplitConfig:
    """One entry of ``task.splits`` (see ``configs/task/text2sql.yaml``)."""

    name: str
    file: str | None = None
    db_dir: list[str] = field(default_factory=list)
    question_field: str | None = None  # None: the first of QUESTION_FIELDS present
    format: str = "spider"  # spider | bird
    match: str | None = None  # spider | bird; default: the format's own rule
    hub: str | None = None  # a hub dataset id, used only when ``file`` is absent
    hub_split: str | None = None
    drop_failing_gold: bool = False  # run every reference query at load, drop failures

    @classmethod
    def from_mapping(cls, name: str, raw: Mapping[str, Any]) -> SplitConfig:
        raw = dict(raw)
        valid = sorted(f for f in cls.__dataclass_fields__ if f != "name")
        if unknown := set(raw) - set(valid):
            raise ValueError(
                f"task.splits.{name}: unknown keys {sorted(unknown)}; valid keys are {valid}"
            )
        db_dir = raw.pop("db_dir", None) or []
        if isinstance(db_dir, (str, os.PathLike)):
            db_dir = [db_dir]
        cfg = cls(name=name, db_dir=[str(d) for d in db_dir], **raw)
        for key, value in (("format", cfg.format), ("match", cfg.match)):
            if value not in ("spider", "bird") and (key, value) != ("match", None):
                raise ValueError(
                    f"task.splits.{name}.{key} must be 'spider' or 'bird', not {value!r}"
                )
        return cfg

    @property
    def match_mode(self) -> str:
        return self.match or self.format


@dataclass
class Question:
    """A question as read from its file, before any database checks."""

    id: str
    index: int
    db_id: str
    question: str
    query: str
    evidence: str = ""
    difficulty: str | None = None


def _load_rows(cfg: SplitConfig) -> list[dict[str, Any]]:
    if cfg.file and Path(cfg.file).is_file():
        with open(cfg.file, encoding="utf-8") as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise ValueError(f"task.splits.{cfg.name}.file: {cfg.file} is not a JSON list")
        return rows
    if cfg.hub:
        try:
            import datasets
        except ImportError as exc:  # pragma: no cover - datasets is a base dependency
            raise RuntimeError(f"reading task.splits.{cfg.name}.hub needs `datasets`") from exc
        try:
            ds = datasets.load_dataset(cfg.hub, split=cfg.hub_split or "validation")
        except Exception as exc:
            raise RuntimeError(
                f"text2sql split '{cfg.name}': {cfg.file} is absent and loading "
                f"task.splits.{cfg.name}.hub={cfg.hub!r} failed ({exc})"
            ) from exc
        return [dict(r) for r in ds]
    where = f"{cfg.file}" if cfg.file else "no file configured"
    raise FileNotFoundError(
        f"text2sql split '{cfg.name}': question file not found ({where}). Set "
        f"task.splits.{cfg.name}.file to the file (or task.splits.{cfg.name}.hub to a hub "
        "dataset id), or paths.data_dir to the folder holding the public data."
    )


def read_questions(cfg: SplitConfig) -> list[Question]:
    """All questions of a split, in file order."""
    rows = _load_rows(cfg)
    out = []
    for i, row in enumerate(rows):
        qfield = cfg.question_field or next((f for f in QUESTION_FIELDS if f in row), None)
        if qfield is None or qfield not in row:
            raise KeyError(
                f"text2sql split '{cfg.name}', row {i}: no question field "
                f"{qfield or QUESTION_FIELDS!r} (row keys: {sorted(row)}); set "
                f"task.splits.{cfg.name}.question_field"
            )
        query_field = next((f for f in QUERY_FIELDS if f in row), None)
        if query_field is None:
            raise KeyError(
                f"text2sql split '{cfg.name}', row {i}: no reference query (looked for "
                f"{QUERY_FIELDS}); row keys: {sorted(row)}"
            )
        qid = str(row["question_id"]) if cfg.format == "bird" and "question_id" in row else str(i)
        out.append(
            Question(
                id=qid,
                index=i,
                db_id=str(row["db_id"]),
                question=str(row[qfield]),
                query=str(row[query_field]),
                evidence=str(row.get("evidence") or ""),
                difficulty=row.get("difficulty"),
            )
        )
    return out


def find_database(db_dirs: Sequence[str], db_id: str) -> Path | None:
    """``<dir>/<db_id>/<db_id>.sqlite`` in the first folder that has it."""
    for d in db_dirs:
        p = Path(d) / db_id / f"{db_id}.sqlite"
        if p.is_file():
            return p
    return None


# ---- schema text ----------------------------------------------------------------------
_SAMPLE_TIME_S = 2.0  # per database; big tables (BIRD) may make DISTINCT scans slow


@dataclass(frozen=True)
class TableInfo:
    name: str
    create_sql: str
    columns: tuple[str, ...]
    samples: tuple[tuple[str, ...], ...]  # per column, rendered sample values


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def render_value(value: object, max_chars: int = 40) -> str:
    """A sample value as it would be written in SQL, shortened if long."""
    if isinstance(value, bytes):
        return "<blob>"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).replace("\n", " ")
    if len(text) > max_chars:
        text = text[: max_chars - 1] + "…"
    return "'" + text.replace("'", "''") + "'"


@functools.lru_cache(maxsize=512)
def read_tables(db_path: str, max_samples: int = 3) -> tuple[TableInfo, ...]:
    """Tables of a database with up to ``max_samples`` distinct non-empty values per column."""
    con = sqlite3.connect(readonly_uri(db_path), uri=True)
    con.text_factory = lambda b: b.decode(errors="ignore")
    deadline = time.monotonic() + _SAMPLE_TIME_S
    try:
        rows = con.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'table' "
            "AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
        ).fetchall()
        tables = []
        for name, create_sql in rows:
            columns = tuple(r[1] for r in con.execute(f"PRAGMA table_info({_quote_ident(name)})"))
            samples = []
            for col in columns:
                values: list[str] = []
                if max_samples > 0 and time.monotonic() < deadline:
                    q = (
                        f"SELECT DISTINCT {_quote_ident(col)} FROM {_quote_ident(name)} "
                        f"WHERE {_quote_ident(col)} IS NOT NULL AND {_quote_ident(col)} != '' "
                        f"LIMIT {int(max_samples)}"
                    )
                    con.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
                    try:
                        values = [render_value(r[0]) for r in con.execute(q)]
                    except sqlite3.Error:  # interrupted (too slow) or odd column: no samples
                        values = []
                    finally:
                        con.set_progress_handler(None, 0)
                samples.append(tuple(values))
            create_sql = (create_sql or f"CREATE TABLE {_quote_ident(name)} (...)").strip()
            tables.append(TableInfo(name, create_sql, columns, tuple(samples)))
        return tuple(tables)
    finally:
        con.close()


def _table_text(table: TableInfo, n_samples: int) -> str:
    text = table.create_sql.rstrip(";") + ";"
    if n_samples <= 0:
        return text
    lines = [
        f"{col}: {', '.join(vals[:n_samples])}"
        for col, vals in zip(table.columns, table.samples)
        if vals
    ]
    if lines:
        text += f"\n/* Sample values of {table.name}:\n" + "\n".join(lines) + "\n*/"
    return text


def render_schema(db_path: str, max_chars: int = 10_000, max_samples: int = 3) -> str:
    """The schema block of the prompt, at most ``max_chars`` characters when possible."""
    tables = read_tables(str(db_path), max_samples)
    if max_chars <= 0:
        max_chars = math.inf  # type: ignore[assignment]
    for n in range(max_samples, -1, -1):
        text = "\n\n".join(_table_text(t, n) for t in tables)
        if len(text) <= max_chars:
            return text
    # Even bare CREATE statements are too long: keep the first tables that fit.
    kept: list[str] = []
    used = 0
    for t in tables:
        piece = _table_text(t, 0)
        if used + len(piece) + 2 > max_chars - 60 and kept:
            break
        kept.append(piece)
        used += len(piece) + 2
    left_out = len(tables) - len(kept)
    if left_out:
        kept.append(f"/* {left_out} more tables are not shown (schema too long). */")
    return "\n\n".join(kept)


def table_names(db_path: str) -> tuple[str, ...]:
    """Names of the tables (used to describe a reference query in SFT responses)."""
    return tuple(t.name for t in read_tables(str(db_path), 0))
