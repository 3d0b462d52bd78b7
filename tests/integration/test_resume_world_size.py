"""A resume on another number of processes keeps the run's global batch, or is refused
(issue 37 case 7).

A 1-process run resumed with ``trainer=ddp trainer.devices=2`` used to be accepted: each rank
sampled the per-rank batch, so the global batch doubled (16 -> 32 responses) and the numbers
left the run's. Each checkpoint's settings record now holds the world size and the global
batch it makes (``mrtpo.run.resume.global_batch``); a resume whose world size makes another
global batch is refused, naming the world size the run was trained with and the
``rl.global_*`` keys that keep its batch, and a resume that states them trains on.
"""

from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import ROOT, compose_config
from tests.integration.test_ddp import _env

from mrtpo.run.resume import ResumeRefused, check_resume_settings, settings_record

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

#: What keeps the 1-process run's batch (2 prompts, 4 responses per update) over 2 ranks.
KEEP = [
    "rl.prompts_per_step=null",
    "rl.global_prompts_per_step=2",
    "rl.global_mini_batch_size=4",
]


def _train_cli(logs: Path, cache_dir: Path, *extra: str, run=RUN):
    return subprocess.run(
        [sys.executable, "src/train.py", *run, f"paths.log_dir={logs}",
         f"paths.cache_dir={cache_dir}", *extra],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def tree_hash(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache_dir) -> tuple[Path, Path]:
    """(logs, run) of a 2-step run on one process, its last checkpoint at step 2."""
    logs = tmp_path_factory.mktemp("world") / "logs"
    res = _train_cli(logs, cache_dir, "trainer.max_steps=2")
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (logs / "train" / "runs").iterdir()
    return logs, run


def test_the_checkpoint_records_the_world_size_and_global_batch(one_process):
    _, run = one_process
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    record = json.loads(ckpt["mrtpo_settings"])
    # 2 prompts x 2 samples; rl.mini_batch_size 16 per rank counts as the 4 responses there are
    assert record["batch"] == {"world_size": 1, "prompts_per_step": 2, "mini_batch_size": 4}


def test_a_resume_on_two_processes_that_would_double_the_batch_is_refused(one_process, cache_dir):
    logs, run = one_process
    before = tree_hash(run)
    res = _train_cli(logs, cache_dir, f"+resume={run}", "trainer=ddp", "trainer.max_steps=3")
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    msg = lines[0]
    assert "trained on 1 process" in msg and "this resume runs on 2" in msg, msg
    assert "4 prompts per step and 8 responses per optimizer step" in msg, msg
    assert " ".join(KEEP[1:]) in msg and "rl.prompts_per_step=null" in msg, msg
    assert tree_hash(run) == before  # refused before anything was written


def test_a_resume_that_keeps_the_global_batch_is_compared_by_what_it_makes(one_process):
    """The batch keys may change form (per rank -> global) where they make the run's global
    batch; on the run's world size another batch is refused naming the key, as before."""
    _, run = one_process
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    two = compose_config("train.yaml", [*RUN, "trainer=ddp", *KEEP])
    check_resume_settings(ckpt, settings_record(two), "last.ckpt")  # accepted
    # an old record (no "batch"): the world size and batch are worked out from its settings
    old = dict(ckpt, mrtpo_settings=json.dumps({"version": 1, **_settings_only(ckpt)}))
    check_resume_settings(old, settings_record(two), "last.ckpt")
    with pytest.raises(ResumeRefused, match="trained on 1 process"):
        check_resume_settings(
            old, settings_record(compose_config("train.yaml", [*RUN, "trainer=ddp"])), "x"
        )
    # on the run's own world size: another form of the same batch is the same run ...
    check_resume_settings(ckpt, settings_record(compose_config("train.yaml", [*RUN, *KEEP])), "x")
    # ... and another batch is refused key by key, as any changed setting
    three = compose_config("train.yaml", [*RUN, "rl.prompts_per_step=3"])
    with pytest.raises(ResumeRefused, match=r"rl.prompts_per_step: 2 -> 3"):
        check_resume_settings(ckpt, settings_record(three), "last.ckpt")


def _settings_only(ckpt) -> dict:
    return {"settings": json.loads(ckpt["mrtpo_settings"])["settings"]}


@pytest.mark.slow
def test_a_resume_that_states_the_global_batch_trains_on_two_processes(one_process, cache_dir):
    logs, run = one_process
    res = _train_cli(
        logs,
        cache_dir,
        f"+resume={run}",
        "trainer=ddp",
        "trainer.max_steps=3",
        *KEEP,
        "+callbacks.batch_dump._target_=mrtpo.lightning.callbacks.debug.BatchDump",
    )
    assert res.returncode == 0, res.stderr[-4000:]
    text = "".join(p.read_text() for p in run.glob("train*.log"))
    assert "rl.global_prompts_per_step=2 over 2 rank(s): 1 per rank" in text
    dumps = [torch.load(run / "debug" / f"step000002_rank{r}.pt") for r in (0, 1)]
    assert [d["rewards"].shape[0] for d in dumps] == [2, 2]  # 1 prompt x 2 samples per rank
    with open(run / "csv" / "metrics.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2"]
