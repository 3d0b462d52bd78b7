"""Evaluating a checkpoint: the training run's task comes along, but not its smoke limits."""

from __future__ import annotations

from omegaconf import OmegaConf
from tests.conftest import compose_config

from mrtpo.run.trained_run import from_training_run


def _run_with_limit(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(b"")  # only its place matters here: no weights are loaded
    train = compose_config("train.yaml", ["task=text2sql", "task.max_examples=16"])
    OmegaConf.save(train, run / ".hydra" / "config.yaml", resolve=False)
    return ckpt


def test_smoke_limit_of_the_run_is_dropped_and_said(tmp_path, caplog):
    ckpt = _run_with_limit(tmp_path)
    cfg = compose_config("eval.yaml", [f"ckpt_path={ckpt}"])
    cfg, info = from_training_run(cfg, overrides=[f"ckpt_path={ckpt}"])
    assert cfg.task._target_.endswith("Text2SQLTask") and cfg.task.max_examples is None
    assert info["dropped"] == ["task.max_examples=16"]
    assert "task.max_examples=16 (a training limit) is not applied" in caplog.text


def test_smoke_limit_given_again_is_kept(tmp_path):
    ckpt = _run_with_limit(tmp_path)
    given = [f"ckpt_path={ckpt}", "+task.max_examples=16"]  # synthetic (eval's default) lacks it
    cfg = compose_config("eval.yaml", given)
    cfg, info = from_training_run(cfg, overrides=given)
    assert cfg.task.max_examples == 16 and info["dropped"] == []


def test_eval_folder_is_named_after_the_runs_task(tmp_path):
    ckpt = _run_with_limit(tmp_path)
    (ckpt.parent.parent / "job.json").write_text('{"task": "text2sql"}')
    assert compose_config("eval.yaml", [f"ckpt_path={ckpt}"]).run_name == "eval-text2sql"
    chosen = compose_config("eval.yaml", [f"ckpt_path={ckpt}", "task=ifeval"])
    assert chosen.run_name == "eval-ifeval"
    assert compose_config("eval.yaml", []).run_name == "eval-synthetic"
