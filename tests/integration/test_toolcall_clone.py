"""Tool calling on a user's clone: the real task config on RLLA rows built here
(tests/task_fixtures.py), response files scored through the shared scorer, and a one-step
training run. Nothing here needs ../shared."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from hydra.utils import instantiate
from tests.task_fixtures import make_rlla

from mrtpo.core.evaluation import read_jsonl, score_responses


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return make_rlla(tmp_path_factory.mktemp("rlla_like"))


def test_score_fixture_responses(train_cfg, data_dir, tmp_path):
    task = instantiate(train_cfg("task=toolcall", f"paths.data_dir={data_dir}").task)
    examples = task.examples("val")
    assert len(examples) == 4
    rows = [{"id": e.id, "response": e.reference} for e in examples]
    rows[0] = {"id": examples[0].id, "response": "<think> hmm </think>\n<response> no </response>"}
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = score_responses(task, examples, path, tmp_path / "out")
    # three examples expect calls; the first is answered without one
    assert metrics["exact_match"] == pytest.approx(2 / 3)
    assert metrics["reward/format"] == pytest.approx(3 / 4)
    results = read_jsonl(tmp_path / "out" / "results.jsonl")
    assert results[0]["reward/correctness"] == -3.0 and "correctness" in results[0]["reasons"]
    assert [r["reward/correctness"] for r in results[1:]] == [3.0, 0.0, 3.0]


def test_one_training_step_on_the_fixture(train_cfg, data_dir):
    from mrtpo.lightning.pipeline import build, metrics_csv

    cfg = train_cfg(
        "task=toolcall", "method=mrtpo_saw", f"paths.data_dir={data_dir}", "trainer.max_steps=1"
    )
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 1
    with open(metrics_csv(trainer)) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1
    assert -3.0 <= float(rows[0]["train/reward/correctness/mean"]) <= 3.0
