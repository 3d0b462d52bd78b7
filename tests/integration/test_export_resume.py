"""A run killed while it exported its policy finishes the export on ``+resume`` (issue 37
case 5).

SIGKILL during the end-of-run export left no ``policy/``, an empty ``.policy.tmp<pid>`` and
no ``job.json``; the next ``+resume`` said "already finished ... nothing to train" (exit 0)
and never exported. The test leaves a finished run exactly in that state (a real kill lands
in the export only now and then) and resumes it: the export is written from the last
checkpoint, the stale temporary folder is gone and the run records itself completed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tests.conftest import ROOT

RUN = [
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rollout.sampling.max_new_tokens=8",
    "callbacks.progress=null",
    "task.num_constraints=3",
    "trainer.max_steps=2",
]


def _train_cli(logs: Path, cache_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "src/train.py", *RUN, f"paths.log_dir={logs}",
         f"paths.cache_dir={cache_dir}", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_run_killed_during_its_export_exports_on_resume(tmp_path, cache_dir):
    logs = tmp_path / "logs"
    res = _train_cli(logs, cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (logs / "train" / "runs").iterdir()
    reference = tmp_path / "reference"
    shutil.move(run / "policy", reference)  # what the uninterrupted run exported

    # What the kill left: no policy/, an empty temporary folder of the export, no job.json.
    (run / "job.json").unlink()
    stale = run / f".policy.tmp{_dead_pid()}"
    stale.mkdir()

    res = _train_cli(logs, cache_dir, f"+resume={run}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "nothing to train" not in res.stdout, res.stdout
    marker = json.loads((run / "policy" / "mrtpo_export.json").read_text())
    assert marker["step"] == 2 and marker["iteration"] == 2, marker
    assert not stale.exists()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".policy")) == []
    # the weights of the last checkpoint: those the uninterrupted run exported
    got = load_file(run / "policy" / "model.safetensors")
    want = load_file(reference / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].equal(tensor), key
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (run / "policy" / name).read_text() == (reference / name).read_text(), name
    job = json.loads((run / "job.json").read_text())
    assert job["status"] == "completed", job
    log = (run / "train.log").read_text()
    assert "exported the policy" in log and "export" in log.split("exported the policy")[0]

    # Finished and exported now: another resume is the no-op it always was.
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    res = _train_cli(logs, cache_dir, f"+resume={run}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "already finished" in res.stdout and "nothing to train" in res.stdout, res.stdout
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


@pytest.mark.parametrize("kind", ["tmp", "old"])
def test_export_folders_left_by_dead_processes_are_removed(tmp_path, kind):
    from mrtpo.lightning.callbacks.export import remove_stale_exports

    out = tmp_path / "policy"
    stale = tmp_path / f".policy.{kind}{_dead_pid()}"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "w.bin").write_bytes(b"x")
    busy = tmp_path / f".policy.{kind}{os.getppid()}"  # a live process may be exporting
    busy.mkdir()
    odd = tmp_path / f".policy.{kind}x1"
    odd.mkdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    link = tmp_path / f".policy.{kind}{_dead_pid()}"
    os.symlink(mine, link)  # a link is not a folder an export made: left alone
    assert remove_stale_exports(out) == [stale]
    assert not stale.exists() and busy.is_dir() and odd.is_dir() and link.is_symlink()
    assert (mine / "keep.txt").read_text() == "mine"
    assert remove_stale_exports(tmp_path / "absent" / "policy") == []
