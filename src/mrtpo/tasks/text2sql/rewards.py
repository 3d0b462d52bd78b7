"""Reading a response, the three binary rewards (format, executability, execution) and their
verifier blocks, after SQL-R1; the rules are in docs/tasks/text2sql.md, "Rewards".

The query is the *last* SQL block inside the (last) ``<answer>`` even when the format is wrong,
so the rewards are judged independently; a fence labelled ``sql`` is preferred, an unlabelled one
accepted for execution. Parsing is linear in the text's length (``str.find``, ``str.count``,
anchored patterns without nested repetition; ``tests/unit/test_fuzz_tasks.py`` times the worst).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

# ---- verifier blocks (method.md, Tasks table) -------------------------------------------
FORMAT_BLOCK = (
    "Required format: put your reasoning inside <think> </think>, then put exactly one SQL "
    "query inside <answer> </answer> as a ```sql code block, with nothing outside these tags."
)
NO_SQL_BLOCK = "This response contains no SQL code block inside <answer>."
#: The executability block by the executor's error kind (``executor.ERROR_KINDS``): each
#: says who stopped the query, so a limit of the executor is never passed off as SQLite's.
ERROR_BLOCKS = {
    "sqlite": "When this query was executed on this database, SQLite raised: {error}.",
    "driver": "This query could not be given to SQLite: Python's sqlite3 module raised: {error}.",
    "time": "When this query was executed on this database, the executor stopped it: {error}.",
    "memory": "When this query was executed on this database, the executor stopped it: {error}.",
    "refused": "This query was not executed: {error}.",
    "crash": "This query could not be executed: {error}.",
    "database": "This query could not be executed: {error}.",
}
REFERENCE_BLOCK = "The reference query for this question is: {query}."

# After a fence's backticks: blanks, a label (group 1), blanks, a line break (group 2). Every
# part is optional, so the first, greedy try matches: no backtracking.
_FENCE_HEADER = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)[ \t]*(\r?\n)?")
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


@dataclass(frozen=True)
class _Fence:
    start: int  # index of the opening backticks
    end: int  # index just past the closing backticks
    label: str  # lower-cased label ("" when unlabelled)
    body: str


def _fence_spans(text: str) -> list[_Fence]:
    """Fenced code blocks, left to right, in one linear pass.

    A fence opens with three backticks; a label (letters, digits, ``_+-``) counts only when
    a line break follows it ("```SELECT 1```" is unlabelled); otherwise spaces and one line
    break after the backticks are skipped. The block ends at the next three backticks. (A
    regular expression's lazy body made an unclosed fence followed by spaces quadratic.)
    """
    out: list[_Fence] = []
    pos = 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return out
        header = _FENCE_HEADER.match(text, start + 3)
        if header[1] and header[2]:
            label, body_start = header[1].lower(), header.end()
        else:  # unlabelled: optional carriage return, optional line break
            head = header.start(1)
            label, body_start = "", head + text.startswith("\r", head)
            body_start += text.startswith("\n", body_start)
        close = text.find("```", body_start)
        if close < 0:
            # No backticks after this header, hence none after any later opening either.
            return out
        out.append(_Fence(start, close + 3, label, text[body_start:close]))
        pos = close + 3


def _fences(text: str) -> list[_Fence]:
    """Fenced code blocks; "```sql SELECT 1```" counts as labelled."""
    out = []
    for f in _fence_spans(text):
        if not f.label and (inline := _INLINE_LABEL.match(f.body)):
            f = replace(f, label=inline.group(1).lower(), body=f.body[inline.end() :])
        out.append(f)
    return out


def extract_sql(response: str) -> tuple[str | None, str | None]:
    """(query, None) or (None, reason): the last SQL block inside the answer."""
    answer = _answer_text(response)
    if answer is None:
        return None, "no <answer> tag"
    blocks = _fences(answer)
    sql_blocks = [f.body for f in blocks if f.label in ("sql", "sqlite")]
    candidates = sql_blocks or [f.body for f in blocks if f.label == ""]
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
    m = blocks[0]
    if m.label != "sql":
        return f"the code block is labelled {m.label or 'nothing'!r}, not 'sql'"
    if not m.body.strip():
        return "the SQL code block is empty"
    if answer[: m.start].strip() or answer[m.end :].strip():
        return "text inside <answer> outside the SQL code block"
    return None


def parse_response(response: str) -> ParsedResponse:
    if not isinstance(response, str):
        return ParsedResponse(None, False, "the response is not text", "the response is not text")
    fmt = check_format(response)
    sql, why = extract_sql(response)
    return ParsedResponse(sql=sql, format_ok=fmt is None, format_reason=fmt, sql_reason=why)


def error_block(error: str, kind: str | None = "sqlite") -> str:
    """The executability block for a query that failed with ``error`` of ``kind``."""
    error = " ".join(error.split())
    if len(error) > _MAX_ERROR_CHARS:
        error = error[: _MAX_ERROR_CHARS - 1] + "…"
    template = ERROR_BLOCKS.get(kind or "", ERROR_BLOCKS["crash"])
    return template.format(error=error.rstrip("."))


def reference_block(query: str) -> str:
    return REFERENCE_BLOCK.format(query=query.strip().rstrip(";").strip())


def reference_response(question: str, query: str, tables: list[str]) -> str:
    """A well-formed response around the reference query (SFT warm start, format tests)."""
    used = ", ".join(tables) if tables else "the relevant tables"
    think = (
        f"The question asks: {question.strip()} The answer comes from {used}; "
        "the query below selects it."
    )
    return answer_response(think, query.strip().rstrip(";").strip())


def answer_response(think: str, sql: str) -> str:
    """A response in the task's format: ``think`` as the reasoning, ``sql`` the answer's query."""
    return (
        f"{THINK_OPEN}\n{think}\n{THINK_CLOSE}\n{ANSWER_OPEN}\n```sql\n{sql}\n```\n{ANSWER_CLOSE}"
    )
