"""A task's scores are isolated per sample: what cannot be used becomes a counted reason.

Regression tests for scores that used to crash the step (``score()`` returning ``None``,
``rewards=None``, a reward ``"1.0"`` reaching the samples table's format code, a finite 1e308
overflowing the float32 reward tensor) or trained silently on zero advantages (a missing or
undeclared reward key, every reward NaN).
"""

from __future__ import annotations

import logging
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from mrtpo.core.batch import rewards_tensor
from mrtpo.core.faults import FaultTracker
from mrtpo.core.scoring import UndeclaredReward, clean_score, score_batch
from mrtpo.distributed import Ranks
from mrtpo.tasks.base import Example, Score, Task

NAMES = ("a", "b")


class Scripted(Task):
    name = "scripted"
    reward_names = NAMES

    def __init__(self, outputs):
        self.outputs = list(outputs)

    def examples(self, split):
        return []

    def score(self, example, response):
        return self.outputs.pop(0)


def _ex(i=0):
    return Example(id=f"e{i}", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("raw", "expect", "reason"),
    [
        (None, {"a": None, "b": None}, "returned NoneType"),
        (Score(rewards=None), {"a": None, "b": None}, "Score.rewards is NoneType"),
        (Score(rewards={"a": "1.0", "b": 1}), {"a": None, "b": 1.0}, "'a' is a str"),
        (Score(rewards={"a": 1e308, "b": 0.0}), {"a": None, "b": 0.0}, "too large for a reward"),
        (Score(rewards={"a": 1.0}), {"a": 1.0, "b": None}, "reward 'b' missing"),
        (Score(rewards={"a": True, "b": float("nan")}), {"a": 1.0, "b": None}, None),
    ],
    ids=["none", "rewards-none", "string", "huge", "missing", "bool-and-nan"],
)
def test_each_bad_score_costs_only_its_own_rewards(raw, expect, reason):
    s = clean_score(raw, NAMES, "scripted")
    assert s.rewards == expect
    assert all(v is None or type(v) is float for v in s.rewards.values())
    if reason:
        assert reason in (s.error or "")
    else:
        assert s.error is None
    t = rewards_tensor([s], NAMES)  # never inf from an overflow, never a crash
    assert not torch.isinf(t).any()


def test_infinite_rewards_are_kept_for_the_nonfinite_skip():
    s = clean_score(Score(rewards={"a": math.inf, "b": 0.0}), NAMES)
    assert s.rewards["a"] == math.inf and s.error is None


def test_an_undeclared_reward_name_stops_the_run_naming_it():
    with pytest.raises(UndeclaredReward, match=r"\['hasyes'\].*reward_names are \['a', 'b'\]"):
        clean_score(Score(rewards={"a": 1.0, "b": 0.0, "hasyes": 1.0}), NAMES, "scripted")


def test_score_batch_falls_back_per_response_and_cleans():
    class Broken(Scripted):
        def score_many(self, examples, responses):
            raise RuntimeError("pool died")

    task = Broken([Score(rewards={"a": 1.0, "b": "x"}), None])
    faults = FaultTracker(3, 3)
    scores = score_batch(task, [_ex(0), _ex(1)], ["r0", "r1"], faults)
    assert faults.counters["score_many_fallbacks"] == 1
    assert scores[0].rewards == {"a": 1.0, "b": None} and "'b' is a str" in scores[0].error
    assert scores[1].rewards == {"a": None, "b": None}


def test_a_step_without_any_usable_reward_warns_once(caplog):
    # set on the logger itself: an earlier test in the session may have quietened mrtpo.*
    caplog.set_level(logging.WARNING, logger="mrtpo.core.faults")
    faults = FaultTracker(3, 3)
    empty = [Score(rewards={"a": None, "b": None}) for _ in range(2)]
    with caplog.at_level(logging.WARNING):
        faults.check_scoring(empty, [_ex(0), _ex(1)], 0, Ranks())
        faults.check_scoring(empty, [_ex(0), _ex(1)], 1, Ranks())
    hits = [r for r in caplog.records if "no usable reward at all" in r.message]
    assert len(hits) == 1
    # a sample with an error but other rewards intact is usable
    caplog.clear()
    faults = FaultTracker(3, 3)
    partly = [Score(rewards={"a": 1.0, "b": None}, error="reward 'b' is str")]
    with caplog.at_level(logging.WARNING):
        faults.check_scoring(partly, [_ex(0)], 0, Ranks())
    assert not [r for r in caplog.records if "no usable reward" in r.message]


def test_all_failed_steps_stop_after_the_configured_streak():
    faults = FaultTracker(3, 2)
    bad = [Score(rewards={"a": None, "b": None}, error="boom")]
    faults.check_scoring(bad, [_ex()], 0, Ranks())
    with pytest.raises(RuntimeError, match=r"rl\.max_consecutive_score_failures"):
        faults.check_scoring(bad, [_ex()], 1, Ranks())


# ---- issue 25: integers beyond float, exits from scoring code, runaway blocks ----------------


def test_an_int_beyond_any_float_costs_only_its_reward():
    s = clean_score(Score(rewards={"a": 10**400, "b": 1}), NAMES, "scripted")
    assert s.rewards == {"a": None, "b": 1.0}
    assert "'a' is an int ('1000" in s.error and "too large for a reward" in s.error


def test_system_exit_in_scoring_code_is_a_scoring_error_not_the_end_of_the_run():
    class Exits(Scripted):
        def score(self, example, response):
            if response == "bye":
                raise SystemExit(0)
            return Score(rewards={"a": 1.0, "b": 0.0})

    class PoolExits(Exits):
        def score_many(self, examples, responses):
            raise SystemExit(3)

    for task, fallbacks in ((Exits([]), 0), (PoolExits([]), 1)):
        faults = FaultTracker(3, 3)
        scores = score_batch(task, [_ex(0), _ex(1)], ["hi", "bye"], faults)
        assert faults.counters.get("score_many_fallbacks", 0) == fallbacks
        assert scores[0].rewards == {"a": 1.0, "b": 0.0} and scores[0].error is None
        assert scores[1].rewards == {"a": None, "b": None}
        assert scores[1].error == "SystemExit: 0"


def test_keyboard_interrupt_in_scoring_stops_with_a_message(caplog):
    class Interrupted(Scripted):
        def score(self, example, response):
            raise KeyboardInterrupt

    caplog.set_level(logging.ERROR, logger="mrtpo.core.scoring")
    with pytest.raises(KeyboardInterrupt):
        score_batch(Interrupted([]), [_ex()], ["x"], FaultTracker(3, 3))
    assert any("KeyboardInterrupt while task scripted scored" in r.message for r in caplog.records)


def test_a_huge_block_is_cut_with_a_note_in_its_text_and_the_log(caplog, monkeypatch):
    import mrtpo.core.scoring

    monkeypatch.setattr(mrtpo.core.scoring, "_CAPPED", set())  # logged once per process otherwise

    class Blocks(Scripted):
        max_block_chars = 1000

    huge = "z" * 10_000_000
    outputs = [Score(rewards={"a": 1.0, "b": 0.0}, blocks={"a": huge, "b": "short"})] * 2
    caplog.set_level(logging.WARNING, logger="mrtpo.core.scoring")
    scores = score_batch(Blocks(outputs), [_ex(0), _ex(1)], ["r", "r"], FaultTracker(3, 3))
    for s in scores:
        assert len(s.blocks["a"]) == 1000 and s.blocks["b"] == "short"
        assert s.blocks["a"].startswith("zzz")
        assert s.blocks["a"].endswith(
            "[block cut to 1000 of its 10000000 characters (task.max_block_chars)]"
        )
    logged = [r for r in caplog.records if "task.max_block_chars=1000" in r.message]
    assert len(logged) == 1  # once per task and reward
    assert Task.max_block_chars == 16384  # every task has a cap by default


# ---- issue 37, case 10: one rule for every numeric type --------------------------------------

TOO_LARGE = "too large for a reward (float32 holds up to 3.4e+38)"
NOT_REAL = "not a real number"

#: (value, the reward it becomes, what the reason says; None: no reason). Shared with
#: tests/unit/test_custom_reliability.py, which sends the same values through a custom task.
NUMERIC_CASES = [
    (1 + 1j, None, NOT_REAL),
    (np.complex128(1 + 1j), None, NOT_REAL),
    (np.array(1 + 1j), None, NOT_REAL),
    (torch.tensor(1 + 1j), None, NOT_REAL),
    (10**400, None, TOO_LARGE),
    (Fraction(10**400, 3), None, TOO_LARGE),
    (Decimal("1e999999"), None, TOO_LARGE),
    (Decimal("-1e39"), None, TOO_LARGE),
    (np.longdouble("1e4000"), None, TOO_LARGE),
    (1e308, None, TOO_LARGE),
    (torch.tensor(1e300, dtype=torch.float64), None, TOO_LARGE),
    (Decimal("0.5"), 0.5, None),
    (Fraction(1, 4), 0.25, None),
    (np.float32(0.5), 0.5, None),
    (np.int64(2), 2.0, None),
    (np.bool_(True), 1.0, None),
    (torch.tensor(0.75), 0.75, None),
    (Decimal("NaN"), None, None),
    (Decimal("sNaN"), None, None),
    (np.float64("nan"), None, None),
    (math.inf, math.inf, None),  # a genuine infinity: the step's update is skipped
    (Decimal("-Infinity"), -math.inf, None),
    (np.float32("inf"), math.inf, None),
]
NUMERIC_IDS = [f"{type(v).__name__}-{i}" for i, (v, _, _) in enumerate(NUMERIC_CASES)]


@pytest.mark.parametrize(("value", "expect", "reason"), NUMERIC_CASES, ids=NUMERIC_IDS)
def test_one_rule_for_every_numeric_reward_type(value, expect, reason):
    s = clean_score(Score(rewards={"a": value, "b": 1.0}), NAMES, "scripted")
    assert s.rewards == {"a": expect, "b": 1.0}
    assert s.rewards["a"] is None or type(s.rewards["a"]) is float
    if reason:
        assert "reward 'a' is a" in s.error and reason in s.error
    else:
        assert s.error is None
