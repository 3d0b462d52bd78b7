"""A custom task's reward module is found in the folder the command was started in, or given
as a file; a module found nowhere is named with the settings that fix it (issue 29 item 9)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT

from mrtpo.tasks.custom import CustomTask

REWARDS = "def correct(prompt, response, answer, **row):\n    return float(answer in response)\n"
OTHERS = "def short(prompt, response, **row):\n    return float(len(response) <= 8)\n"
ROWS = [{"prompt": "Say red.", "answer": "red"}, {"prompt": "Say blue.", "answer": "blue"}]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A user's folder (the launch folder) with a reward module, another one in a subfolder,
    and prompts; the imports it adds are undone afterwards."""
    work = tmp_path / "work"
    (work / "lib").mkdir(parents=True)
    (work / "mrtpo_launch_rewards.py").write_text(REWARDS)
    (work / "lib" / "mrtpo_file_rewards.py").write_text(OTHERS)
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("mrtpo_launch_rewards", "mrtpo_file_rewards"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return work


def test_module_in_the_launch_folder_and_a_file_path(folder, monkeypatch):
    monkeypatch.chdir(folder)
    task = CustomTask(
        data={"path": "prompts.jsonl"},
        rewards=["mrtpo_launch_rewards.correct", "lib/mrtpo_file_rewards.py:short"],
    )
    assert task.reward_names == ("correct", "short")
    assert task.score(task.examples("train")[0], "red").rewards == {"correct": 1.0, "short": 1.0}


def test_a_module_found_nowhere_names_the_settings(folder, monkeypatch, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    data = {"path": str(folder / "prompts.jsonl")}
    with pytest.raises(ImportError) as err:
        CustomTask(data=data, rewards=["mrtpo_launch_rewards.correct"])
    msg = str(err.value)
    assert "task.rewards[0]='mrtpo_launch_rewards.correct'" in msg
    launch = f"in the folder the command was started in ({elsewhere})"
    assert f"no module 'mrtpo_launch_rewards' {launch}" in msg
    assert "task.import_dirs=[<folder>]" in msg
    assert "task.rewards[0]=path/to/mrtpo_launch_rewards.py:<function>" in msg
    with pytest.raises(ImportError, match=r"task\.rewards\[0\].*no such file"):
        CustomTask(data=data, rewards=["lib/mrtpo_file_rewards.py:short"])
    with pytest.raises(ValueError, match=r"name the function after the file"):
        CustomTask(data=data, rewards=[f"{folder}/lib/mrtpo_file_rewards.py:"])
    # task.import_dirs still works
    task = CustomTask(data=data, rewards=["mrtpo_launch_rewards.correct"], import_dirs=[folder])
    assert task.reward_names == ("correct",)


@pytest.mark.slow  # a full `python src/train.py` (about a minute here)
def test_train_py_started_in_the_folder_of_the_module(folder, cache_dir):
    """No PYTHONPATH: the module sits in the folder the command is started in."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = [
        "task=custom",
        "task.data.path=prompts.jsonl",
        "task.rewards=[mrtpo_launch_rewards.correct,lib/mrtpo_file_rewards.py:short]",
        "method=gdpo",
        f"paths.cache_dir={cache_dir}",
        f"paths.log_dir={folder / 'logs'}",
        "trainer.max_steps=1",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rollout.sampling.max_new_tokens=4",
        "callbacks.progress=null",
    ]
    out = subprocess.run(
        [sys.executable, str(ROOT / "src" / "train.py"), *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    (metrics,) = Path(folder / "logs").rglob("metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    assert {"train/reward/correct/mean", "train/reward/short/mean"} <= set(rows[0])
