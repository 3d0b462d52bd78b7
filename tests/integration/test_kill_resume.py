"""Crash and resume: a killed run continues in its own folder with one metrics row per step.

The slow test kills ``python src/train.py`` with SIGKILL once a checkpoint exists, resumes it
with ``+resume=<run folder>``, and compares the resumed run's per-step metrics with an
uninterrupted run's: the β schedule, the data position and the sampled rewards continue
exactly, and no step is logged twice.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.conftest import ROOT

from mrtpo.core.credit.relevance import beta_schedule
from mrtpo.lightning.pipeline import build, metrics_csv, resume_checkpoint
from mrtpo.rollout.hf import HFEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


class RecordingEngine(HFEngine):
    """The real HF engine, remembering the weights it was synced with."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__(batch_size)
        self.synced: list[dict[str, torch.Tensor]] = []

    def sync_weights(self, model) -> None:
        self.synced.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        super().sync_weights(model)


def _fit(cfg, engine=None):
    trainer, module, dm = build(cfg)
    if engine is not None:  # bound to the policy by the callback's setup
        next(c for c in trainer.callbacks if type(c).__name__ == "RolloutCallback").engine = engine
    trainer.fit(module, datamodule=dm, ckpt_path=resume_checkpoint(cfg))
    return trainer, module


COMMON = (
    "method=mrtpo",
    "method.beta_warmup_steps=3",
    "optim.lr=1e-3",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.sample_table=null",
    "callbacks.relevance_dump=null",
)


def test_engine_is_resynced_with_the_restored_weights(train_cfg, tmp_path):
    out = tmp_path / "run"
    _fit(train_cfg(*COMMON, f"paths.output_dir={out}"))
    ckpt = out / "checkpoints" / "step000002.ckpt"
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    engine = RecordingEngine()
    trainer, module = _fit(
        train_cfg(
            *COMMON, f"paths.output_dir={tmp_path}/b", "trainer.max_steps=3", f"ckpt_path={ckpt}"
        ),
        engine=engine,
    )
    assert module.iteration == 3
    # one sync on train start (restored weights), one after the single step that ran
    assert len(engine.synced) == 2
    first = engine.synced[0]
    for k, v in first.items():
        torch.testing.assert_close(v, saved[f"policy.{k}"], rtol=0, atol=0)
    cb = next(c for c in trainer.callbacks if type(c).__name__ == "RolloutCallback")
    assert cb.resyncs == 1


def test_fresh_run_does_not_resync_at_start(train_cfg):
    engine = RecordingEngine()
    _fit(train_cfg(*COMMON, "trainer.max_steps=1"), engine=engine)
    assert len(engine.synced) == 1  # only the sync after the step


def test_resume_in_the_same_folder_keeps_one_row_per_step(train_cfg, tmp_path):
    run = tmp_path / "run"
    first, _ = _fit(train_cfg(*COMMON, f"paths.output_dir={run}", "trainer.max_steps=3"))
    before = read_rows(metrics_csv(first))
    assert [r["step"] for r in before] == ["0", "1", "2"]
    # As if the process had died after logging step 2 but before its checkpoint: resume
    # from the step-2 checkpoint (taken after steps 0 and 1) in the same folder.
    ckpt = run / "checkpoints" / "step000002.ckpt"
    trainer, module = _fit(
        train_cfg(*COMMON, f"paths.output_dir={run}", "trainer.max_steps=4", f"ckpt_path={ckpt}")
    )
    after = read_rows(metrics_csv(trainer))
    assert [r["step"] for r in after] == ["0", "1", "2", "3"]
    assert after[:2] == before[:2]  # the history before the checkpoint is kept as it was
    # the recomputed step 2 is the same step: same data, same β
    assert after[2]["train/reward/total/mean"] == before[2]["train/reward/total/mean"]
    betas = [float(r["train/beta"]) for r in after]
    assert betas == pytest.approx([beta_schedule(0.5, s, 3) for s in range(4)], abs=1e-6)
    assert module.iteration == 4


def test_resume_argument_errors_name_the_key(train_cfg, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.ckpt").write_text("x")
    with pytest.raises(ValueError, match="resume takes a run folder"):
        resume_checkpoint(train_cfg(f"+resume={tmp_path}/file.ckpt"))
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        resume_checkpoint(train_cfg(f"+resume={tmp_path}/nope"))
    with pytest.raises(FileNotFoundError, match=r"no last\.ckpt"):
        resume_checkpoint(train_cfg(f"+resume={tmp_path}/empty"))


def test_resume_with_another_task_or_method_is_refused(train_cfg, tmp_path):
    run = tmp_path / "run"
    _fit(train_cfg(*COMMON, f"paths.output_dir={run}", "trainer.max_steps=1"))
    cfg = train_cfg(
        "method=gdpo",
        f"paths.output_dir={tmp_path}/b",
        f"ckpt_path={run}/checkpoints/last.ckpt",
    )
    with pytest.raises(ValueError, match=r"method='mrtpo' but this run has method='gdpo'"):
        _fit(cfg)


# ---- the real thing: SIGKILL and +resume ---------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _cmd(log_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "src/train.py",
        *COMMON,
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rollout.sampling.max_new_tokens=8",
        "callbacks.progress=null",
        f"paths.log_dir={log_dir}",
        f"paths.cache_dir={cache_dir}",
        "print_config=false",
        *extra,
    ]


def _saved_step(path: Path) -> int:
    try:
        return int(torch.load(path, weights_only=False, map_location="cpu")["global_step"])
    except Exception:  # not there yet
        return -1


@pytest.mark.slow
def test_sigkill_then_resume_continues_the_run(tmp_path, cache_dir):
    steps = 6
    # An uninterrupted reference run.
    ref = subprocess.run(
        _cmd(tmp_path / "ref", cache_dir, f"trainer.max_steps={steps}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    (ref_csv,) = (tmp_path / "ref").glob("train/runs/*/csv/metrics.csv")
    reference = read_rows(ref_csv)

    # The run to kill: far more steps than it will get to do.
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        _cmd(logs, cache_dir, "trainer.max_steps=1000"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        deadline = time.monotonic() + 900
        target = None
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(logs.glob("train/runs/*/checkpoints/step000003.ckpt"))
            # last.ckpt is written (atomically) just after the step checkpoint: kill once it
            # holds step 3 too, so the resume starts from there
            if found and _saved_step(found[0].parent / "last.ckpt") >= 3:
                target = found[0]
                break
            time.sleep(0.05)
        assert target is not None, "no checkpoint appeared: " + (
            proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "timeout"
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    run = target.parent.parent
    killed_at = int(
        torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    )
    assert 3 <= killed_at < steps

    res = subprocess.run(
        _cmd(logs, cache_dir, f"trainer.max_steps={steps}", f"+resume={run}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in logs.glob("train/runs/*")) == [run.name]  # same folder
    rows = read_rows(run / "csv" / "metrics.csv")
    assert [r["step"] for r in rows] == [str(s) for s in range(steps)]  # each step once
    for got, want in zip(rows, reference, strict=True):
        for key in ("train/beta", "train/reward/total/mean", "train/iteration", "train/loss"):
            assert got[key] == want[key], (got["step"], key)
    assert [float(r["train/beta"]) for r in rows] == pytest.approx(
        [beta_schedule(0.5, s, 3) for s in range(steps)], abs=1e-6
    )
    assert (run / "checkpoints" / f"step{steps:06d}.ckpt").is_file()
    history = (run / ".hydra" / "history.yaml").read_text()
    assert "trainer.max_steps=1000" in history and f"+resume={run}" in history
