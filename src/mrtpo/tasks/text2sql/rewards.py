"""Reading a response, the three binary rewards and their verifier blocks.

Rewards (binary, after SQL-R1):

* **format**: ``<think>…</think>`` then ``<answer>…</answer>``, each tag once and in order, only
  whitespace outside, and the answer holds exactly one non-empty ```` ```sql ```` block.
* **executability**: the answer's query runs on the question's database without error within
  ``task.executor.timeout_s`` (the official evaluator allows 60 s). Stopped by the time or memory
  limit: not executable; a result over the row or size cap ran, so it is executable but not
  compared (execution 0).
* **execution**: its result matches the reference query's (``match.py``).

The query is the *last* SQL block inside the (last) ``<answer>`` even when the format is wrong,
so the rewards are judged independently; a fence labelled ``sql`` is preferred, an unlabelled one
accepted for execution. Parsing is linear in the text's length (``str.find``, ``str.count``, one
anchored pattern without nested repetition; ``tests/unit/test_fuzz_tasks.py`` times the worst).
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
#: The executability block by the executor's error kind (``executor.ERROR_KINDS``): each
#: says who stopped the query, so a limit of the executor is never passed off as SQLite's.
ERROR_BLOCKS = {
    "sqlite": ERROR_BLOCK,
    "driver": "This query could not be given to SQLite: Python's sqlite3 module raised: {error}.",
    "time": "When this query was executed on this database, the executor stopped it: {error}.",
    "memory": "When this query was executed on this database, the executor stopped it: {error}.",
    "refused": "This query was not executed: {error}.",
    "crash": "This query could not be executed: {error}.",
    "database": "This query could not be executed: {error}.",
}
REFERENCE_BLOCK = "The reference query for this question is: {query}."

_LABEL_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+-")
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


def _skip(text: str, i: int, chars: str | frozenset[str]) -> int:
    n = len(text)
    while i < n and text[i] in chars:
        i += 1
    return i


def _fence_spans(text: str) -> list[_Fence]:
    """Fenced code blocks, left to right, in one linear pass.

    A fence opens with three backticks; a label (letters, digits, ``_+-``) counts only when
    a line break follows it ("```SELECT 1```" is unlabelled); otherwise spaces and one line
    break after the backticks are skipped. The block ends at the next three backticks. This
    replaces a regular expression whose lazy body backtracked over the header, which made
    an unclosed fence followed by spaces cost quadratic time.
    """
    out: list[_Fence] = []
    n = len(text)
    pos = 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return out
        head = _skip(text, start + 3, " \t")
        label_end = _skip(text, head, _LABEL_CHARS)
        label, body_start = "", -1
        if label_end > head:
            i = _skip(text, label_end, " \t")
            if text.startswith("\r\n", i):
                body_start = i + 2
            elif i < n and text[i] == "\n":
                body_start = i + 1
            if body_start >= 0:
                label = text[head:label_end].lower()
        if body_start < 0:  # unlabelled: optional carriage return, optional line break
            body_start = head + (text.startswith("\r", head))
            body_start += text.startswith("\n", body_start)
        close = text.find("```", body_start)
        if close < 0:
            # No backticks after this header, hence none after any later opening either.
            return out
        out.append(_Fence(start, close + 3, label, text[body_start:close]))
        pos = close + 3


def _fences(text: str) -> list[tuple[str, str]]:
    """(label, body) of each fenced code block; "```sql SELECT 1```" counts as labelled."""
    out = []
    for f in _fence_spans(text):
        label, body = f.label, f.body
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
    m = _fence_spans(answer)[0]
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
    sql = query.strip().rstrip(";").strip()
    return (
        f"{THINK_OPEN}\n{think}\n{THINK_CLOSE}\n{ANSWER_OPEN}\n```sql\n{sql}\n```\n{ANSWER_CLOSE}"
    )
