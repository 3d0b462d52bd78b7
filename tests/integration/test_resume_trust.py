"""A resume runs no code named by its run folder unless the user repeats it.

``+resume=<run>`` composes the run's ``.hydra/overrides.yaml``. An override in it that could
make the run import or run code (an interpolation, a ``_target_``, an addition under a node
the run builds, a Hydra group, a custom task's functions) is taken only when the same
override is given beside ``+resume``; otherwise the resume stops in one line saying what to
add. An overrides file another user owns or may write is refused. The CLI runs are real
``python src/train.py`` processes on the tiny model.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT, SMALL_RUN

from mrtpo.run.resume import resume_overrides
from mrtpo.run.settings import ConfigError

HANG_GUARD_S = 900  # a bound for a machine far slower than this one, not a speed check

RUN = [*SMALL_RUN, "trainer.max_steps=1", "callbacks.export=null"]
REWARDS = "def r1(prompt, response, **row):\n    return float(len(response) <= 8)\n"


def _train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "src" / "train.py"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _refusal(res: subprocess.CompletedProcess) -> str:
    """The one line a refused command printed (no traceback)."""
    assert res.returncode != 0, res.stdout[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory, cache_dir) -> Path:
    """A finished 1-step run of the synthetic task (its checkpoint saved)."""
    logs = tmp_path_factory.mktemp("trust_synthetic")
    res = _train(ROOT, *RUN, f"paths.cache_dir={cache_dir}", f"paths.log_dir={logs}")
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (logs / "train" / "runs").iterdir()
    return run


def _folder(tmp_path: Path, lines: list[str]) -> Path:
    """A run folder holding only ``.hydra/overrides.yaml`` with ``lines``."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {json.dumps(o)}\n" for o in lines))
    return run


# ---- the reviewer's folder -------------------------------------------------------------------


def test_a_crafted_folder_does_not_run_its_reward_file(synthetic_run, tmp_path):
    """Three appended lines made a resume import ``.hydra/r.py`` before any check: now the
    resume stops in one line naming them, the file is never imported, the folder unchanged."""
    run = tmp_path / "crafted"
    shutil.copytree(synthetic_run, run)
    marker = tmp_path / "marker"
    hydra = run / ".hydra"
    (hydra / "r.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\ndef f(prompt, response, **row):\n    return 1.0\n"
    )
    (hydra / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    with open(hydra / "overrides.yaml", "a") as f:
        f.write("- task=custom\n")
        f.write("- task.data.path=${hydra:runtime.output_dir}/.hydra/p.jsonl\n")
        f.write("- task.rewards=['${hydra:runtime.output_dir}/.hydra/r.py:f']\n")
    before = _tree(run)
    res = _train(ROOT, f"+resume={run}", "trainer.max_steps=2")
    line = _refusal(res)
    assert not marker.exists(), "the folder's reward file was imported"
    assert "task.rewards=['${hydra:runtime.output_dir}/.hydra/r.py:f']" in line, line
    assert "task.data.path=${hydra:runtime.output_dir}/.hydra/p.jsonl" in line, line
    assert "repeat it" in line and "task=custom," not in line, line  # a group choice is data
    assert _tree(run) == before


# ---- other overrides that name code ----------------------------------------------------------


def test_an_added_callback_with_a_target_is_refused(tmp_path):
    evil = "+callbacks.x={_target_:os.system,command:touch /tmp/x}"
    run = _folder(tmp_path, ["seed=1", evil])
    with pytest.raises(ConfigError, match="can name code") as exc:
        resume_overrides([f"+resume={run}"])
    assert evil in str(exc.value) and "\n" not in str(exc.value)
    assert shlex.quote(evil) in str(exc.value)  # the exact word to add, quoted for a shell
    # the user repeats it: the user says so, and it is taken (once)
    words = resume_overrides([evil, f"+resume={run}"])
    assert words.count(evil) == 1 and words[-1] == f"+resume={run}"


@pytest.mark.parametrize(
    "line",
    [
        "hydra/launcher=basic",
        "+hydra/callbacks=x",
        "trainer.plugins._target_=os.system",
        "+trainer.strategy={_partial_:true}",
        "+logger.x=1",
        "+method@callbacks.x=mrtpo",
        "task.blocks={r1: mymod.b}",
        "task.success=mymod.ok",
        "task.import_dirs=[/tmp]",
        "rollout.engine.server_args=[--trust-remote-code]",
        "seed=${oc.env:HOME}",
    ],
)
def test_each_kind_of_code_naming_override_is_refused(tmp_path, line):
    run = _folder(tmp_path, ["task=custom", line])
    with pytest.raises(ConfigError, match="repeat it"):
        resume_overrides([f"+resume={run}", "trainer.max_steps=3"])


def test_plain_overrides_and_group_choices_are_taken(tmp_path):
    saved = ["task=custom", "method=gdpo", "seed=3", "task.data.path=p.jsonl", "rl.group_size=2"]
    run = _folder(tmp_path, saved)
    assert resume_overrides([f"+resume={run}"]) == [*saved, f"+resume={run}"]


def test_an_overrides_file_others_may_write_is_refused(tmp_path):
    run = _folder(tmp_path, ["seed=1"])
    (run / ".hydra" / "overrides.yaml").chmod(0o666)
    with pytest.raises(ConfigError, match="others may write it"):
        resume_overrides([f"+resume={run}"])


# ---- the common case: a custom task's own rewards --------------------------------------------


def test_a_custom_run_resumes_when_its_reward_override_is_repeated(tmp_path, cache_dir):
    work = tmp_path / "work"
    work.mkdir()
    (work / "mrtpo_trust_rewards.py").write_text(REWARDS)
    rows = [{"prompt": "Say red."}, {"prompt": "Say blue."}]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    custom = [
        "task=custom",
        "task.data.path=prompts.jsonl",
        "task.rewards=[mrtpo_trust_rewards.r1]",
    ]
    args = [*custom, "method=gdpo", *RUN, f"paths.cache_dir={cache_dir}"]
    res = _train(work, *args, f"paths.log_dir={work / 'logs'}")
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (work / "logs" / "train" / "runs").iterdir()
    # the printed hint already repeats the reward override
    assert f"python src/train.py 'task.rewards=[mrtpo_trust_rewards.r1]' +resume={run}" in (
        res.stdout + res.stderr
    )
    line = _refusal(_train(work, f"+resume={run}", "trainer.max_steps=2"))
    assert "task.rewards=[mrtpo_trust_rewards.r1]" in line, line
    command = shlex.split(line.split("add it: ", 1)[1])
    assert command[:2] == ["python", "src/train.py"]
    res = _train(work, *command[2:], "trainer.max_steps=2")
    assert res.returncode == 0, res.stderr[-3000:]
    with open(run / "csv" / "metrics.csv", newline="") as f:
        steps = [r["step"] for r in csv.DictReader(f) if r.get("train/iteration")]
    assert steps == ["0", "1"]
