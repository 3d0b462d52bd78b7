"""Reference solutions for self-distillation on text-to-SQL (``method=opsd``).

The paper's references for Spider train are OmniSQL's released chain-of-thought solutions (Li
et al., arXiv 2503.02240): hub dataset ``seeklhy/OmniSQL-datasets`` (also ModelScope), archive
``data.zip``, file ``data/spider/train_spider_enhanced_with_cot.json``. As OmniSQL's
``train_and_evaluate/process_dataset.py`` reads it (``--source spider --mode train``): a JSON list
of ``train_spider.json`` rows (``db_id``, ``question``, ``query``, ...), each with a ``cot`` that
ends with the query in a fenced ```` ```sql ```` block (``post_process_cot.py`` takes the last
one). The archive's ``data/train_spider.json`` (``input_seq``/``output_seq`` only) cannot be
matched.

``task.reference_solutions`` is that file's path. Rows match training questions by ``(db_id,
question)`` (whitespace collapsed, case folded) and are rewritten in the task's answer format
(reasoning in ``<think>``, last SQL block in ``<answer>``), so the teacher sees the format the
student writes. ``gold``: the gold query in the answer format (``Example.reference``) with a
one-line reasoning. Unset (default): ``method=opsd`` is refused, naming the key.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from .rewards import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN

log = logging.getLogger(__name__)

GOLD = "gold"
KEY = "task.reference_solutions"
RELEASE = "data/spider/train_spider_enhanced_with_cot.json of seeklhy/OmniSQL-datasets (data.zip)"

_SQL_BLOCK = re.compile(r"```sql\s*(.*?)\s*```", re.DOTALL | re.IGNORECASE)


def question_key(db_id: str, question: str) -> tuple[str, str]:
    return str(db_id), " ".join(str(question).split()).casefold()


def to_answer_format(cot: str) -> str | None:
    """An OmniSQL solution in this task's format: ``<think>reasoning</think>`` then the last
    ```` ```sql ```` block inside ``<answer>``. None when the text has no SQL block."""
    blocks = list(_SQL_BLOCK.finditer(cot or ""))
    if not blocks:
        return None
    last = blocks[-1]
    sql = last.group(1).strip()
    if not sql:
        return None
    reasoning = cot[: last.start()].strip()
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n{ANSWER_OPEN}\n```sql\n{sql}\n```\n{ANSWER_CLOSE}"


def load_solutions(path: str | Path) -> tuple[dict[tuple[str, str], str], dict[str, int]]:
    """``{(db_id, question key): solution in the answer format}`` and counts (rows read,
    kept, without a usable SQL block, duplicates)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"{KEY}={str(path)!r}: no such file. Point it at OmniSQL's Spider-train "
            f"solutions ({RELEASE}), set {KEY}=gold for the gold-query fallback, or leave it "
            "null (then method=opsd is refused)"
        )
    with open(p, encoding="utf-8") as f:
        rows: Any = json.load(f)
    if not isinstance(rows, list):
        raise ValueError(f"{KEY}: {p} is not a JSON list of rows (expected {RELEASE})")
    out: dict[tuple[str, str], str] = {}
    stats = {"read": len(rows), "kept": 0, "no_sql_block": 0, "duplicates": 0}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not {"db_id", "question", "cot"} <= set(row):
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"{KEY}: row {i} of {p} lacks db_id/question/cot (has {keys}); expected the "
                f"rows of {RELEASE}"
            )
        text = to_answer_format(str(row["cot"]))
        if text is None:
            stats["no_sql_block"] += 1
            continue
        key = question_key(row["db_id"], row["question"])
        if key in out:
            stats["duplicates"] += 1  # the same question twice in Spider train: keep the first
            continue
        out[key] = text
        stats["kept"] += 1
    return out, stats


class ReferenceSolutions:
    """The teacher's reference for each training question, from ``task.reference_solutions``
    (None: none configured; ``"gold"``: the gold query in the answer format; else a path)."""

    def __init__(self, setting: str | None) -> None:
        self.setting = None if setting in (None, "") else str(setting)
        self._table: dict[tuple[str, str], str] | None = None
        self.stats: dict[str, int] = {}

    def _solutions(self) -> dict[tuple[str, str], str]:
        if self._table is None:
            self._table, self.stats = load_solutions(self.setting or "")
            log.info(
                "text2sql: %d OmniSQL reference solutions read from %s (%d rows, %d without a "
                "SQL block, %d duplicates)",
                self.stats["kept"],
                self.setting,
                self.stats["read"],
                self.stats["no_sql_block"],
                self.stats["duplicates"],
            )
        return self._table

    def reference(self, db_id: str, question: str, gold_reference: str | None) -> str | None:
        if self.setting is None:
            raise ValueError(
                f"method=opsd on task=text2sql needs a reference solution per question for the "
                f"teacher's context, and {KEY} is not set: set it to the path of OmniSQL's "
                f"Spider-train solutions ({RELEASE}), or {KEY}=gold for the fallback (the "
                "gold query in the answer format; not the paper's setting)"
            )
        if self.setting == GOLD:
            return gold_reference
        return self._solutions().get(question_key(db_id, question))
