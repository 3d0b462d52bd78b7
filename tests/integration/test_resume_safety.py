"""Resuming a run folder with real processes: the history is on disk at every instant.

Each test runs ``python src/train.py`` as a user would, on the tiny model, and kills or races
real processes; nothing is mocked.
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

HANG_GUARD_S = 900  # a bound for a machine far slower than this one, not a speed check


def _env(cache_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "MRTPO_CACHE_DIR": str(cache_dir),
    }


def _cmd(logs: Path, cache_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "src" / "train.py"),
        "print_config=false",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rollout.sampling.max_new_tokens=4",
        "callbacks.progress=null",
        "callbacks.sample_table=null",
        "callbacks.relevance_dump=null",
        "callbacks.export=null",
        "callbacks.model_checkpoint.every_n_train_steps=1",
        f"paths.log_dir={logs}",
        f"paths.cache_dir={cache_dir}",
        *extra,
    ]


def _start(logs: Path, cache_dir: Path, *extra: str) -> subprocess.Popen:
    """A background run; its output goes to a file beside ``logs`` (a pipe nobody reads
    would fill up and stop it)."""
    out = open(logs.parent / f"out-{time.monotonic_ns()}.txt", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        _cmd(logs, cache_dir, *extra),
        cwd=ROOT,
        env=_env(cache_dir),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc.output_file = Path(out.name)
    out.close()
    return proc


def _run(logs: Path, cache_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(logs, cache_dir, *extra),
        cwd=ROOT,
        env=_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def _steps(path: Path) -> list[int]:
    with open(path, newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _saved_step(path: Path) -> int:
    try:
        return int(torch.load(path, weights_only=False, map_location="cpu")["global_step"])
    except Exception:  # not there yet, or being replaced
        return -1


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


@pytest.fixture
def finished_run(tmp_path, cache_dir) -> Path:
    """A 3-step run (metrics rows 0-2, last.ckpt at step 3) in tmp_path/logs."""
    logs = tmp_path / "logs"
    res = _run(logs, cache_dir, "trainer.max_steps=3")
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (logs / "train" / "runs").iterdir()
    assert _steps(run / "csv" / "metrics.csv") == [0, 1, 2]
    return run


# ---- issue 25 item 1: the history never exists only in memory -----------------------------


def test_a_resume_killed_while_it_starts_loses_no_metrics(finished_run, cache_dir):
    """Lightning's CSV logger removed metrics.csv when a resume started and the old rows were
    written back ~2 s later: a SIGKILL in that window lost steps 0-2 for good. Here the file is
    watched during the whole resume, and the process killed the moment it is missing."""
    logs = finished_run.parent.parent.parent
    metrics = finished_run / "csv" / "metrics.csv"
    before = _rows(metrics)
    proc = _start(logs, cache_dir, "trainer.max_steps=5", f"+resume={finished_run}")
    missing_at = None
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if not metrics.is_file():
                os.kill(proc.pid, signal.SIGKILL)
                missing_at = "while the resume was running"
                break
            time.sleep(0.002)
    finally:
        _kill(proc)
    # resume once more, to the end
    res = _run(logs, cache_dir, "trainer.max_steps=5", f"+resume={finished_run}")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(metrics)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4]
    # the history before the checkpoint, as it was (columns that only the later steps have
    # are blank there)
    assert [{k: r[k] for k in before[0]} for r in rows[:3]] == before
    assert all(r[k] == "" for r in rows[:3] for k in set(r) - set(before[0]))
    assert missing_at is None, f"metrics.csv was missing {missing_at}"
