"""Database schema text for prompts: CREATE TABLE statements plus a few sample values.

The statements are read from the SQLite file itself (``sqlite_master``), so the model sees
exactly the names and types its query will run against. Sample values tell it how data
is spelled (``'USA'`` or ``'United States'``), which decides many WHERE clauses.

Long schemas are shrunk to a character budget in steps: fewer sample values per column,
then none, then whole tables are left out (with a note saying how many).
"""

from __future__ import annotations

import functools
import math
import sqlite3
import time
from dataclasses import dataclass

from .executor import readonly_uri

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
            tables.append(
                TableInfo(
                    name=name,
                    create_sql=(create_sql or f"CREATE TABLE {_quote_ident(name)} (...)").strip(),
                    columns=columns,
                    samples=tuple(samples),
                )
            )
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
