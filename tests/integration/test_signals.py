"""SIGTERM and SIGINT end a real ``python src/train.py`` within a bounded time, say so, record
the run as interrupted and exit non-zero; a thread a reward leaves running does not keep the
process alive after its run (issue 37, cases 13 and 14).

Each test starts the trainer as a subprocess on the tiny model, as a user or a scheduler would,
and signals it once its step lines appear. The timeouts only guard against hangs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tests.conftest import ROOT

from mrtpo.run.signals import EXIT_GRACE_S, STEP_GRACE_S

HANG = 600  # seconds: far longer than any of these runs takes when it works

REWARDS_PY = '''
"""Rewards that misbehave: one sleeps forever once asked to, one leaves a thread running."""

import threading
import time
from pathlib import Path

HERE = Path(__file__).parent


def sleeps_once_asked(prompt, response, **row):
    if (HERE / "hang").exists():
        (HERE / "asleep").touch()
        time.sleep(10**6)
    return float(len(response) % 2 == 0)


def sleeps_through_interrupts(prompt, response, **row):
    if (HERE / "hang").exists():
        (HERE / "asleep").touch()
        while True:
            try:
                time.sleep(10**6)
            except BaseException:  # a reward that swallows every interrupt
                pass
    return float(len(response) % 2 == 0)


def leaves_a_thread(prompt, response, **row):
    if not any(t.name == "user-sleeper" for t in threading.enumerate()):
        threading.Thread(
            target=time.sleep, args=(10**6,), name="user-sleeper", daemon=False
        ).start()
    return float(len(response) % 2 == 0)
'''

PROMPTS = ["Say something short.", "Reply with one word.", "Answer briefly.", "Write letters."]
LINE = re.compile(
    r"received (SIGTERM|SIGINT) at step (\d+): stopping; resume with python src/train\.py "
    r".*\+resume=(\S+)"
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def _cmd(logs: Path, cache_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "src/train.py",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rollout.sampling.max_new_tokens=8",
        "callbacks.sample_table=null",
        "callbacks.relevance_dump=null",
        f"paths.log_dir={logs}",
        f"paths.cache_dir={cache_dir}",
        "print_config=false",
        *extra,
    ]


def _custom(user: Path, reward: str) -> list[str]:
    return [
        "task=custom",
        f"task.data.path={user / 'prompts.jsonl'}",
        f"task.rewards=[{user / 'rw.py'}:{reward}]",
        "method=grpo",
    ]


@pytest.fixture
def user(tmp_path) -> Path:
    """A user's folder: four prompts and the misbehaving rewards."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "rw.py").write_text(textwrap.dedent(REWARDS_PY))
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


class Run:
    """``python src/train.py`` in a subprocess, its console written to files."""

    def __init__(self, tmp: Path, cmd: list[str]) -> None:
        self.out, self.err = tmp / "stdout.txt", tmp / "stderr.txt"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, env=_env())

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait_for(self, what, timeout: float = HANG) -> None:
        """Until ``what()`` (or a line starting with ``what``) holds; fails if the run ends."""
        test = (
            what
            if callable(what)
            else lambda: any(line.startswith(what) for line in self.out.read_text().splitlines())
        )
        deadline = time.monotonic() + timeout
        while not test():
            if self.proc.poll() is not None:  # it may have ended between the test and here
                assert test(), f"the run ended first:\n{self.text()[-3000:]}"
                return
            assert time.monotonic() < deadline, f"timed out:\n{self.text()[-3000:]}"
            time.sleep(0.1)

    def wait(self, timeout: float = HANG) -> tuple[int, float]:
        """(exit status, seconds it took); a run still alive after ``timeout`` is killed."""
        t0 = time.monotonic()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout:g} s later:\n{self.text()[-3000:]}")
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def started(tmp_path):
    runs: list[Run] = []

    def start(cmd: list[str]) -> Run:
        run = Run(tmp_path, cmd)
        runs.append(run)
        return run

    yield start
    for run in runs:  # a failed test leaves no trainer behind
        run.kill()


def _job(logs: Path) -> tuple[Path, dict]:
    (path,) = logs.glob("train/runs/*/job.json")
    return path.parent, json.loads(path.read_text())


def test_sigterm_says_so_records_interrupted_and_exits_143(tmp_path, cache_dir, started):
    logs = tmp_path / "logs"
    every_step = "callbacks.model_checkpoint.every_n_train_steps=1"
    run = started(_cmd(logs, cache_dir, "trainer.max_steps=1000", every_step))
    run.wait_for("step 2/")
    run.proc.send_signal(signal.SIGTERM)
    rc, _ = run.wait()
    assert rc == 143, run.text()[-3000:]
    folder, job = _job(logs)
    assert job["status"] == "interrupted" and "SIGTERM" in job["error"]
    (line,) = [m for m in LINE.finditer(run.out.read_text())]  # said once, on the console
    assert line[1] == "SIGTERM" and int(line[2]) >= 2 and Path(line[3]) == folder
    assert LINE.search((folder / "train.log").read_text())  # and in the run's log
    # The hint works: the run goes on from its last checkpoint.
    res = subprocess.run(
        _cmd(logs, cache_dir, f"trainer.max_steps={int(line[2]) + 2}", every_step,
             f"+resume={folder}"),
        cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=HANG,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert _job(logs)[1]["status"] == "completed"


def test_a_reward_that_never_returns_cannot_hold_off_sigterm(tmp_path, cache_dir, user, started):
    logs = tmp_path / "logs"
    run = started(
        _cmd(logs, cache_dir, *_custom(user, "sleeps_once_asked"), "trainer.max_steps=50")
    )
    run.wait_for("step 1/")
    (user / "hang").touch()
    run.wait_for((user / "asleep").exists)
    run.proc.send_signal(signal.SIGTERM)
    rc, took = run.wait(timeout=60)
    assert rc == 143, run.text()[-3000:]
    assert took < 60 and took < STEP_GRACE_S + EXIT_GRACE_S + 10
    text = run.text()
    assert re.search(r"received SIGTERM at step \d+: stopping", text)  # (the step asleep)
    assert "the step did not end within" in text  # interrupted, not waited for
    assert _job(logs)[1]["status"] == "interrupted"


@pytest.mark.slow
def test_a_second_sigterm_interrupts_the_step_at_once(tmp_path, cache_dir, user, started):
    logs = tmp_path / "logs"
    run = started(
        _cmd(logs, cache_dir, *_custom(user, "sleeps_once_asked"), "trainer.max_steps=50")
    )
    run.wait_for("step 1/")
    (user / "hang").touch()
    run.wait_for((user / "asleep").exists)
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for(lambda: "received SIGTERM" in run.text(), timeout=60)
    run.proc.send_signal(signal.SIGTERM)
    rc, _ = run.wait(timeout=60)
    assert rc == 143, run.text()[-3000:]
    assert "the step did not end within" not in run.text()  # the second signal did it
    assert _job(logs)[1]["status"] == "interrupted"


@pytest.mark.slow
def test_a_reward_that_swallows_the_interrupt_still_cannot_keep_the_run(
    tmp_path, cache_dir, user, started
):
    logs = tmp_path / "logs"
    cmd = _cmd(logs, cache_dir, *_custom(user, "sleeps_through_interrupts"), "trainer.max_steps=50")
    run = started(cmd)
    run.wait_for("step 1/")
    (user / "hang").touch()
    run.wait_for((user / "asleep").exists)
    run.proc.send_signal(signal.SIGTERM)
    rc, took = run.wait(timeout=60)
    assert rc == 143, run.text()[-3000:]
    assert took < STEP_GRACE_S + EXIT_GRACE_S + 10
    assert f"the run did not stop within {EXIT_GRACE_S:g} s: exiting now" in run.text()


@pytest.mark.slow
def test_sigint_records_interrupted_and_exits_130(tmp_path, cache_dir, started):
    logs = tmp_path / "logs"
    run = started(_cmd(logs, cache_dir, "trainer.max_steps=1000"))
    run.wait_for("step 2/")
    run.proc.send_signal(signal.SIGINT)
    rc, _ = run.wait()
    assert rc == 130, run.text()[-3000:]
    folder, job = _job(logs)
    assert job["status"] == "interrupted" and "SIGINT" in job["error"]
    # no checkpoint yet (every 10 steps): the line says to start again, not to resume
    assert re.search(rf"received SIGINT at step \d+: stopping; {re.escape(str(folder))} holds "
                     "no checkpoint yet: start the run again", run.text())  # fmt: skip


@pytest.mark.slow
def test_sigterm_in_a_sweep_records_the_job_and_ends_the_sweep(tmp_path, cache_dir, started):
    logs = tmp_path / "logs"
    cmd = _cmd(logs, cache_dir, "trainer.max_steps=1000", "seed=1,2")
    run = started([*cmd[:2], "-m", *cmd[2:]])  # Hydra's flags before the overrides
    run.wait_for("step 2/")
    run.proc.send_signal(signal.SIGTERM)
    rc, _ = run.wait()
    assert rc == 143, run.text()[-3000:]
    jobs = list(logs.glob("train/multiruns/*/*/job.json"))
    assert len(jobs) == 1, jobs  # the second job never started
    assert json.loads(jobs[0].read_text())["status"] == "interrupted"


def test_a_thread_a_reward_leaves_running_does_not_keep_the_run_alive(
    tmp_path, cache_dir, user, started
):
    logs = tmp_path / "logs"
    run = started(_cmd(logs, cache_dir, *_custom(user, "leaves_a_thread"), "trainer.max_steps=2"))
    run.wait_for(lambda: list(logs.glob("train/runs/*/job.json")))  # the run has ended
    rc, _ = run.wait(timeout=120)
    assert rc == 0, run.text()[-3000:]
    folder, job = _job(logs)
    assert job["status"] == "completed"
    steps = (folder / "csv" / "metrics.csv").read_text().splitlines()[1:]
    assert len(steps) == 2
    assert (folder / "policy" / "config.json").is_file()  # exported
    log = (folder / "train.log").read_text()
    assert "exiting without waiting for 1 thread(s) still running" in log
    assert "user-sleeper" in log
