"""src/report.py on what a hostile pass gave it (issue 37, cases 2, 12 and 16): a run still
running, a metric that is NaN in one seed, a malformed job.json, a read-only run folder, and
output files planted as symlinks to a user's file. Hand-made run folders as Lightning and
Hydra write them; the real report and summary code."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
from omegaconf import OmegaConf
from tests.unit.test_sweep_summary import write_metrics

from mrtpo.evaluate.analysis.jobs import find_runs
from mrtpo.evaluate.analysis.report import main, report
from mrtpo.evaluate.analysis.summary import write_summary


def make_job(root, name, method, seed, values, *, max_steps=3, job=None, first=None):
    """A run folder: .hydra/ (overrides, config with trainer.max_steps), metrics.csv with
    one row per value, and a job.json holding ``job`` (a finished job) when given."""
    folder = root / name
    (folder / ".hydra").mkdir(parents=True)
    overrides = [f"method={method}", f"seed={seed}"]
    (folder / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    config = {"seed": seed, "trainer": {"max_steps": max_steps}}
    (folder / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    write_metrics(folder, values, first)
    if job is not None:
        text = job if isinstance(job, str) else json.dumps(job)
        (folder / "job.json").write_text(text)
    return folder


DONE = {"status": "completed", "wall_s": 10.0}


def test_a_run_still_running_is_named_and_left_out_unless_asked(tmp_path, capsys):
    root = tmp_path / "sweep"
    make_job(root, "0", "gdpo", 1, [0.2] * 3, job=DONE)
    make_job(root, "1", "gdpo", 2, [0.4] * 3, job=DONE)
    # seed 3 is at step 126 of 6000: no job.json yet (it is written when the job ends)
    running = make_job(root, "2", "gdpo", 3, [0.9] * 126, max_steps=6000)
    rep = report(find_runs([root]), None)
    assert "| (all runs) | 2 | 3 | 0.300 ± 1.271 |" in rep.text  # seeds 1 and 2 only
    assert "Left out (incomplete: 126 of 6000 steps" in rep.text and str(running) in rep.text
    assert "--incomplete" in rep.text
    # asked for: counted, and the table says which runs are incomplete
    rep = report(find_runs([root]), None, incomplete=True)
    assert "| (all runs) | 3 | 3/126* | 0.500 ± 0.896 |" in rep.text  # * partial (issue 40)
    assert "1 incomplete (126 of 6000 steps, stopped before its last step)" in rep.text
    assert "*: partial: the row counts runs short of trainer.max_steps" in rep.text
    # the command line: the same, with the flag
    assert main([str(root), "--no-plots"]) == 0
    assert "incomplete: 126 of 6000 steps" in capsys.readouterr().out
    assert main([str(root), "--no-plots", "--incomplete"]) == 0
    assert "| (all runs) | 3 | 3/126* |" in capsys.readouterr().out


def test_a_run_still_running_is_told_from_one_that_stopped(tmp_path):
    """run.lock names the process that holds a run folder while it trains (and goes when the
    run ends): a live one is 'still running', a dead one 'stopped' (issue 40 item 4)."""
    import os
    import socket
    import subprocess
    import sys

    root = tmp_path / "sweep"
    make_job(root, "0", "gdpo", 1, [0.2] * 3, job=DONE)
    live = make_job(root, "1", "gdpo", 2, [0.4] * 3, max_steps=50)
    dead = make_job(root, "2", "gdpo", 3, [0.6] * 3, max_steps=50)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    host = socket.gethostname()
    for folder, pid in ((live, os.getpid()), (dead, int(gone.stdout))):
        (folder / "run.lock").write_text(json.dumps({"pid": pid, "host": host}))
    rep = report(find_runs([root]), None, incomplete=True)
    assert f"3 of 50 steps, still running (process {os.getpid()})" in rep.text
    assert "3 of 50 steps, stopped (its process died)" in rep.text
    assert "| (all runs) | 3 | 3* |" in rep.text
    rep = report(find_runs([root]), None)
    assert f"Left out (incomplete: 3 of 50 steps, still running (process {os.getpid()})" in rep.text


def test_a_resumed_run_counts_its_latest_step_limit(tmp_path):
    root = tmp_path / "sweep"
    run = make_job(root, "0", "gdpo", 1, [0.2] * 3, max_steps=3)
    resume = run / ".hydra" / "resumes" / "2026-01-01_00-00-00-1"
    resume.mkdir(parents=True)
    (resume / "config.yaml").write_text(OmegaConf.to_yaml({"trainer": {"max_steps": 10}}))
    rep = report(find_runs([root]), None, incomplete=True)
    assert "1 incomplete (3 of 10 steps, stopped before its last step)" in rep.text


def test_the_count_shown_is_the_count_each_metric_averages(tmp_path):
    root = tmp_path / "sweep"
    for s, v in ((1, 0.2), (2, 0.4), (3, 0.6)):
        make_job(root, f"g{s}", "gdpo", s, [v] * 3, job=DONE)
    # mrtpo seed 3's reward "first" never applied: NaN on every step
    make_job(root, "m1", "mrtpo", 1, [0.5] * 3, job=DONE)
    make_job(root, "m2", "mrtpo", 2, [0.7] * 3, job=DONE)
    make_job(root, "m3", "mrtpo", 3, [0.9] * 3, job=DONE, first=[None] * 3)
    rep = report(find_runs([root]), None, baseline=["method=gdpo"])
    final = rep.text.split("## Final")[1].split("## Best")[0]
    # success over 3 seeds; first over the 2 seeds where it has a value, and said so
    assert "| method=mrtpo | 3 | 3 | 0.700 ± 0.497 | 0.600 ± 1.271 (n=2) |" in final
    assert "(n=k): the mean is over k seeds" in rep.text
    paired = rep.text.split("## Paired differences")[1]
    assert "| method=mrtpo | method=gdpo | 3 | 0.300 ± 0.000 | 0.300 ± 0.000 (n=2) |" in paired


BAD_JOBS = {
    "a": '{"overrides": 5, "status": "completed"}',
    "b": "[1, 2, 3]",
    "c": '{"wall_s": "abc", "status": "completed", "job_num": "x", "error": 7}',
    "d": '{"status": "completed", "overrides": ["method=gdpo", 3]',  # cut short
}


def test_a_malformed_job_json_is_named_and_the_run_still_reported(tmp_path, capsys):
    root = tmp_path / "sweep"
    for seed, (name, text) in enumerate(BAD_JOBS.items(), 1):
        make_job(root, name, "gdpo", seed, [0.1 * seed] * 3, job=text)
    assert main([str(root), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "| (all runs) | 4 | 3 | 0.250 ±" in out  # all four runs, grouped by .hydra/
    assert f'{root / "a" / "job.json"}: "overrides" is not a list of strings (an int)' in out
    assert f"{root / 'b' / 'job.json'}: not a JSON object (a list)" in out
    assert f'{root / "c" / "job.json"}: "wall_s" is not a number (a str)' in out
    assert f'{root / "c" / "job.json"}: "job_num" is not a whole number (a str)' in out
    assert f"{root / 'd' / 'job.json'}: not valid JSON (line 1:" in out
    assert "Traceback" not in out
    # the sweep summary reads the same records
    csv_path, md_path = write_summary(root)
    assert "4 jobs." in md_path.read_text() and len(csv_path.read_text().splitlines()) == 5


# ---- a read-only run folder ---------------------------------------------------------------
@pytest.fixture
def read_only(tmp_path):
    """A tmpfs mounted at a folder, made read-only after ``fill(folder)`` (root ignores
    permission bits, so only a read-only mount refuses root's writes)."""
    where = tmp_path / f"ro-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "none", str(where)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.decode().strip()[:200]})")

    def freeze() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)

    yield where, freeze
    subprocess.run(["umount", str(where)], check=False)


def test_a_read_only_run_folder_gives_one_line_and_the_table(read_only, tmp_path, capsys):
    where, freeze = read_only
    run = make_job(where, "run", "gdpo", 1, [0.5] * 3, job=DONE)
    freeze()
    assert main([str(run)]) == 2
    out = capsys.readouterr().out
    assert "| (all runs) | 1 | 3 | 0.500 |" in out  # the numbers are still printed
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot write {run}/") and "Read-only file system" in last
    assert "--out" in last
    assert main([str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "report.md").is_file()


# ---- symlinks planted where the report writes ----------------------------------------------
def test_outputs_planted_as_symlinks_are_refused_and_their_targets_left_alone(tmp_path, capsys):
    root = tmp_path / "sweep"
    make_job(root, "0", "gdpo", 1, [0.2] * 3, job=DONE)
    make_job(root, "1", "gdpo", 2, [0.4] * 3, job=DONE)
    user = tmp_path / "precious.txt"
    user.write_text("mine\n")
    # the summary's temporary files had fixed names (.summary.csv.<pid>.tmp), written through
    for name in ("summary.csv", "summary.md", "report.md"):
        (root / f".{name}.{os.getpid()}.tmp").symlink_to(user)
    assert write_summary(root) and main([str(root)]) == 0
    assert user.read_text() == "mine\n"
    assert (root / "report.md").stat().st_mode & 0o777 == 0o666 & ~_umask()
    capsys.readouterr()
    for name in ("report.md", "curves_success.png", "curves_first.png"):
        (root / name).unlink()
        (root / name).symlink_to(user)
        assert main([str(root)]) == 2
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"error: refusing to write {root / name}: it is a symbolic link "
                               f"(to {user})"), line  # fmt: skip
        assert user.read_text() == "mine\n" and (root / name).is_symlink()
        (root / name).unlink()
    for name in ("summary.csv", "summary.md"):
        (root / name).unlink()
        (root / name).symlink_to(user)
        with pytest.raises(ValueError, match=f"refusing to write {root / name}: it is a symb"):
            write_summary(root)
        assert user.read_text() == "mine\n"
        (root / name).unlink()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
