"""Question files of the Spider family and BIRD, and where their databases live.

Layouts (paths from ``task.splits.<name>``):

* **Spider** (``train_spider.json``, ``dev.json``, Spider-Realistic, Spider-DK, Spider test): a
  JSON list of ``{"db_id", "query", "question", ...}``; databases at
  ``<db_dir>/<db_id>/<db_id>.sqlite``.
* **Spider-Syn**: the same with ``SpiderQuestion`` / ``SpiderSynQuestion`` instead of
  ``question``, picked by ``question_field``.
* **BIRD** (``format: bird``): ``{"question_id", "db_id", "question", "evidence", "SQL",
  "difficulty"}``; databases under ``dev_databases/<db_id>/<db_id>.sqlite``.

``db_dir`` may list folders searched in order (Spider-DK's three new databases live apart). A
missing file with ``hub``/``hub_split`` set is read with ``datasets`` (databases still on disk).
An example's id is the question's 0-based position in its file (BIRD: ``question_id``), so
predictions can be scored later by id.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

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
        unknown = set(raw) - {f for f in cls.__dataclass_fields__ if f != "name"}
        if unknown:
            raise ValueError(
                f"task.splits.{name}: unknown keys {sorted(unknown)}; valid keys are "
                f"{sorted(f for f in cls.__dataclass_fields__ if f != 'name')}"
            )
        db_dir = raw.pop("db_dir", None) or []
        if isinstance(db_dir, (str, os.PathLike)):
            db_dir = [db_dir]
        cfg = cls(name=name, db_dir=[str(d) for d in db_dir], **raw)
        if cfg.format not in ("spider", "bird"):
            raise ValueError(
                f"task.splits.{name}.format must be 'spider' or 'bird', not {cfg.format!r}"
            )
        if cfg.match not in (None, "spider", "bird"):
            raise ValueError(
                f"task.splits.{name}.match must be 'spider' or 'bird', not {cfg.match!r}"
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
