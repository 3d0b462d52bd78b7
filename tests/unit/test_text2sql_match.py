"""Execution-match semantics (Spider's test-suite evaluator) and query normalisation."""

from __future__ import annotations

import pytest

from mrtpo.tasks.text2sql.match import (
    bird_result_eq,
    clean_query,
    order_matters,
    prepare_for_match,
    result_eq,
    results_match,
    strip_distinct,
)

# ---- row order ---------------------------------------------------------------------------


def test_order_ignored_without_order_by():
    assert result_eq([(1,), (2,), (3,)], [(3,), (1,), (2,)], ordered=False)


def test_order_significant_with_order_by():
    assert result_eq([(1,), (2,)], [(1,), (2,)], ordered=True)
    assert not result_eq([(1,), (2,)], [(2,), (1,)], ordered=True)


def test_order_by_detection_is_a_substring_test_on_the_reference():
    assert order_matters("SELECT a FROM t ORDER BY a")
    assert order_matters("select a from (select a from t order by a limit 3)")
    assert not order_matters("SELECT a FROM t GROUP BY a")


# ---- duplicates (bags, not sets) -----------------------------------------------------------


def test_duplicates_count():
    assert not result_eq([(1,), (1,), (2,)], [(1,), (2,), (2,)], ordered=False)
    assert not result_eq([(1,), (1,)], [(1,)], ordered=False)
    assert result_eq([(1,), (1,), (2,)], [(2,), (1,), (1,)], ordered=False)


# ---- columns ---------------------------------------------------------------------------


def test_column_permutation_matches():
    ref = [(1, "a", 2.5), (2, "b", 3.5)]
    pred = [("a", 2.5, 1), ("b", 3.5, 2)]
    assert result_eq(ref, pred, ordered=False)
    assert result_eq(ref, pred, ordered=True)


def test_permutation_must_be_consistent_across_rows():
    # each column holds the same bag of values, but no single permutation aligns the rows
    ref = [(1, 2), (2, 1), (3, 3)]
    pred = [(1, 1), (2, 2), (3, 3)]
    assert not result_eq(ref, pred, ordered=False)


def test_same_valued_columns_are_disambiguated_by_rows():
    ref = [(1, 2, 1), (2, 1, 2)]
    pred = [(1, 1, 2), (2, 2, 1)]  # columns (0, 2) of ref == columns (0, 1) of pred
    assert result_eq(ref, pred, ordered=True)


def test_column_count_must_agree():
    assert not result_eq([(1, 2)], [(1,)], ordered=False)
    assert not result_eq([(1,)], [(1, 1)], ordered=False)


def test_row_count_must_agree():
    assert not result_eq([(1,)], [(1,), (1,)], ordered=False)
    assert not result_eq([(1,)], [], ordered=False)


def test_two_empty_results_match_whatever_their_columns():
    assert result_eq([], [], ordered=False)


# ---- values: NULLs, numbers, text ----------------------------------------------------------


def test_nulls_equal_nulls():
    assert result_eq([(None, 1), (2, None)], [(2, None), (None, 1)], ordered=False)
    assert not result_eq([(None,)], [(0,)], ordered=False)
    assert not result_eq([(None,)], [("",)], ordered=False)


def test_int_matches_equal_float_but_not_text():
    assert result_eq([(1,), (2,)], [(1.0,), (2.0,)], ordered=False)
    assert result_eq([(1, "x")], [("x", 1.0)], ordered=True)
    assert not result_eq([(1,)], [("1",)], ordered=False)


def test_floats_compare_exactly():
    assert not result_eq([(0.3,)], [(0.1 + 0.2,)], ordered=False)
    assert not result_eq([(2.5,)], [(2.50001,)], ordered=False)


def test_bytes_values_are_hashable_and_compared():
    assert result_eq([(b"\x00\x01",)], [(b"\x00\x01",)], ordered=False)
    assert not result_eq([(b"\x00",)], [("\x00",)], ordered=False)


def test_wide_identical_columns_do_not_explode():
    ref = [tuple([1] * 9), tuple([2] * 9)]
    assert result_eq(ref, list(reversed(ref)), ordered=False)
    pred = [tuple([1] * 8 + [2]), tuple([2] * 8 + [1])]
    assert not result_eq(ref, pred, ordered=False)


# ---- BIRD rule ---------------------------------------------------------------------------


def test_bird_rule_is_set_equality_without_column_permutation():
    assert bird_result_eq([(1,), (1,), (2,)], [(2,), (1,)])  # duplicates ignored
    assert not bird_result_eq([(1, "a")], [("a", 1)])  # columns not permuted
    assert results_match([(1,), (2,)], [(2,), (1,)], ordered=True, mode="bird")
    assert not results_match([(1,), (2,)], [(2,), (1,)], ordered=True, mode="spider")


# ---- query normalisation ---------------------------------------------------------------


def test_clean_query_joins_spaced_operators_and_fixes_curdate():
    assert clean_query("SELECT a FROM t WHERE a > = 3 AND b ! = 2") == (
        "SELECT a FROM t WHERE a >= 3 AND b != 2"
    )
    assert clean_query("SELECT YEAR(CURDATE()) - age FROM t") == "SELECT 2020- age FROM t"


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT DISTINCT a FROM t", "SELECT  a FROM t"),
        ("SELECT count(distinct a) FROM t", "SELECT count( a) FROM t"),
        ("SELECT a FROM t WHERE b = 'distinct'", "SELECT a FROM t WHERE b = 'distinct'"),
        ('SELECT "distinct" FROM t', 'SELECT "distinct" FROM t'),
        ("SELECT a FROM t -- distinct\n", "SELECT a FROM t -- distinct\n"),
        ("SELECT a IS NOT DISTINCT FROM b FROM t", "SELECT a IS NOT DISTINCT FROM b FROM t"),
        ("SELECT distinct_count FROM t", "SELECT distinct_count FROM t"),
        (
            "SELECT a FROM t WHERE b = 'it''s distinct'",
            "SELECT a FROM t WHERE b = 'it''s distinct'",
        ),
    ],
)
def test_strip_distinct(sql, expected):
    assert strip_distinct(sql) == expected


def test_prepare_for_match_keeps_distinct_on_request():
    assert "DISTINCT" in prepare_for_match("SELECT DISTINCT a FROM t", keep_distinct=True)
    assert "DISTINCT" not in prepare_for_match("SELECT DISTINCT a FROM t")
