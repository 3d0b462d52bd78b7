"""What a checkpoint or a run folder from elsewhere can make this project do (issue 37, cases
1, 2, 3 and the eval part of 16), with real processes on the tiny model.

* A checkpoint is data: its pickle is read with torch's weights-only reader, so one that
  would call a function (``os.system``) is refused naming it, and nothing in it runs on
  ``src/train.py ckpt_path=``, ``+resume=``, ``src/eval.py`` or ``src/export.py``.
* A run folder's config may name code (a custom task's reward modules): ``src/eval.py``
  imports it only when the command line names the code itself or says
  ``eval.trust_run_code=true``.
* A damaged checkpoint given to eval or export is one error line naming it and the other
  checkpoints of its folder, not a traceback.
* Checkpoint writes and removals never go through a symlink or a path the run did not make.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tests.conftest import ROOT

from mrtpo.run.checkpointing import (
    CheckpointError,
    SafeCheckpointIO,
    atomic_save,
    checksum_path,
    load_checkpoint,
    peek_checkpoint,
)

HANG_GUARD_S = 900  # a bound for a machine far slower than this one, not a speed check
STEPS = 2


def _env(cache_dir: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "MRTPO_CACHE_DIR": str(cache_dir),
    }
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def _train(logs: Path, cache_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, str(ROOT / "src" / "train.py"), "print_config=false",
        "rl.prompts_per_step=2", "rl.group_size=2", "rollout.sampling.max_new_tokens=4",
        "callbacks.progress=null", "callbacks.sample_table=null",
        "callbacks.relevance_dump=null", "callbacks.export=null",
        "callbacks.model_checkpoint.every_n_train_steps=1",
        f"paths.log_dir={logs}", f"paths.cache_dir={cache_dir}", *extra,
    ]  # fmt: skip
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(cache_dir), capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def _script(name: str, cache_dir: Path, *extra: str, cwd: Path = ROOT):
    cmd = [sys.executable, str(ROOT / "src" / name), f"paths.cache_dir={cache_dir}", *extra]
    return subprocess.run(
        cmd, cwd=cwd, env=_env(cache_dir), capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def _errors(res: subprocess.CompletedProcess) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("error: ")]


def _one_clear_error(res: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a failed command that printed no traceback."""
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = _errors(res)
    assert len(errors) == 1, out[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir) -> Path:
    """A finished tiny run (last.ckpt, step000001.ckpt, step000002.ckpt) to copy from."""
    logs = tmp_path_factory.mktemp("trust") / "logs"
    res = _train(logs, cache_dir, f"trainer.max_steps={STEPS}")
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (logs / "train" / "runs").iterdir()
    return run


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    """A copy of the finished run that a test may change (its own folder, resumable)."""
    dest = tmp_path / "logs" / "train" / "runs" / finished.name
    shutil.copytree(finished, dest)
    (dest / "run.lock").unlink(missing_ok=True)
    return dest


# ---- case 1: a checkpoint runs code ------------------------------------------------------


class _RunsCode:
    """Pickles as a call of ``os.system`` that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _plant_code(run: Path, marker: Path) -> Path:
    """Our own last.ckpt of ``run`` plus an object whose unpickling runs a command, written
    with the project's own writer: a matching .sha256 sidecar."""
    ckpt_path = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    ckpt["hyper_parameters"] = {"note": _RunsCode(marker)}
    atomic_save(ckpt, ckpt_path)
    return ckpt_path


@pytest.mark.parametrize(
    "command", ["train-ckpt_path", "resume-finished", "resume-longer", "eval", "export"]
)
def test_a_checkpoint_whose_pickle_calls_a_function_runs_nothing(
    run_copy, cache_dir, tmp_path, command
):
    """Before: the marker appeared on every command (twice on train: peek and read), and
    ``+resume`` of a finished run ran it while saying "already finished"."""
    marker = tmp_path / "MARKER-code-ran"
    evil = _plant_code(run_copy, marker)
    logs = tmp_path / "logs"
    if command == "train-ckpt_path":
        res = _train(tmp_path / "new", cache_dir, f"ckpt_path={evil}", "trainer.max_steps=5")
    elif command == "resume-finished":
        res = _train(logs, cache_dir, f"trainer.max_steps={STEPS}", f"+resume={run_copy}")
    elif command == "resume-longer":
        res = _train(logs, cache_dir, f"trainer.max_steps={STEPS + 2}", f"+resume={run_copy}")
    elif command == "eval":
        out = tmp_path / "ev"
        res = _script(
            "eval.py", cache_dir, f"ckpt_path={evil}", "eval.limit=1", f"eval.output={out}"
        )
    else:
        res = _script("export.py", cache_dir, f"ckpt_path={evil}", f"out={tmp_path / 'exp'}")
    assert not marker.exists(), "the checkpoint's pickle ran a command"
    line = _one_clear_error(res)
    assert "posix.system" in line and str(evil) in line


def test_the_loaders_refuse_a_checkpoint_that_needs_more_than_our_own_hold(run_copy, tmp_path):
    """Each reader, Lightning's included (it passes ``weights_only=None``, or ``False`` when
    asked): refused with CheckpointError naming the type, nothing run."""
    marker = tmp_path / "MARKER-code-ran"
    evil = _plant_code(run_copy, marker)
    for weights_only in (None, False, True):
        with pytest.raises(CheckpointError, match=r"posix\.system"):
            SafeCheckpointIO().load_checkpoint(evil, weights_only=weights_only)
    with pytest.raises(CheckpointError, match=r"posix\.system"):
        load_checkpoint(evil, weights_only=False)
    assert peek_checkpoint(evil, ["global_step"]) is None
    assert not marker.exists()


def test_our_own_checkpoint_still_resumes_and_evaluates(run_copy, cache_dir, tmp_path):
    res = _train(
        tmp_path / "logs", cache_dir, f"trainer.max_steps={STEPS + 1}", f"+resume={run_copy}"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = torch.load(run_copy / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == STEPS + 1
    out = tmp_path / "ev"
    ckpt_path = run_copy / "checkpoints" / "last.ckpt"
    res = _script(
        "eval.py", cache_dir, f"ckpt_path={ckpt_path}", "eval.limit=1", f"eval.output={out}"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "metrics.json").is_file()


# ---- case 3: a run folder's config names code -----------------------------------------


def _as_custom_run(run: Path, marker: Path) -> Path:
    """Make ``run``'s saved config a custom task whose reward module (in the run folder)
    creates ``marker`` when imported. Returns its checkpoint."""
    (run / "rw.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).touch()\n"
        "def r(prompt, response, **row):\n"
        "    return 1.0\n"
    )
    data = run / "prompts.jsonl"
    data.write_text('{"prompt": "Say hi."}\n{"prompt": "Say bye."}\n')
    saved = run / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(saved)
    cfg.task = OmegaConf.create(
        {
            "_target_": "mrtpo.tasks.custom.CustomTask",
            "_convert_": "all",
            "name": "custom",
            "data": {"path": str(data), "val_size": 1},
            "rewards": [f"{run / 'rw.py'}:r"],
        }
    )
    OmegaConf.save(cfg, saved)
    return run / "checkpoints" / "last.ckpt"


def test_eval_imports_no_code_named_by_the_runs_config_unless_told(run_copy, cache_dir, tmp_path):
    """Before: the run's reward module was imported (the marker appeared), rc 0."""
    marker = tmp_path / "MARKER-reward-imported"
    ckpt = _as_custom_run(run_copy, marker)
    out = tmp_path / "ev"
    res = _script("eval.py", cache_dir, f"ckpt_path={ckpt}", "eval.limit=1", f"eval.output={out}")
    assert not marker.exists(), "eval imported the run's reward module"
    line = _one_clear_error(res)
    assert "rw.py:r" in line and "task.rewards" in line and "eval.trust_run_code=true" in line

    # the user names the reward code on the command line: theirs is imported, not the run's
    mine = tmp_path / "mine.py"
    mine.write_text("def r(prompt, response, **row):\n    return 0.5\n")
    res = _script(
        "eval.py", cache_dir, f"ckpt_path={ckpt}", "eval.limit=1", f"eval.output={out}/a",
        f"+task.rewards=[{mine}:r]",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert not marker.exists()

    # the user trusts the run: its code is imported
    res = _script(
        "eval.py", cache_dir, f"ckpt_path={ckpt}", "eval.limit=1", f"eval.output={out}/b",
        "eval.trust_run_code=true",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert marker.exists()


def test_eval_refuses_a_task_target_that_is_not_one_of_ours(run_copy, cache_dir, tmp_path):
    """Hydra calls a task's ``_target_``: a run's config could name any function."""
    marker = tmp_path / "MARKER-target-called"
    saved = run_copy / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(saved)
    cfg.task = OmegaConf.create({"_target_": "os.system", "_args_": [f"touch {marker}"]})
    OmegaConf.save(cfg, saved)
    ckpt = run_copy / "checkpoints" / "last.ckpt"
    res = _script(
        "eval.py", cache_dir, f"ckpt_path={ckpt}", "eval.limit=1", f"eval.output={tmp_path}/ev"
    )
    assert not marker.exists()
    line = _one_clear_error(res)
    assert "task._target_" in line and "os.system" in line and "eval.trust_run_code" in line


def test_export_of_a_run_with_reward_code_imports_none_of_it(run_copy, cache_dir, tmp_path):
    """Export reads the run's model and sampling settings only."""
    marker = tmp_path / "MARKER-reward-imported"
    ckpt = _as_custom_run(run_copy, marker)
    res = _script("export.py", cache_dir, f"ckpt_path={ckpt}", f"out={tmp_path / 'exp'}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not marker.exists()
    assert (tmp_path / "exp" / "config.json").is_file()


# ---- case 16 (eval part): a truncated checkpoint ---------------------------------------


@pytest.mark.parametrize("script", ["eval.py", "export.py"])
def test_a_truncated_checkpoint_is_one_line_naming_it_and_its_neighbours(
    run_copy, cache_dir, tmp_path, script
):
    """Before (eval): a traceback ending in CheckpointError, whose hint said to resume."""
    ckpt = run_copy / "checkpoints" / "last.ckpt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    extra = (
        [f"eval.output={tmp_path}/ev", "eval.limit=1"]
        if script == "eval.py"
        else [f"out={tmp_path}/exp"]
    )
    res = _script(script, cache_dir, f"ckpt_path={ckpt}", *extra)
    line = _one_clear_error(res)
    assert str(ckpt) in line and "truncated" in line
    assert "step000002.ckpt" in line and "step000001.ckpt" in line
    assert "resume" not in line.lower()
    use = {"eval.py": "Evaluate one", "export.py": "Export one"}[script]
    assert f"{use} with ckpt_path={ckpt.parent / 'step000002.ckpt'}" in line


# ---- case 2 (checkpoints): no write through a symlink the run did not make -------------


def test_checkpoint_writes_replace_planted_links_and_leave_their_targets(run_copy, tmp_path):
    """``last.ckpt`` and ``last.ckpt.sha256`` planted as links to a user's files: the save
    replaces the links, the user's files keep their bytes; removing a checkpoint that is a
    link removes the link alone."""
    folder = run_copy / "checkpoints"
    ckpt = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("my thesis\n")
    (user / "notes.txt").write_text("my notes\n")
    target = folder / "last.ckpt"
    for name, victim in (("last.ckpt", "thesis.tex"), ("last.ckpt.sha256", "notes.txt")):
        (folder / name).unlink()
        (folder / name).symlink_to(user / victim)
    atomic_save(ckpt, target)
    assert (user / "thesis.tex").read_text() == "my thesis\n"
    assert (user / "notes.txt").read_text() == "my notes\n"
    assert not target.is_symlink() and not checksum_path(target).is_symlink()
    assert load_checkpoint(target)["global_step"] == STEPS

    link = folder / "step000009.ckpt"
    link.symlink_to(user / "thesis.tex")
    SafeCheckpointIO().remove_checkpoint(link)
    assert not link.is_symlink() and (user / "thesis.tex").read_text() == "my thesis\n"


def test_a_checkpoint_cannot_name_a_file_outside_its_folder_for_removal(
    run_copy, cache_dir, tmp_path
):
    """Lightning restores ModelCheckpoint's list of kept checkpoints from the checkpoint and
    removes the oldest when a new one is saved; its "inside the checkpoint folder" test is
    textual, so ``<folder>/../../thesis.ckpt`` passed and the file was deleted."""
    folder = run_copy / "checkpoints"
    victim = tmp_path / "thesis.ckpt"
    victim.write_text("my thesis\n")
    checksum_path(victim).write_text("not ours\n")
    climbing = str(folder / ".." / ".." / ".." / ".." / ".." / victim.relative_to(tmp_path))
    assert Path(climbing).resolve() == victim.resolve()
    last = folder / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    (key,) = [k for k in ckpt["callbacks"] if k.startswith("ModelCheckpoint")]
    state = ckpt["callbacks"][key]
    state["dirpath"] = str(folder)
    state["best_k_models"] = {
        climbing: torch.tensor(0.0),
        str(folder / "step000002.ckpt"): torch.tensor(2.0),
    }
    state["kth_best_model_path"] = climbing
    state["kth_value"] = torch.tensor(0.0)
    atomic_save(ckpt, last)
    res = _train(
        tmp_path / "logs", cache_dir, f"trainer.max_steps={STEPS + 2}", f"+resume={run_copy}"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert victim.read_text() == "my thesis\n"
    assert checksum_path(victim).read_text() == "not ours\n"
