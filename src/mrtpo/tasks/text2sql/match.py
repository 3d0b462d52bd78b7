"""Execution match: when do two query results count as the same answer?

Spider's official execution evaluation (``test-suite-sql-eval``, ``exec_eval.py``), so that
numbers compare with published ones, and BIRD's rule (``mode="bird"``); the rules and the
deliberate differences (each removing only false negatives or non-determinism) are in
docs/tasks/text2sql.md, "Execution match". Standard library only: the executor's workers run it.
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
# Group 1: a string literal, quoted identifier or comment (DISTINCT inside is left alone);
# else DISTINCT, with group 2 the IS [NOT] of ``IS [NOT] DISTINCT FROM`` (kept too).
_PROTECTED_OR_DISTINCT = re.compile(
    r"('(?:[^']|'')*'?"  # 'string' ('' escapes a quote); an unterminated one runs to the end
    r'|"(?:[^"]|"")*"?'  # "identifier"
    r"|`[^`]*`?"  # `identifier`
    r"|\[[^\]]*\]?"  # [identifier]
    r"|--[^\n]*"  # line comment
    r"|/\*.*?(?:\*/|\Z))"  # block comment
    r"|\b(is\s+(?:not\s+)?)?distinct\b",
    re.DOTALL | re.IGNORECASE,
)


def clean_query(sql: str) -> str:
    """The official evaluator's clean-up, applied to every query before it runs."""
    for spaced, joined in _SPACED_OPERATORS:
        sql = sql.replace(spaced, joined)
    return _CURRENT_YEAR.sub("2020", sql)


def strip_distinct(sql: str) -> str:
    """Remove the ``DISTINCT`` set quantifier outside literals, identifiers and comments."""
    return _PROTECTED_OR_DISTINCT.sub(lambda m: m[0] if m[1] or m[2] else "", sql)


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


def _permutations(
    candidates: list[list[int]], chosen: tuple[int, ...] = ()
) -> Iterator[tuple[int, ...]]:
    """Injective assignments reference column -> predicted column, by backtracking."""
    if len(chosen) == len(candidates):
        yield chosen
        return
    for j in candidates[len(chosen)]:
        if j not in chosen:
            yield from _permutations(candidates, (*chosen, j))


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
