"""Reward functions log their own metrics (issue 41, item 5): a custom reward returns
``RewardResult(value, extras)`` or ``{"value": v, "extras": {...}}``, the extras ride on
``Score.extras``, each step logs their means as ``train/extra/<reward>/<name>`` (combined over
ranks as means, whatever the name), and they land in ``metrics.csv`` and ``src/report.py``."""

from __future__ import annotations

import csv
import json
import logging
import multiprocessing as mp
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from tests.conftest import ROOT

from mrtpo.core.scoring import clean_score
from mrtpo.evaluate.analysis.runs import rl_curves
from mrtpo.lightning.pipeline import build, metrics_csv
from mrtpo.tasks.base import RewardResult, Score, split_reward

MODULE = "mrtpo_test_extra_rewards"

REWARDS_PY = """
from mrtpo.tasks.base import RewardResult


def short(prompt, response, **row):
    # its value, and what it measured on the way; "max" is a name like any other
    return {"value": float(len(response) < 20), "extras": {"chars": len(response), "max": 2.0}}


def words(prompts, completions, **kwargs):
    # TRL's batched form: one RewardResult per completion
    return [RewardResult(float(len(c.split()) > 1), {"n": len(c.split())}) for c in completions]
"""


@pytest.fixture
def user(tmp_path, monkeypatch):
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(REWARDS_PY))
    rows = [{"id": f"p{i}", "prompt": f"Say {i} things."} for i in range(4)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return folder


def test_what_a_reward_may_return():
    assert split_reward(0.5) == (0.5, None, None)
    assert split_reward(RewardResult(1, {"a": 2})) == (1, {"a": 2}, None)
    assert split_reward({"value": None, "extras": {"a": 1}}) == (None, {"a": 1}, None)
    value, extras, problem = split_reward({"score": 1.0})
    assert value is None and extras is None and "unknown key(s) ['score']" in problem
    assert "no 'value'" in split_reward({"extras": {}})[2]
    assert "unknown key(s) ['extra']" in split_reward({"value": 1, "extra": {}})[2]


def test_extras_that_cannot_be_logged_are_left_out_not_the_reward(caplog):
    score = Score(
        rewards={"r": 1.0},
        extras={"r": {"ok": 3, "text": "x", "a/b": 1.0, "inf": float("inf"), "none": None},
                "other": {"x": 1.0}},
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="mrtpo.core.scoring"):
        out = clean_score(score, ["r"], "t-extras")
    assert out.rewards == {"r": 1.0} and out.error is None
    assert out.extras == {"r": {"ok": 3.0}}
    said = caplog.text
    assert "'text'" in said and "'a/b'" in said and "'inf'" in said and "'other'" in said


def test_custom_rewards_log_their_extras_per_step(user, train_cfg, tmp_path):
    cfg = train_cfg(
        "task=custom", f"task.data.path={user / 'prompts.jsonl'}", "task.data.id_column=id",
        f"task.rewards=[{MODULE}.short,{MODULE}.words]", "method=gdpo", "rl.group_size=2",
        "callbacks.sample_table.num=4",
    )  # fmt: skip
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    with open(metrics_csv(trainer)) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/reward/total/mean")]
    assert len(rows) == 2
    for key in ("train/extra/short/chars", "train/extra/short/max", "train/extra/words/n"):
        assert all(r[key] != "" for r in rows), key
    # the mean over the step's responses: samples.jsonl holds all 4 of step 1
    samples = [json.loads(s) for s in (tmp_path / "samples.jsonl").read_text().splitlines()]
    first = [s["response"] for s in samples if s["step"] == 1]
    assert len(first) == 4
    chars = sum(len(r) for r in first) / 4
    assert float(rows[0]["train/extra/short/chars"]) == pytest.approx(chars)
    assert float(rows[0]["train/extra/words/n"]) == pytest.approx(
        sum(len(r.split()) for r in first) / 4
    )
    assert float(rows[0]["train/extra/short/max"]) == 2.0

    curves = rl_curves(metrics_csv(trainer))
    assert curves["extra/short/chars"][0] == pytest.approx(chars)
    res = subprocess.run([sys.executable, "src/report.py", str(tmp_path), "--no-plots"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    head = next(line for line in res.stdout.splitlines() if line.startswith("| group"))
    assert "| extra/short/chars |" in head and "| extra/words/n |" in head, res.stdout


def _rank(rank: int, init_file: str, queue) -> None:
    import torch.distributed as dist

    from mrtpo.distributed import Ranks
    from mrtpo.step import metrics as step_metrics

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # rank 0: 1 response measured 10; rank 1: 3 responses measured 2 on average
        got = [[10.0], [1.0, 2.0, 3.0]][rank]
        scored = SimpleNamespace(scores=[SimpleNamespace(extras={"r": {"max": v}}) for v in got])
        m = step_metrics._extras(scored)
        # beside it, a metric declared a maximum is one (the declaration, not the name)
        m["reward/r/max"] = step_metrics.Stat([10.0, 2.0][rank], step_metrics.Reduce.MAX)
        queue.put((rank, step_metrics.combine(m, Ranks())))
    finally:
        dist.destroy_process_group()


def test_extras_are_means_over_ranks_whatever_their_name(tmp_path):
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    for rank in (0, 1):
        assert got[rank]["extra/r/max"] == pytest.approx((10 * 1 + 2 * 3) / 4)  # weighted mean
        assert got[rank]["reward/r/max"] == 10.0  # a "/max" metric is a maximum


def test_text2sql_reports_what_executability_ran(tmp_path):
    import sqlite3

    from mrtpo.tasks.base import Example
    from mrtpo.tasks.text2sql import Text2SQLTask

    db = tmp_path / "db" / "shop.sqlite"
    db.parent.mkdir()
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT)")
    con.executemany("INSERT INTO item VALUES (?, ?)", [(1, "pen"), (2, "cup")])
    con.commit()
    con.close()
    gold = "SELECT name FROM item ORDER BY id"
    ex = Example(id="0", messages=[{"role": "user", "content": "q"}],
                 data={"db_id": "shop", "db_path": str(db), "query": gold, "match": "spider"})  # fmt: skip
    task = Text2SQLTask(splits={}, executor={"workers": 1, "timeout_s": 5})
    try:
        sql = "SELECT name FROM item"
        ran, none = task.score_many(
            [ex, ex], [f"<think>x</think><answer>\n```sql\n{sql}\n```\n</answer>", "no sql"]
        )
    finally:
        task.close()
    assert ran.rewards["executability"] == 1.0
    assert ran.extras["executability"]["sql_chars"] == len(sql)
    assert 0 < ran.extras["executability"]["exec_seconds"] < 5
    assert none.extras == {}  # nothing ran, nothing measured
