"""Execution match: when do two query results count as the same answer?

Follows Spider's official execution evaluation (``test-suite-sql-eval``, ``exec_eval.py``) so
numbers compare with published ones:

* Both queries get the evaluator's clean-up (``> =`` to ``>=``, MySQL's ``YEAR(CURDATE())`` to
  2020) and, unless ``keep_distinct``, lose every ``DISTINCT`` (the official default).
* Results are bags of rows; order matters only when the *reference* text contains ``order by``
  (a plain substring test, as upstream). Columns match under some permutation.
* Values compare by Python equality on what ``sqlite3`` returns: ``NULL == NULL``,
  ``1 == 1.0``, ``1 != '1'``, floats exactly. Two empty results match whatever their widths.

Deliberate differences, each removing only false negatives or non-determinism: ``IS [NOT]
DISTINCT FROM`` is kept (upstream's deletion makes a syntax error); permutations are pruned by
each column's bag of values, exactly (upstream samples 20 rows), giving up after
``MAX_PERMUTATIONS``; upstream's sorted-string quick reject (wrong on ``(1, 1.0)`` rows) is not
reproduced; only the question's own database is used (plain Spider execution accuracy).

BIRD's evaluation, ``mode="bird"``: ``set(predicted rows) == set(reference rows)``.

Standard library only: the executor's worker processes run it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

Row = tuple[Any, ...]

#: Give up the column-permutation search after this many candidates (counts as no match).
MAX_PERMUTATIONS = 20_000

_SPACED_OPERATORS = (("> =", ">="), ("< =", "<="), ("! =", "!="))
_CURRENT_YEAR = re.compile(r"YEAR\s*\(\s*CURDATE\s*\(\s*\)\s*\)\s*", re.IGNORECASE)
# String literals, quoted identifiers and comments: DISTINCT inside them is left alone.
_PROTECTED = re.compile(
    r"'(?:[^']|'')*'?"  # 'string' ('' escapes a quote); an unterminated one runs to the end
    r'|"(?:[^"]|"")*"?'  # "identifier"
    r"|`[^`]*`?"  # `identifier`
    r"|\[[^\]]*\]?"  # [identifier]
    r"|--[^\n]*"  # line comment
    r"|/\*.*?(?:\*/|\Z)",  # block comment
    re.DOTALL,
)
_DISTINCT = re.compile(r"\b(is\s+(?:not\s+)?)?distinct\b", re.IGNORECASE)


def clean_query(sql: str) -> str:
    """The official evaluator's clean-up, applied to every query before it runs."""
    for spaced, joined in _SPACED_OPERATORS:
        sql = sql.replace(spaced, joined)
    return _CURRENT_YEAR.sub("2020", sql)


def _drop_distinct(text: str) -> str:
    return _DISTINCT.sub(lambda m: m.group(0) if m.group(1) else "", text)


def strip_distinct(sql: str) -> str:
    """Remove the ``DISTINCT`` set quantifier outside literals, identifiers and comments."""
    out: list[str] = []
    pos = 0
    for m in _PROTECTED.finditer(sql):
        out.append(_drop_distinct(sql[pos : m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(_drop_distinct(sql[pos:]))
    return "".join(out)


def order_matters(reference_sql: str) -> bool:
    """Upstream's rule: row order is compared iff the reference mentions ``order by``."""
    return "order by" in reference_sql.lower()


def prepare_for_match(sql: str, keep_distinct: bool = False) -> str:
    """The text that is executed for the execution-match comparison."""
    sql = clean_query(sql)
    return sql if keep_distinct else strip_distinct(sql)


def _column_candidates(reference: Sequence[Row], predicted: Sequence[Row], n_cols: int):
    """For each reference column, the predicted columns holding the same bag of values."""
    ref_bags = [Counter(row[i] for row in reference) for i in range(n_cols)]
    pred_bags = [Counter(row[j] for row in predicted) for j in range(n_cols)]
    return [[j for j in range(n_cols) if pred_bags[j] == ref_bags[i]] for i in range(n_cols)]


def _permutations(candidates: list[list[int]]) -> Iterator[tuple[int, ...]]:
    """Injective assignments reference column -> predicted column, by backtracking."""
    n = len(candidates)
    chosen: list[int] = []
    used: set[int] = set()

    def walk(i: int) -> Iterator[tuple[int, ...]]:
        if i == n:
            yield tuple(chosen)
            return
        for j in candidates[i]:
            if j not in used:
                used.add(j)
                chosen.append(j)
                yield from walk(i + 1)
                chosen.pop()
                used.discard(j)

    return walk(0)


def result_eq(reference: Sequence[Row], predicted: Sequence[Row], ordered: bool) -> bool:
    """True when ``predicted`` denotes the same answer as ``reference`` (Spider semantics)."""
    if not reference and not predicted:
        return True
    if len(reference) != len(predicted):
        return False
    n_cols = len(reference[0])
    if len(predicted[0]) != n_cols:
        return False
    ref_rows = [tuple(r) for r in reference]
    ref_bag = None if ordered else Counter(ref_rows)
    candidates = _column_candidates(ref_rows, predicted, n_cols)
    for tried, perm in enumerate(_permutations(candidates)):
        if tried >= MAX_PERMUTATIONS:
            return False
        permuted = [tuple(row[j] for j in perm) for row in predicted]
        if ordered:
            if permuted == ref_rows:
                return True
        elif Counter(permuted) == ref_bag:
            return True
    return False


def bird_result_eq(reference: Sequence[Row], predicted: Sequence[Row]) -> bool:
    """BIRD's official rule: the two results hold the same *set* of rows."""
    return {tuple(r) for r in reference} == {tuple(r) for r in predicted}


def results_match(
    reference: Sequence[Row], predicted: Sequence[Row], ordered: bool, mode: str = "spider"
) -> bool:
    """Dispatch on the evaluation ``mode`` ("spider" or "bird")."""
    if mode == "bird":
        return bird_result_eq(reference, predicted)
    return result_eq(reference, predicted, ordered)
