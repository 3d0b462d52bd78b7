"""``mrtpo.api`` (issue 41, item 4): training, evaluation and export from Python run the
command line's jobs on the tiny model: the same run folder and records, the final metrics,
errors raised as themselves, and the caller's logging left as it was."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from tests.conftest import SHARED_DATA

from mrtpo import api
from mrtpo.run.settings import ConfigError


@pytest.fixture
def paths(tmp_path, cache_dir):
    return [
        f"paths.log_dir={tmp_path}/logs",
        f"paths.cache_dir={cache_dir}",
        f"paths.data_dir={SHARED_DATA}",
    ]


SMALL = ["trainer.max_steps=2", "rl.prompts_per_step=2", "rl.group_size=2",
         "rollout.sampling.max_new_tokens=8", "callbacks.model_checkpoint.every_n_train_steps=1"]  # fmt: skip


def test_train_evaluate_export_from_python(paths, tmp_path):
    handlers = list(logging.getLogger().handlers)
    threads = torch.get_num_threads()
    run = api.train([*paths, *SMALL, "method=gdpo", "threads=2"])
    assert logging.getLogger().handlers == handlers  # the job's log file is not left attached
    assert torch.get_num_threads() == threads  # nor its CPU threads

    assert run.run_dir.parent == tmp_path / "logs" / "train" / "runs"
    assert run.run_dir.name.endswith("_synthetic-gdpo")
    assert (run.run_dir / ".hydra" / "config.yaml").is_file()  # as src/train.py leaves it
    assert (run.run_dir / "train.log").is_file()
    job = json.loads((run.run_dir / "job.json").read_text())
    assert job["status"] == "completed"
    assert "method=gdpo" in json.dumps(job)
    assert 0.0 <= run.metrics["train/reward/total/mean"] <= 4.0
    steps = [r["step"] for r in run.history() if "train/reward/total/mean" in r]
    assert len(steps) == 2
    assert run.history()[-1]["train/reward/total/mean"] == pytest.approx(
        run.metrics["train/reward/total/mean"], rel=1e-5
    )
    assert run.checkpoint is not None and run.policy is not None

    out = tmp_path / "eval"
    ev = api.evaluate([*paths, f"ckpt_path={run.checkpoint}", "eval.limit=2",
                       f"eval.output={out}", "rollout.sampling.max_new_tokens=8"])  # fmt: skip
    assert ev.run_dir == out and (out / "metrics.json").is_file()
    saved = json.loads((out / "metrics.json").read_text())
    numbers = {k: v for k, v in ev.metrics.items() if isinstance(v, float)}
    assert numbers and all(saved[k] == pytest.approx(v) for k, v in numbers.items())

    folder = api.export([*paths, f"ckpt_path={run.checkpoint}", f"out={tmp_path / 'exported'}"])
    assert folder == tmp_path / "exported" and (folder / "config.json").is_file()


def test_errors_are_raised_as_themselves(paths):
    with pytest.raises(ConfigError, match=r"rl\.group_size=0"):
        api.train([*paths, "rl.group_size=0"])
    with pytest.raises(TypeError, match="a list of strings"):
        api.train("method=gdpo")
    with pytest.raises(ValueError, match="for a sweep, call it once per setting"):
        api.train(["-m", "seed=1,2"])
