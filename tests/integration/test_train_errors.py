"""src/train.py's errors for a model that cannot load: the message alone (``error: ...``, exit
status 2, the traceback in the run's log), as src/eval.py's (issue 29 item 8); in a sweep,
each such job is recorded as failed and the others run. And its --help says what each group
chooses (item 9)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT


def _train(tmp_path, *overrides, flags=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "src/train.py", *flags, f"paths.log_dir={tmp_path / 'logs'}",
         f"paths.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=1", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.fixture
def not_models(tmp_path):
    """An empty folder, and one whose config.json is not JSON."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "qwen2", "hidden_size": ')
    return tmp_path / "empty", tmp_path / "broken"


@pytest.mark.parametrize(
    ("which", "reason"),
    [(0, "holds no model"), (1, "config.json' is not a valid JSON file")],
    ids=["empty", "broken-config"],
)
def test_a_model_that_cannot_load_is_one_line(tmp_path, not_models, which, reason):
    folder = not_models[which]
    res = _train(tmp_path, f"model.name_or_path={folder}")
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert "Traceback" not in res.stderr and len(lines) == 2, res.stderr[-3000:]
    assert lines[0].startswith(f"error: model.name_or_path={folder}: cannot load the model (")
    assert reason in lines[0], lines[0]
    log = lines[1].removeprefix("(the traceback is in ").removesuffix(")")
    assert "Traceback" in Path(log).read_text()  # kept for whoever needs it, in the run's log


def test_in_a_sweep_each_failing_job_is_recorded_and_the_others_run(tmp_path, not_models):
    empty, broken = not_models
    res = _train(tmp_path, f"model.name_or_path={empty},{broken}", flags=["-m"])
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    for folder in (empty, broken):  # each job said why, at once
        assert f"error: model.name_or_path={folder}: cannot load the model" in res.stderr
    jobs = sorted((tmp_path / "logs" / "train" / "multiruns").rglob("job.json"))
    assert [json.loads(j.read_text())["status"] for j in jobs] == ["failed", "failed"]


def test_help_says_what_each_group_chooses():
    res = subprocess.run([sys.executable, "src/train.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "method: cort, gdpo" in out
    assert "how the rewards become one update: MRTPO and its ablations" in out
    assert "where it runs (cpu, gpu, ddp, fsdp)" in out
    assert "+resume=<run folder>" in out and "ckpt_path=<file.ckpt>" in out
    assert "schema:" not in out  # the typed sections are not groups a user chooses
