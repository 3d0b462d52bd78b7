"""Run folders and paths (issue 40 item 6): a refused run writes nothing (20 of 38 refused
runs in one hour of trying had left a run folder, none with job.json), ``run.lock`` does not
stay behind after a run ends, and the default paths resolve against the project, not the
folder a command is launched from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.conftest import ROOT, compose_config

from mrtpo.run.folder import LOCK_NAME, RunFolderLock

TRAIN = str(ROOT / "src" / "train.py")


def _train(args, cwd, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("MRTPO_DATA_DIR", None)
    return subprocess.run([sys.executable, TRAIN, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_a_refused_run_leaves_no_folder_and_no_parents(tmp_path):
    logs = tmp_path / "deep" / "logs"
    res = _train([f"paths.log_dir={logs}", "trainer.max_steps=0"], tmp_path)
    assert res.returncode == 2 and "trainer.max_steps=0 is not allowed" in res.stderr
    assert not (tmp_path / "deep").exists()  # the run folder and the folders made for it
    assert "(the traceback is in" not in res.stderr  # it pointed at the removed log


def test_a_refused_run_leaves_a_folder_it_was_given_as_it_found_it(tmp_path):
    """``hydra.run.dir=<folder>`` (issue 47 item 5): a folder the refused run made goes with
    the folders made above it; an empty folder the user made stays, empty again."""
    chosen = tmp_path / "new" / "mine"
    res = _train([f"hydra.run.dir={chosen}", "trainer.max_steps=0"], tmp_path)
    assert res.returncode == 2
    assert not (tmp_path / "new").exists()
    chosen.mkdir(parents=True)
    res = _train([f"hydra.run.dir={chosen}", "trainer.max_steps=0"], tmp_path)
    assert res.returncode == 2
    assert chosen.is_dir() and not any(chosen.iterdir())


def test_a_run_that_ends_leaves_no_run_lock_and_its_folder(tmp_path, cache_dir):
    logs = tmp_path / "logs"
    res = _train([f"paths.log_dir={logs}", f"paths.cache_dir={cache_dir}", "trainer.max_steps=1",
                  "rl.prompts_per_step=2", "rl.group_size=2", "rollout.sampling.max_new_tokens=4",
                  "callbacks.progress=null"], tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (logs / "train" / "runs").iterdir()
    assert not (run / LOCK_NAME).exists()
    assert json.loads((run / "job.json").read_text())["status"] == "completed"


def test_run_lock_goes_when_the_block_ends_and_a_refusal_restores_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with RunFolderLock(run) as lock:
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.accept()
    assert not (run / LOCK_NAME).exists()  # ended: no holder to name
    with pytest.raises(RuntimeError), RunFolderLock(run) as lock:
        lock.accept()
        raise RuntimeError("the run failed after it started")
    assert not (run / LOCK_NAME).exists()
    (run / LOCK_NAME).write_bytes(b"an earlier record\n")
    with pytest.raises(KeyError), RunFolderLock(run):
        raise KeyError("refused before it started")
    assert (run / LOCK_NAME).read_bytes() == b"an earlier record\n"  # changed nothing


def test_default_paths_are_the_projects_wherever_the_command_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MRTPO_ROOT", raising=False)
    monkeypatch.delenv("MRTPO_DATA_DIR", raising=False)
    monkeypatch.delenv("MRTPO_CACHE_DIR", raising=False)
    paths = compose_config("train.yaml", []).paths
    assert paths.root_dir == str(ROOT)
    assert paths.log_dir == f"{ROOT}/logs" and paths.cache_dir == f"{ROOT}/.cache"
    assert paths.data_dir == f"{ROOT}/../shared/data"
    monkeypatch.setenv("MRTPO_ROOT", str(tmp_path))  # still movable
    assert compose_config("train.yaml", []).paths.log_dir == f"{tmp_path}/logs"


def test_only_refusals_lose_their_folder(tmp_path):
    """A refusal (a value that cannot work, a missing file) says everything in its one line;
    after another error (a model that cannot load) the folder keeps the log holding the
    traceback the error line points at (tests/integration/test_train_errors.py)."""
    from hydra.errors import InstantiationException

    from mrtpo.run.folder import is_refusal
    from mrtpo.run.settings import ConfigError

    assert is_refusal(ConfigError("trainer.max_steps=0 is not allowed"))
    assert is_refusal(FileNotFoundError("no such file"))
    wrapped = InstantiationException("Error in call to target")
    wrapped.__cause__ = FileNotFoundError("task.data.path=x: no such file")
    assert is_refusal(wrapped)
    assert not is_refusal(ValueError("model.name_or_path=x: cannot load the model"))
    empty = tmp_path / "empty"
    empty.mkdir()
    logs = tmp_path / "logs"
    res = _train([f"paths.log_dir={logs}", f"model.name_or_path={empty}"], tmp_path)
    assert res.returncode == 2 and "cannot load the model" in res.stderr
    (run,) = (logs / "train" / "runs").iterdir()
    assert "Traceback" in (run / "train.log").read_text()
