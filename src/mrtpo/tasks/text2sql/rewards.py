"""Reading a response, the three binary rewards and their verifier blocks.

Rewards (binary, after SQL-R1):

* **format** -- the response is ``<think>…</think>`` followed by ``<answer>…</answer>``,
  each tag exactly once and in that order, only whitespace outside them, and the answer
  holds exactly one non-empty ```` ```sql ```` code block.
* **executability** -- the query of the answer runs on the question's database.
* **execution** -- its result matches the reference query's (``match.py``).

The query is taken from the *last* SQL code block inside the (last) ``<answer>`` even when
the format is wrong, so executability and execution are judged independently of format.
A fence labelled ``sql`` is preferred; an unlabelled fence is accepted for execution.

Parsing uses ``str.find`` and simple non-nested patterns only, so a megabyte of garbage
costs linear time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

# ---- verifier blocks (method.md, Tasks table) -------------------------------------------
FORMAT_BLOCK = (
    "Required format: put your reasoning inside <think> </think>, then put exactly one SQL "
    "query inside <answer> </answer> as a ```sql code block, with nothing outside these tags."
)
NO_SQL_BLOCK = "This response contains no SQL code block inside <answer>."
ERROR_BLOCK = "When this query was executed on this database, SQLite raised: {error}."
REFERENCE_BLOCK = "The reference query for this question is: {query}."

# A fence's label counts only when a line break follows it ("```SELECT 1```" is unlabelled).
_FENCE = re.compile(r"```(?:[ \t]*([A-Za-z0-9_+-]+)[ \t]*\r?\n|[ \t]*\r?\n?)(.*?)```", re.DOTALL)
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class ParsedResponse:
    sql: str | None  # the query to execute (None: no SQL block in the answer)
    format_ok: bool
    format_reason: str | None  # why the format reward is 0
    sql_reason: str | None  # why no query could be extracted


def _answer_text(response: str) -> str | None:
    end = response.rfind(ANSWER_CLOSE)
    start = response.rfind(ANSWER_OPEN, 0, end if end >= 0 else len(response))
    if start < 0:
        return None
    body_start = start + len(ANSWER_OPEN)
    return response[body_start:end] if end > start else response[body_start:]


_INLINE_LABEL = re.compile(r"\s*(sql|sqlite)\s+", re.IGNORECASE)


def _fences(text: str) -> list[tuple[str, str]]:
    """(label, body) of each fenced code block; "```sql SELECT 1```" counts as labelled."""
    out = []
    for m in _FENCE.finditer(text):
        label, body = (m.group(1) or "").lower(), m.group(2)
        if not label and (inline := _INLINE_LABEL.match(body)):
            label, body = inline.group(1).lower(), body[inline.end() :]
        out.append((label, body))
    return out


def extract_sql(response: str) -> tuple[str | None, str | None]:
    """(query, None) or (None, reason): the last SQL block inside the answer."""
    answer = _answer_text(response)
    if answer is None:
        return None, "no <answer> tag"
    blocks = _fences(answer)
    sql_blocks = [body for lang, body in blocks if lang in ("sql", "sqlite")]
    candidates = sql_blocks or [body for lang, body in blocks if lang == ""]
    candidates = [c.strip() for c in candidates if c.strip()]
    if not candidates:
        return None, "no SQL code block inside <answer>"
    return candidates[-1], None


def check_format(response: str) -> str | None:
    """None when the format is right, else the first problem found."""
    text = response.strip()
    for tag in TAGS:
        n = text.count(tag)
        if n != 1:
            return f"{tag} appears {n} times (exactly once required)"
    pos = [text.find(tag) for tag in TAGS]
    if pos != sorted(pos):
        return "tags out of order (required: <think>…</think><answer>…</answer>)"
    if not text.startswith(THINK_OPEN):
        return "text before <think>"
    if not text.endswith(ANSWER_CLOSE):
        return "text after </answer>"
    if text[pos[1] + len(THINK_CLOSE) : pos[2]].strip():
        return "text between </think> and <answer>"
    if not text[pos[0] + len(THINK_OPEN) : pos[1]].strip():
        return "empty <think>"
    answer = text[pos[2] + len(ANSWER_OPEN) : pos[3]]
    blocks = _fences(answer)
    if len(blocks) != 1:
        return f"<answer> holds {len(blocks)} code blocks (exactly one ```sql block required)"
    lang, body = blocks[0]
    if lang != "sql":
        return f"the code block is labelled {lang or 'nothing'!r}, not 'sql'"
    if not body.strip():
        return "the SQL code block is empty"
    m = _FENCE.search(answer)
    if answer[: m.start()].strip() or answer[m.end() :].strip():
        return "text inside <answer> outside the SQL code block"
    return None


def parse_response(response: str) -> ParsedResponse:
    if not isinstance(response, str):
        return ParsedResponse(None, False, "the response is not text", "the response is not text")
    fmt = check_format(response)
    sql, why = extract_sql(response)
    return ParsedResponse(sql=sql, format_ok=fmt is None, format_reason=fmt, sql_reason=why)


def error_block(error: str) -> str:
    """The executability block for a query that failed with ``error``."""
    error = " ".join(error.split())
    if len(error) > _MAX_ERROR_CHARS:
        error = error[: _MAX_ERROR_CHARS - 1] + "…"
    return ERROR_BLOCK.format(error=error.rstrip("."))


def reference_block(query: str) -> str:
    return REFERENCE_BLOCK.format(query=query.strip().rstrip(";").strip())


def reference_response(question: str, query: str, tables: list[str]) -> str:
    """A well-formed response around the reference query (SFT warm start, format tests)."""
    used = ", ".join(tables) if tables else "the relevant tables"
    think = (
        f"The question asks: {question.strip()} The answer comes from {used}; "
        "the query below selects it."
    )
    sql = query.strip().rstrip(";").strip()
    return (
        f"{THINK_OPEN}\n{think}\n{THINK_CLOSE}\n{ANSWER_OPEN}\n```sql\n{sql}\n```\n{ANSWER_CLOSE}"
    )
