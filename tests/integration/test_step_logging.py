"""The step's metrics reach Lightning through its public ``log_dict`` (issue 48 item 3), on
the tiny model: one call for the logged metrics and one for the progress bar's, a step. Every
reader sees the step: the rows of ``metrics.csv`` (columns, step numbering,
``trainer.log_every_n_steps``, validation rows), ``trainer.callback_metrics`` (the step line, the
summary table, ``pipeline.train``'s result), the progress bar's metrics.
"""

from __future__ import annotations

import csv
import math

import lightning as L
import pytest
import torch

from mrtpo.core.credit.methods import GDPO, CreditOutput, RewardSet
from mrtpo.lightning.callbacks.console import RunSummary
from mrtpo.lightning.pipeline import build, metrics_csv


class SeenByCallbacks(L.Callback):
    """What a callback reads at the end of each step."""

    def __init__(self) -> None:
        self.callback: list[dict] = []
        self.bar: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.callback.append(dict(trainer.callback_metrics))
        self.bar.append(dict(trainer.progress_bar_metrics))


def _fit(cfg, method=None):
    trainer, module, dm = build(cfg)
    if method is not None:
        method.setup(RewardSet(tuple(module.task.reward_names), False))
        module.method = method
    seen, summary = SeenByCallbacks(), RunSummary(block=1, plot=False)
    trainer.callbacks.extend([seen, summary])
    calls = []
    log_dict = module.log_dict

    def counted_log_dict(dictionary, **k):
        calls.append((dict(dictionary), k))
        return log_dict(dictionary, **k)

    module.log_dict = counted_log_dict
    trainer.fit(module, datamodule=dm)
    with open(metrics_csv(trainer)) as f:
        reader = csv.DictReader(f)
        rows, columns = list(reader), reader.fieldnames
    return trainer, module, rows, columns, seen, summary, calls


def _same(a: str, b: float) -> bool:
    x = float(a)
    return (math.isnan(x) and math.isnan(b)) or x == pytest.approx(b, rel=1e-6, abs=1e-7)


def test_one_call_and_every_reader_sees_the_step(train_cfg):
    trainer, _, rows, columns, seen, summary, calls = _fit(
        train_cfg("method=mrtpo", "trainer.max_steps=3")
    )
    train_calls = [(d, k) for d, k in calls if not any(x.startswith("val/") for x in d)]
    assert len(train_calls) == 2 * 3  # a step: its metrics, then the progress bar's
    logged = [d for d, k in train_calls if k.get("logger", True)]
    assert all(not k.get("sync_dist") for _, k in train_calls)  # the step reduced them already
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert columns[:2] == ["epoch", "step"] and all(r["epoch"] == "0" for r in rows)
    train_cols = [c for c in columns if c.startswith("train/")]
    assert len(train_cols) > 30 and "train/loss" in train_cols
    assert set(train_cols) == set().union(*logged)
    assert "train/reward/total/mean" in train_cols and "train/time/step" in train_cols
    # callbacks saw each step's values, as tensors (what Lightning's self.log left there)
    assert len(seen.callback) == 3
    for row, cb, bar in zip(rows, seen.callback, seen.bar, strict=True):
        for k in (c for c in train_cols if row[c] != ""):  # "": not logged yet at this step
            assert isinstance(cb[k], torch.Tensor), k
            assert _same(row[k], float(cb[k])), (k, row[k], cb[k])
        assert _same(row["train/reward/total/mean"], float(cb["reward"]))
        assert bar["reward"] == pytest.approx(float(row["train/reward/total/mean"]), rel=1e-6)
        assert not any(k.startswith("train/") for k in bar)
    # the summary table has a row per step, read from callback_metrics
    assert summary.steps == [1, 2, 3]
    assert summary.rows[0]["reward/total"] == pytest.approx(
        float(rows[0]["train/reward/total/mean"]), rel=1e-6
    )
    # pipeline.train returns callback_metrics: the last step's are there after fit
    last = trainer.callback_metrics
    assert float(last["train/iteration"]) == 3.0


def test_log_every_n_steps_and_validation_rows(train_cfg):
    _, _, rows, _, _, _, _ = _fit(
        train_cfg(
            "method=gdpo",
            "trainer.max_steps=4",
            "trainer.log_every_n_steps=2",
            "trainer.val_check_interval=2",
            "data.val_prompts=2",
        )
    )
    train = [r["step"] for r in rows if r.get("train/loss")]
    val = [r["step"] for r in rows if any(k.startswith("val/") and r[k] for k in r)]
    # Lightning's rule: a train row where (step + 1) % log_every_n_steps == 0; validation
    # after steps 2 and 4 (step column 1 and 3, the step they ran at)
    assert train == ["1", "3"], train
    assert val == ["1", "3"], val


def test_a_skipped_step_is_logged_through_log_dict_too(train_cfg):
    from tests.integration.test_faults import NaNAdvantages

    _, _, rows, _, seen, _, calls = _fit(
        train_cfg("method=gdpo", "trainer.max_steps=2"), method=NaNAdvantages()
    )
    assert all(k.startswith("train/") for d, kw in calls if kw.get("logger", True) for k in d)
    assert [r["step"] for r in rows] == ["0", "1"]
    assert all(r["train/skipped"] == "1.0" for r in rows)
    assert float(seen.callback[-1]["train/nonfinite_skips"]) == 2.0
    assert "train/loss" not in seen.callback[-1]


class _NaNOnSecondStep(GDPO):
    """GDPO whose second call gives NaN advantages: that step's update is skipped."""

    calls = 0

    def __call__(self, inputs):
        out = super().__call__(inputs)
        self.calls += 1
        return out if self.calls != 2 else CreditOutput(out.advantages * float("nan"), out.stats)


def test_a_key_a_step_did_not_measure_is_nan_not_the_last_steps_value(train_cfg):
    # Lightning writes a logged key's last value on every later row; a skipped update has no
    # loss, and its row must not show the step before's.
    _, _, rows, _, seen, _, _ = _fit(
        train_cfg("method=gdpo", "trainer.max_steps=3"), method=_NaNOnSecondStep()
    )
    # skipped is logged by the skipped step only: blank before it, NaN (not 1.0) after
    assert [r["train/skipped"] for r in rows] == ["", "1.0", "nan"]
    losses = [float(r["train/loss"]) for r in rows]
    assert math.isfinite(losses[0]) and math.isnan(losses[1]) and math.isfinite(losses[2])
    assert math.isnan(float(seen.callback[1]["train/loss"]))
