"""A task's scores are isolated per sample: what cannot be used becomes a counted reason.

Regression tests for scores that used to crash the step (``score()`` returning ``None``,
``rewards=None``, a reward ``"1.0"`` reaching the samples table's format code, a finite 1e308
overflowing the float32 reward tensor) or trained silently on zero advantages (a missing or
undeclared reward key, every reward NaN).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from mrtpo.batch import rewards_tensor
from mrtpo.distributed import Ranks
from mrtpo.faults import FaultTracker
from mrtpo.scoring import UndeclaredReward, clean_score, score_batch
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
        (Score(rewards={"a": "1.0", "b": 1}), {"a": None, "b": 1.0}, "'a' is str"),
        (Score(rewards={"a": 1e308, "b": 0.0}), {"a": None, "b": 0.0}, "beyond float32"),
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
    assert scores[0].rewards == {"a": 1.0, "b": None} and "'b' is str" in scores[0].error
    assert scores[1].rewards == {"a": None, "b": None}


def test_a_step_without_any_usable_reward_warns_once(caplog):
    # set on the logger itself: an earlier test in the session may have quietened mrtpo.*
    caplog.set_level(logging.WARNING, logger="mrtpo.faults")
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
