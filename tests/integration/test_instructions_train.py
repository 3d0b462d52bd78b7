"""Instruction following end to end on the tiny model: MRTPO replays per-constraint contexts."""

from __future__ import annotations

import csv
import math

import pytest

from mrtpo.lightning.pipeline import build, metrics_csv


@pytest.mark.slow  # about 25 s on 2 CPU cores, plus the session's tiny-model build
def test_two_mrtpo_steps_on_generated_constraints_with_ifeval_validation(train_cfg, shared_data):
    cfg = train_cfg(
        "task=ifeval",
        "method=mrtpo",
        "task.generator.num_prompts=16",
        "rl.group_size=4",
        "data.val_prompts=2",
        "data.val_batch_size=2",
        "trainer.val_check_interval=2",
    )
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert module.iteration == 2
    with open(metrics_csv(trainer)) as f:
        rows = list(csv.DictReader(f))
    cols = set().union(*(r.keys() for r in rows))
    assert "train/reward/c0/mean" in cols and "train/replay/share" in cols
    # every generated prompt has 5+ constraints: the first five slots are always scored
    for r in rows:
        for k in range(5):
            v = r.get(f"train/reward/c{k}/mean")
            if v:
                assert 0.0 <= float(v) <= 1.0 and not math.isnan(float(v))
    assert any(c.startswith("val/") for c in cols), sorted(cols)
    # the all-constraints rate is train/success (the console's and report's headline)
    success = [float(r["train/success"]) for r in rows if r.get("train/success")]
    assert success and all(0.0 <= v <= 1.0 for v in success)
