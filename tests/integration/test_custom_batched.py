"""``task=custom`` with TRL-style batched reward functions, ``(prompts, completions,
**kwargs) -> list``: one call per batch, columns as lists, None for "no reward here";
next to the per-sample form (issue 29 item 9)."""

from __future__ import annotations

import csv
import json
import sys
import textwrap

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from mrtpo.lightning.pipeline import build, metrics_csv

MODULE = "mrtpo_test_trl_rewards"

REWARDS_PY = '''
"""Reward functions written for TRL's GRPOTrainer."""

CALLS = []  # (number of completions, the columns passed) per call


def keyword(prompts, completions, word, skip=None, **kwargs):
    CALLS.append((len(completions), sorted(["word", "skip", *kwargs])))
    out = []
    for prompt, completion, w, s in zip(prompts, completions, word, skip or [None] * len(word)):
        # TRL: conversational prompts get completions as assistant messages
        text = completion[0]["content"] if isinstance(completion, list) else completion
        out.append(None if s else float(w in text))
    return out


def too_few(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def even_length(prompt, response, **row):
    return float(len(response) % 2 == 0)


def batched_block(prompts, completions, **kwargs):
    return ["block"] * len(completions)


ZERO_D_CALLS = []


def zero_d(prompts, completions, **kwargs):
    """One value for the whole batch: a 0-d tensor, then a 0-d numpy array, then a list."""
    import numpy as np
    import torch

    ZERO_D_CALLS.append(len(completions))
    if len(ZERO_D_CALLS) == 1:
        return torch.tensor(1.0)
    if len(ZERO_D_CALLS) == 2:
        return np.array(0.5)
    return [0.25] * len(completions)
'''

ROWS = [
    {"id": "a", "prompt": "Say something short.", "word": "yes"},
    {"id": "b", "prompt": "Reply with one word.", "word": "no", "skip": True},
    {"id": "c", "prompt": [{"role": "user", "content": "Answer briefly."}], "word": "ok"},
    {"id": "d", "prompt": "Write a few letters.", "word": "a"},
]


@pytest.fixture
def user(tmp_path, monkeypatch):
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(REWARDS_PY))
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return folder


def custom(user, rewards: str = "keyword,even_length", *more: str) -> list[str]:
    names = ",".join(f"{MODULE}.{r}" for r in rewards.split(","))
    return [
        "task=custom",
        f"task.data.path={user / 'prompts.jsonl'}",
        "task.data.id_column=id",
        f"task.rewards=[{names}]",
        *more,
    ]


def test_a_batch_is_one_call_with_columns_as_lists(user, train_cfg):
    task = instantiate(train_cfg(*custom(user)).task)
    calls = sys.modules[MODULE].CALLS
    ex = list(task.examples("train"))
    scores = task.score_many(ex, ["yes!", "no", "ok", "bcd"])
    assert len(calls) == 1 and calls[0][0] == 4  # one call for the four responses
    assert calls[0][1] == ["id", "skip", "word"]  # every other column, as lists
    assert [s.rewards["keyword"] for s in scores] == [1.0, None, 1.0, 0.0]
    assert [s.rewards["even_length"] for s in scores] == [1.0, 1.0, 1.0, 0.0]
    assert all(s.error is None for s in scores)
    # one response alone (safe_score, the fallback of a failed batch) is a batch of one
    assert task.safe_score(ex[2], "ok").rewards["keyword"] == 1.0
    assert calls[-1][0] == 1


def test_a_wrong_number_of_values_costs_that_reward_of_the_batch(user, train_cfg):
    task = instantiate(train_cfg(*custom(user, "too_few,even_length")).task)
    scores = task.score_many(list(task.examples("train")), ["ab", "abc", "a", "abcd"])
    assert [s.rewards["too_few"] for s in scores] == [None] * 4
    assert [s.rewards["even_length"] for s in scores] == [1.0, 0.0, 0.0, 1.0]
    assert f"too_few ({MODULE}.too_few) returned 3 values for 4 completions" in scores[0].error


def test_a_batched_block_function_is_refused_naming_the_key(user, train_cfg):
    cfg = train_cfg(*custom(user), f"task.blocks={{keyword: {MODULE}.batched_block}}")
    with pytest.raises(InstantiationException, match=r"task\.blocks\.keyword.*completions"):
        instantiate(cfg.task)


def test_per_sample_function_returning_a_list_says_how_to_batch(tmp_path):
    from mrtpo.tasks.custom import CustomTask

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "Hi"}) + "\n")

    def listy(prompt, response, **row):
        return [1.0]

    task = CustomTask(data={"path": str(data)}, rewards=[listy])
    s = task.score(task.examples("train")[0], "x")
    assert s.rewards == {"listy": None} and "(prompts, completions, **kwargs)" in s.error


def test_trains_two_steps_with_a_trl_reward(user, train_cfg):
    cfg = train_cfg(*custom(user), "method=mrtpo", "rl.group_size=4")
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert module.iteration == 2
    with open(metrics_csv(trainer)) as f:
        rows = list(csv.DictReader(f))
    vals = [float(r["train/reward/keyword/mean"]) for r in rows if r["train/reward/keyword/mean"]]
    assert vals and all(0.0 <= v <= 1.0 for v in vals)
    assert sum(float(r["train/scoring_errors"]) for r in rows) == 0
    # one call per scored batch: a step's prompts x group_size responses at a time
    sizes = [n for n, _ in sys.modules[MODULE].CALLS]
    per_step = cfg.rl.prompts_per_step * cfg.rl.group_size
    assert len(sizes) == 2 and all(n == per_step for n in sizes), sizes


# ---- issue 37, case 8: a 0-d tensor or array for a whole batch ------------------------------


def test_a_zero_d_return_costs_only_that_reward_of_the_batch(user, train_cfg):
    task = instantiate(train_cfg(*custom(user, "keyword,zero_d,even_length")).task)
    ex = list(task.examples("train"))
    for kind in ("0-d Tensor", "0-d ndarray"):
        scores = task.score_many(ex, ["yes!", "no", "ok", "bcd"])
        assert [s.rewards["keyword"] for s in scores] == [1.0, None, 1.0, 0.0]
        assert [s.rewards["even_length"] for s in scores] == [1.0, 1.0, 1.0, 0.0]
        assert [s.rewards["zero_d"] for s in scores] == [None] * 4
        assert f"zero_d ({MODULE}.zero_d) returned a {kind} (one value)" in scores[0].error
        assert "not a list of 4 values" in scores[0].error
    scores = task.score_many(ex, ["yes!", "no", "ok", "bcd"])  # a list again: read as usual
    assert [s.rewards["zero_d"] for s in scores] == [0.25] * 4
    assert all(s.error is None for s in scores)


def test_a_run_keeps_the_healthy_rewards_when_a_batched_one_returns_0_d(user, train_cfg):
    cfg = train_cfg(*custom(user, "keyword,zero_d"), "method=mrtpo", "rl.group_size=4")
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert module.iteration == 2
    with open(metrics_csv(trainer)) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/scoring_errors")]
    per_step = cfg.rl.prompts_per_step * cfg.rl.group_size
    # the 0-d reward fails on every response of both steps; the healthy one is kept
    assert [float(r["train/scoring_errors"]) for r in rows] == [per_step, per_step]
    assert all(r["train/reward/keyword/mean"] not in ("", "nan") for r in rows)
    assert all(r.get("train/reward/zero_d/mean") in (None, "", "nan") for r in rows)
    last = module.last.scores
    assert all(s.rewards["zero_d"] is None and s.rewards["keyword"] is not None for s in last)
    assert "returned a 0-d ndarray (one value)" in last[0].error
