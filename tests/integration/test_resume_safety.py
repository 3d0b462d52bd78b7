"""Resuming a run folder with real processes: the history is on disk at every instant, one
process at a time owns a folder, and a refused resume leaves nothing behind.

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
from tests.conftest import ROOT, SMALL_RUN

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
        *SMALL_RUN,
        "callbacks.export=null",
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


@pytest.mark.slow  # three training processes
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


# ---- issue 25 item 2: one process at a time in a run folder -------------------------------


@pytest.mark.slow  # four training processes
def test_a_second_resume_of_a_running_folder_is_refused_naming_the_first(finished_run, cache_dir):
    """A resume while another resume of the same folder runs used to be accepted: both
    logged steps 3, 4, ... into one metrics.csv and mixed their checkpoints. The second one
    is refused, naming the first; once the first is killed (SIGKILL, no cleanup), its lock
    is gone and a third resume continues the run."""
    logs = finished_run.parent.parent.parent
    ck = finished_run / "checkpoints"
    first = _start(logs, cache_dir, "trainer.max_steps=1000", f"+resume={finished_run}")
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while first.poll() is None and time.monotonic() < deadline:
            if (ck / "step000004.ckpt").is_file() and _saved_step(ck / "last.ckpt") >= 4:
                break  # the first resume is training
            time.sleep(0.05)
        assert first.poll() is None, first.output_file.read_text()[-3000:]
        second = _run(logs, cache_dir, "trainer.max_steps=6", f"+resume={finished_run}")
        assert first.poll() is None  # still running: the second did not stop it
    finally:
        _kill(first)
    out = second.stdout + second.stderr
    assert second.returncode != 0, out[-3000:]
    assert "in use by another run" in out and f"process {first.pid} " in out, out[-3000:]
    # the second wrote nothing: every step once, the first's checkpoints only
    steps = _steps(finished_run / "csv" / "metrics.csv")
    assert steps == list(range(len(steps))), steps
    killed_at = _saved_step(ck / "last.ckpt")
    assert killed_at >= 4
    # the dead process's lock is no obstacle
    third = _run(logs, cache_dir, f"trainer.max_steps={killed_at + 1}", f"+resume={finished_run}")
    assert third.returncode == 0, third.stderr[-3000:]
    assert _steps(finished_run / "csv" / "metrics.csv") == list(range(killed_at + 1))
    kept = sorted(p.name for p in ck.glob("step*.ckpt"))
    assert len(kept) <= 2, kept  # save_top_k=2 (the default), one run's checkpoints


def test_the_lock_names_its_holder_dies_with_it_and_a_refusal_puts_it_back(tmp_path):
    """The folder lock itself, with a real holder process: a second taker is refused naming
    it; SIGKILL frees the folder with nothing to clean; leaving the block by an exception
    before ``accept()`` restores ``run.lock`` byte for byte."""
    from mrtpo.run.folder import LOCK_NAME, RunFolderBusy, RunFolderLock

    run = tmp_path / "run"
    run.mkdir()
    script = (
        "import sys, time\n"
        "from mrtpo.run.folder import RunFolderLock\n"
        "with RunFolderLock(sys.argv[1]):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(run)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        busy = rf"process {holder.pid} on \S+, started"
        with pytest.raises(RunFolderBusy, match=busy), RunFolderLock(run):
            pass
    finally:
        _kill(holder)
        holder.stdout.close()
    before = (run / LOCK_NAME).read_bytes()
    with pytest.raises(KeyError), RunFolderLock(run) as lock:
        assert lock.fd is not None  # the dead holder's lock is gone
        raise KeyError("refused")
    assert (run / LOCK_NAME).read_bytes() == before
    with RunFolderLock(run) as lock:
        lock.accept()
    assert not (run / LOCK_NAME).exists()  # released: no holder recorded (issue 40 item 6)


# ---- issue 25 item 17: nothing left outside logs/ by a refused resume ---------------------


def test_a_refused_resume_of_a_folder_that_is_no_run_leaves_nothing_outside_logs(
    tmp_path, cache_dir
):
    """The pending log of a resume goes beside the resumed folder's parent; for a folder that
    is not a run (here tmp/data/notarun) that put tmp/resume-logs/notarun.<pid>.log outside
    logs/, and a refusal left it there."""
    folder = tmp_path / "data" / "notarun"
    folder.mkdir(parents=True)
    logs = tmp_path / "logs"
    res = _run(logs, cache_dir, f"+resume={folder}")
    assert res.returncode != 0
    assert "no last.ckpt" in res.stderr, res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "logs"]
    assert list(folder.iterdir()) == []
    (kept,) = (logs / "train" / "resume-logs").glob("notarun.*.log")
    assert "no last.ckpt" in kept.read_text()
