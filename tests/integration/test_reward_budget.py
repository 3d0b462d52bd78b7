"""Time budgets of the calls we do not own (issue 37, cases 9 and 13).

A custom reward that slept forever hung the run (no budget at all); ``task.checker_timeout_s=inf``
(or ``1e12``) was accepted, then every checker call failed with ``OverflowError: timestamp out
of range`` and the run ended rc 0 with every reward None. Rewards now run under
``task.reward_timeout_s`` (the ``SIGALRM`` timer of ``mrtpo.tasks.deadline``), and a budget the
timer cannot take is refused when the task is built, before the model loads.

The sleeping functions sleep ``HANG_GUARD_S``, not forever: should the budget fail, the test
fails after that long instead of hanging (the budgets in the tests are a fraction of a second).
"""

from __future__ import annotations

import csv
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.conftest import ROOT

from mrtpo.core.faults import FaultTracker
from mrtpo.core.scoring import score_batch
from mrtpo.lightning.pipeline import build, metrics_csv, prepare
from mrtpo.tasks.custom import CustomTask

HANG_GUARD_S = 600.0  # far beyond any budget below: reached only when the budget failed
BUDGET_S = 0.2


def ok(prompt, response, **row):
    return 1.0


def sleepy(prompt, response, **row):
    if response == "slow":
        time.sleep(HANG_GUARD_S)
    return 1.0


def sleepy_batch(prompts, completions, **kwargs):
    time.sleep(HANG_GUARD_S)
    return [1.0] * len(completions)


def sleepy_block(prompt, response, **row):
    time.sleep(HANG_GUARD_S)
    return "never"


def swallows(prompt, response, **row):
    """A reward whose own ``except Exception`` must not keep it running past the budget."""
    try:
        time.sleep(HANG_GUARD_S)
    except Exception:
        return 0.0
    return 1.0


def _task(tmp_path, rewards, **kw) -> CustomTask:
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    return CustomTask(data={"path": str(data)}, rewards=list(rewards), **kw)


# ---- case 13: rewards get a time budget -----------------------------------------------------


def test_a_reward_past_its_budget_is_none_naming_the_function_and_the_key(tmp_path, caplog):
    task = _task(tmp_path, [ok, sleepy, swallows], reward_timeout_s=BUDGET_S)
    ex = task.examples("train")[0]
    caplog.set_level(logging.WARNING, logger="mrtpo.tasks.custom.task")
    start = time.monotonic()
    slow, fast = score_batch(task, [ex, ex], ["slow", "fast"], FaultTracker(3, 3))
    assert time.monotonic() - start < HANG_GUARD_S / 10
    assert slow.rewards == {"ok": 1.0, "sleepy": None, "swallows": None}
    assert fast.rewards["ok"] == 1.0 and fast.rewards["sleepy"] == 1.0
    who = f"reward sleepy ({__name__}.sleepy)"
    assert f"{who} ran past its time budget (task.reward_timeout_s={BUDGET_S:g} s)" in slow.error
    assert f"reward swallows ({__name__}.swallows) ran past" in slow.error
    logged = [r.getMessage() for r in caplog.records if "task.reward_timeout_s" in r.getMessage()]
    assert any(who in m for m in logged)  # once per function, so a slow run says why


def test_a_batched_reward_and_a_block_past_the_budget_cost_only_themselves(tmp_path):
    task = _task(
        tmp_path, [ok, sleepy_batch], blocks={"ok": sleepy_block}, reward_timeout_s=BUDGET_S
    )
    ex = task.examples("train")[0]
    scores = score_batch(task, [ex, ex], ["a", "b"], FaultTracker(3, 3))
    for s in scores:
        assert s.rewards == {"ok": 1.0, "sleepy_batch": None}
        assert "sleepy_batch" in s.error and "task.reward_timeout_s" in s.error
        assert s.blocks["ok"] is None and "task.reward_timeout_s" in s.reasons["block/ok"]


def test_the_budget_defaults_to_60_s_and_null_means_none(tmp_path, train_cfg):
    assert _task(tmp_path, [ok]).reward_timeout_s == 60.0
    assert _task(tmp_path, [ok], reward_timeout_s=None).reward_timeout_s is None
    cfg = train_cfg("task=custom", f"task.data.path={tmp_path / 'p.jsonl'}", "task.rewards=[x.y]")
    assert cfg.task.reward_timeout_s == 60


def test_off_the_main_thread_a_reward_runs_unbudgeted_and_that_is_logged(
    tmp_path, caplog, monkeypatch
):
    from mrtpo.tasks import deadline

    monkeypatch.setattr(deadline, "_WARNED", set())  # logged once per process otherwise
    caplog.set_level(logging.WARNING, logger="mrtpo.tasks.deadline")

    def a_bit_slow(prompt, response, **row):
        time.sleep(3 * BUDGET_S)
        return 0.5

    task = _task(tmp_path, [a_bit_slow], reward_timeout_s=BUDGET_S)
    ex = task.examples("train")[0]
    out: list = []
    th = threading.Thread(target=lambda: out.append(task.score(ex, "x")))
    th.start()
    th.join(HANG_GUARD_S)
    assert out[0].rewards == {"a_bit_slow": 0.5}  # no signal reaches this thread
    msgs = [r.getMessage() for r in caplog.records]
    assert any("task.reward_timeout_s" in m and "outside the main thread" in m for m in msgs)


REWARDS_PY = """
import time

CALLS = []


def sometimes_sleeps(prompt, response, **row):
    CALLS.append(response)
    if len(CALLS) % 2:  # every other call never returns in time
        time.sleep({guard})
    return 1.0


def fine(prompt, response, **row):
    return float(len(response) % 2 == 0)
"""


def test_a_run_goes_on_past_a_reward_that_sleeps(tmp_path, train_cfg):
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "slow_rewards_37.py").write_text(REWARDS_PY.replace("{guard}", str(HANG_GUARD_S)))
    (folder / "p.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Say {w}."}) + "\n" for w in "abcd")
    )
    module_file = folder / "slow_rewards_37.py"
    cfg = train_cfg(
        "task=custom",
        f"task.data.path={folder / 'p.jsonl'}",
        f"task.rewards=[{module_file}:sometimes_sleeps,{module_file}:fine]",
        "task.reward_timeout_s=0.3",
        "method=gdpo",
    )
    start = time.monotonic()
    try:
        trainer, module, dm = build(cfg)
        trainer.fit(module, datamodule=dm)
    finally:
        sys.modules.pop("slow_rewards_37", None)
    assert time.monotonic() - start < HANG_GUARD_S
    assert module.iteration == 2
    with open(metrics_csv(trainer)) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/scoring_errors")]
    per_step = cfg.rl.prompts_per_step * cfg.rl.group_size
    errors = [float(r["train/scoring_errors"]) for r in rows]
    assert errors == [per_step / 2, per_step / 2]  # the calls that slept, and no others
    assert all(r["train/reward/fine/mean"] not in ("", "nan") for r in rows)


# ---- case 9: a budget the timer cannot take ---------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "1e12", "0", "-1", "nan", "abc"])
def test_a_checker_budget_the_timer_cannot_take_is_refused_before_the_model(
    train_cfg, monkeypatch, value
):
    from mrtpo.core import models

    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("model loaded"))
    cfg = train_cfg("task=ifeval", f"task.checker_timeout_s={value}", "data.val_prompts=0")
    with pytest.raises(Exception) as err:
        prepare(cfg)
    msg = str(err.value)
    assert "task.checker_timeout_s=" in msg and "is not allowed" in msg
    assert "(0, 86400]" in msg and "null for no time budget" in msg


@pytest.mark.parametrize("value", [float("inf"), 1e12, 0, float("nan")])
def test_a_reward_budget_the_timer_cannot_take_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match=r"task\.reward_timeout_s=.* is not allowed.*86400"):
        _task(tmp_path, [ok], reward_timeout_s=value)


def test_cli_refuses_checker_timeout_inf_in_one_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "src/train.py",
            "task=ifeval",
            "task.checker_timeout_s=inf",
            "trainer.max_steps=1",
            f"paths.log_dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-2000:]
    assert "task.checker_timeout_s=inf is not allowed: seconds per call in (0, 86400]" in text
    assert "Traceback" not in text
    assert not list(Path(tmp_path).rglob("metrics.csv"))  # nothing trained
