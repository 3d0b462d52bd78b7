"""src/eval.py: generation mode on the tiny model, responses mode, and training validation."""

from __future__ import annotations

import json

import pytest
from tests.conftest import SHARED_DATA, compose_config

from mrtpo.evaluate.job import run
from mrtpo.lightning.pipeline import build


def _eval_cfg(tmp_path, cache_dir, *overrides):
    return compose_config(
        "eval.yaml",
        [
            f"paths.output_dir={tmp_path}",
            f"paths.cache_dir={cache_dir}",
            f"paths.data_dir={SHARED_DATA}",
            *overrides,
        ],
    )


def test_generate_and_score_synthetic(tmp_path, cache_dir):
    cfg = _eval_cfg(
        tmp_path,
        cache_dir,
        "eval.limit=6",
        "eval.n_samples=2",
        "rollout.sampling.max_new_tokens=6",
        f"eval.output={tmp_path}/out",
    )
    metrics = run(cfg)
    assert metrics["n_responses"] == 12
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 12 and {r["sample"] for r in rows} == {0, 1}
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["n_responses"] == 12 and 0.0 <= saved["success"] <= 1.0


def test_responses_mode_scores_given_text(tmp_path, cache_dir):
    from hydra.utils import instantiate

    cfg = _eval_cfg(tmp_path, cache_dir, "eval.split=val", f"eval.output={tmp_path}/out")
    task = instantiate(cfg.task)
    ex = task.examples("val")[:2]
    good = ex[0].reference  # the reference satisfies every constraint
    lines = [{"id": ex[0].id, "response": good}, {"id": ex[1].id, "response": ""}]
    path = tmp_path / "preds.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    metrics = run(
        _eval_cfg(tmp_path, cache_dir, f"eval.responses={path}", f"eval.output={tmp_path}/out")
    )
    assert metrics["success"] == 0.5
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    ]
    assert rows[0]["check/success"] is True and rows[1]["check/success"] is False
    assert rows[1]["reasons"]  # each failed reward says why


def test_unknown_id_is_a_clear_error(tmp_path, cache_dir):
    path = tmp_path / "preds.jsonl"
    path.write_text(json.dumps({"id": "nope", "response": "x"}) + "\n")
    with pytest.raises(ValueError, match="id 'nope' is not an example of this split"):
        run(_eval_cfg(tmp_path, cache_dir, f"eval.responses={path}"))


def test_training_validation_logs_task_metrics(train_cfg):
    cfg = train_cfg(
        "method=gdpo", "data.val_prompts=4", "data.val_batch_size=2", "trainer.val_check_interval=2"
    )
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert "val/synthetic/success" in trainer.callback_metrics
    assert "val/synthetic/n_responses" in trainer.callback_metrics
    assert float(trainer.callback_metrics["val/synthetic/n_responses"]) == 4.0
