"""A global batch (``rl.global_prompts_per_step``, ``rl.global_mini_batch_size``) is divided
over the ranks when the run starts: here 2 gloo processes on the CPU (``trainer=ddp``), each of
which must sample half of the prompts a one-process run with the same global batch samples.
The arithmetic alone (refusals, agreement with a per-rank key) is tested in test_presets.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hydra.utils import instantiate
from tests.conftest import ROOT
from tests.integration.test_ddp import _env

from mrtpo.lightning.data import PromptStream
from mrtpo.run.settings import ConfigError, RLConfig


def test_per_rank_share_of_a_global_batch():
    rl = RLConfig(global_prompts_per_step=64, global_mini_batch_size=256, group_size=8)
    one, eight = rl.per_rank(1), rl.per_rank(8)
    assert (one.prompts_per_step, one.mini_batch_size) == (64, 256)
    assert (eight.prompts_per_step, eight.mini_batch_size) == (8, 32)
    assert eight.global_prompts_per_step is None and eight.global_mini_batch_size is None
    # a per-rank config is left as it is on any number of ranks (the old meaning)
    assert RLConfig(prompts_per_step=8).per_rank(4).prompts_per_step == 8
    assert RLConfig().per_rank(2).prompts_per_step == 4  # the default: 4 per rank
    with pytest.raises(ConfigError, match=r"rl.global_mini_batch_size=256 does not divide over 3"):
        RLConfig(global_mini_batch_size=256).per_rank(3)
    with pytest.raises(ConfigError, match=r"rl.global_prompts_per_step=0 is not allowed"):
        RLConfig(global_prompts_per_step=0)


@pytest.mark.slow
def test_two_ranks_each_sample_half_of_the_global_batch(tmp_path, cache_dir, train_cfg):
    steps, total, g = 2, 4, 2
    res = subprocess.run(
        [
            sys.executable,
            "src/train.py",
            "trainer=ddp",  # 2 processes; gloo on the CPU
            "task=synthetic",
            "method=gdpo",
            f"trainer.max_steps={steps}",
            f"rl.global_prompts_per_step={total}",
            "rl.global_mini_batch_size=4",  # 2 per rank: two updates per step on each
            f"rl.group_size={g}",
            "rollout.sampling.max_new_tokens=4",
            "callbacks.progress=null",
            "callbacks.model_checkpoint=null",
            "+callbacks.batch_dump._target_=mrtpo.lightning.callbacks.debug.BatchDump",
            f"paths.log_dir={tmp_path}/logs",
            f"paths.cache_dir={cache_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    (run,) = sorted((tmp_path / "logs").glob("train/runs/*"))
    logs = "".join(p.read_text() for p in run.glob("train*.log"))
    assert "rl.global_prompts_per_step=4 over 2 rank(s): 2 per rank" in logs
    assert "rl.global_mini_batch_size=4 over 2 rank(s): 2 per rank" in logs
    # together the two ranks read what one process with the whole batch reads
    task = instantiate(train_cfg("task=synthetic").task)
    one_process = PromptStream(task.examples("train"), total, seed=0)
    for step in range(steps):
        records = [
            torch.load(run / "debug" / f"step{step:06d}_rank{r}.pt", weights_only=False)
            for r in (0, 1)
        ]
        assert [r["world_size"] for r in records] == [2, 2]
        assert [r["rewards"].shape[0] for r in records] == [total // 2 * g] * 2
        ids = [i for r in records for i in r["ids"][::g]]
        assert ids == [e.id for e in one_process.batch_at(step).examples]
