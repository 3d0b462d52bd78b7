"""CPU threads set for the user (issue 41, item 2): ``threads=auto`` gives the tiny model one
torch thread on the CPU trainer unless OMP_NUM_THREADS says otherwise, ``threads=N`` sets N,
a bad value is one line, and the real CLI states its choice without OMP_NUM_THREADS set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tests.conftest import ROOT

from mrtpo.run.placement import choose_threads as choose
from mrtpo.run.placement import configure_threads as configure
from mrtpo.run.settings import ConfigError


@pytest.fixture
def no_omp(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_auto_is_one_thread_for_the_tiny_model_on_cpu(train_cfg, no_omp):
    n, why = choose(train_cfg())
    assert n == 1 and "~0.2M parameters on the CPU" in why
    torch.set_num_threads(2)
    assert configure(train_cfg()) == 1 == torch.get_num_threads()
    assert os.environ["OMP_NUM_THREADS"] == "1"  # processes the run starts inherit it


def test_auto_follows_omp_num_threads_and_a_number_wins(train_cfg, no_omp, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose(train_cfg()) == (3, "threads=auto: OMP_NUM_THREADS is set")
    assert choose(train_cfg("threads=2"))[0] == 2
    assert choose(train_cfg("threads=null"))[0] is None


def test_larger_models_and_gpus_keep_torchs_choice(train_cfg, no_omp):
    big = train_cfg("model.tiny.hidden_size=2048", "model.tiny.num_hidden_layers=8")
    assert choose(big)[0] is None
    assert choose(train_cfg("trainer=gpu"))[0] is None


@pytest.mark.parametrize("value", ["0", "-1", "many", "1.5", "true"])
def test_a_bad_value_names_the_key(train_cfg, value):
    with pytest.raises(ConfigError, match=r"threads=.* is not allowed: auto, null"):
        choose(train_cfg(f"threads={value}"))


def test_the_readme_command_states_one_thread_without_omp_num_threads(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    res = subprocess.run(
        [sys.executable, "src/train.py", f"paths.log_dir={tmp_path / 'logs'}",
         f"paths.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=1"],
        cwd=ROOT, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "CPU threads: 1 (threads=auto: a model of ~0.2M parameters on the CPU" in out, out
