"""Starts from a checkpoint that would train no step say so, before anything loads (issue 29
item 6): ``+resume`` of a finished run used to exit saying nothing, and ``ckpt_path=`` with
``trainer.max_steps`` at or below the checkpoint's step trained 0 steps and recorded the run
as completed."""

from __future__ import annotations

import csv
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT, compose_config

from mrtpo.lightning.pipeline import train
from mrtpo.run.resume import NothingToTrain, ResumeRefused
from mrtpo.run.settings import ConfigError

#: The run's settings (a resume repeats them); two steps, one checkpoint (last.ckpt) at the end.
RUN = [
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rollout.sampling.max_new_tokens=8",
    "callbacks.progress=null",
    "callbacks.sample_table=null",
    "callbacks.relevance_dump=null",
    "callbacks.export=null",
    "task.num_constraints=3",
]


def _train_cli(logs: Path, cache_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "src/train.py", *RUN, f"paths.log_dir={logs}",
         f"paths.cache_dir={cache_dir}", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def tree_hash(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir) -> tuple[Path, Path]:
    """(logs folder, run folder) of a 2-step run of src/train.py that reached its limit."""
    logs = tmp_path_factory.mktemp("noops") / "logs"
    res = _train_cli(logs, cache_dir, "trainer.max_steps=2")
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (logs / "train" / "runs").iterdir()
    assert (run / "checkpoints" / "last.ckpt").is_file()
    return logs, run


def test_resuming_a_finished_run_says_so_and_changes_nothing(finished, cache_dir, tmp_path):
    logs, run = finished
    before = tree_hash(run)
    res = _train_cli(logs, cache_dir, f"+resume={run}", "trainer.max_steps=2")
    assert res.returncode == 0, res.stderr[-3000:]
    # (log lines, such as the thread count's, come first: "[time][logger][level] - ...")
    said = [x for x in res.stdout.strip().splitlines() if not x.startswith("[")]
    assert said[0] == (
        f"run {run} already finished: last.ckpt is at step 2 of trainer.max_steps=2, so there "
        "is nothing to train."
    ), res.stdout
    assert len(said) == 2 and said[1].startswith("To train it longer: python src/train.py ")
    assert "rl: task=" not in res.stdout  # nothing was built: no run header
    assert tree_hash(run) == before  # job.json, history, log: all as they were
    assert not (logs / "train" / "resume-logs").exists()  # no empty pending log left behind
    # the printed command, with a larger limit, is a resume that is accepted and trains on
    # (here on a copy of the run, which the other tests need at step 2)
    command = said[1].removeprefix("To train it longer: ").split("   (")[0]
    words = shlex.split(command.replace("trainer.max_steps=M", "trainer.max_steps=3"))
    assert words[:2] == ["python", "src/train.py"] and f"+resume={run}" in words
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    words = [f"+resume={copy}" if w == f"+resume={run}" else w for w in words[2:]]
    train(compose_config("train.yaml", [*words, f"paths.output_dir={copy}"]))
    with open(copy / "csv" / "metrics.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2"]


def test_a_resume_below_the_checkpoints_step_is_refused(finished, train_cfg):
    _, run = finished
    before = tree_hash(run)
    cfg = train_cfg(*RUN, f"+resume={run}", f"paths.output_dir={run}", "trainer.max_steps=1")
    with pytest.raises(
        ResumeRefused, match=r"trainer\.max_steps=1 is below step \d of .*last\.ckpt"
    ):
        train(cfg)
    assert tree_hash(run) == before


def test_a_finished_resume_with_other_settings_is_refused_not_called_finished(finished, train_cfg):
    _, run = finished
    cfg = train_cfg(*RUN, f"+resume={run}", f"paths.output_dir={run}", "trainer.max_steps=2")
    with pytest.raises(NothingToTrain):  # the in-process form of the message above
        train(cfg)
    cfg = train_cfg(
        *RUN, f"+resume={run}", f"paths.output_dir={run}", "trainer.max_steps=2", "seed=1"
    )
    with pytest.raises(ResumeRefused, match=r"seed: 0 -> 1"):
        train(cfg)


def test_a_run_from_a_checkpoint_with_no_steps_left_is_refused_before_the_model_loads(
    finished, train_cfg, tmp_path
):
    _, run = finished
    ckpt = run / "checkpoints" / "last.ckpt"
    (tmp_path / "empty").mkdir()
    # the model folder holds no model: had the model loaded first, that would be the error
    cfg = train_cfg(
        *RUN,
        f"ckpt_path={ckpt}",
        "trainer.max_steps=2",
        f"model.name_or_path={tmp_path / 'empty'}",
        f"paths.output_dir={tmp_path / 'new'}",
    )
    with pytest.raises(ConfigError) as info:
        train(cfg)
    msg = str(info.value)
    assert msg.startswith(f"trainer.max_steps=2 is not above step 2 of ckpt_path={ckpt}"), msg
    assert "trainer.max_steps=4: 2 more steps" in msg and "\n" not in msg
    assert not (tmp_path / "new" / "csv").exists()  # nothing trained, nothing recorded
