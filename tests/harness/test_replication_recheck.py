"""``--recheck``: a finished run folder's jobs run again at this code, compared value by value."""

from __future__ import annotations

import csv
import io
import json
import threading
from pathlib import Path

import pytest

from mrtpo.evaluate.analysis.runs import source_commit
from replication.jobs import Job, run_all
from replication.recheck import compare, elsewhere, recheck, sample, summary


def _tiny_rl(out: Path, logdir: Path, key: str = "k2/gdpo/s0") -> Job:
    ov = [
        "experiment=toy_replication",
        "task.num_constraints=2",
        "method=gdpo",
        "seed=0",
        "trainer.max_steps=3",
        f"paths.output_dir={out}",
        f"paths.log_dir={logdir}",
        "++trainer.enable_progress_bar=false",
    ]
    return Job(key, ov, out, 3)


def test_elsewhere_moves_every_path_inside_the_jobs_folder_and_nothing_else(tmp_path):
    job = Job(
        "k4/sft",
        [f"paths.output_dir={tmp_path}/k4/sft", f"stage.sft.save_dir={tmp_path}/k4/sft/policy",
         f"model.name_or_path={tmp_path}/k4/sft_noisy/policy", f"paths.log_dir={tmp_path}"],
        tmp_path / "k4" / "sft", 10, after=("k2/sft",),
    )  # fmt: skip
    moved = elsewhere(job, tmp_path / "recheck")
    assert moved.out == tmp_path / "recheck" / "k4_sft" and moved.after == ()
    assert moved.overrides == [
        f"paths.output_dir={tmp_path}/recheck/k4_sft",
        f"stage.sft.save_dir={tmp_path}/recheck/k4_sft/policy",
        f"model.name_or_path={tmp_path}/k4/sft_noisy/policy",  # another folder: the same start
        f"paths.log_dir={tmp_path}",
    ]
    # a method spec with '=' and '@' becomes a folder name Hydra can parse
    assert elsewhere(Job("k4/mrtpo@beta=0.25/s0", [], tmp_path / "x", 1), tmp_path).out.name == (
        "k4_mrtpo_beta_0.25_s0"
    )


def _done(out: Path, wall_s: float, csv: str = "m.csv") -> None:
    out.mkdir(parents=True)
    (out / csv).write_text("step,train/loss\n0,1.0\n")
    (out / "job.json").write_text(json.dumps({"csv": str(out / csv), "wall_s": wall_s}))


def test_sample_takes_seed_0_and_short_warm_starts_that_finished(tmp_path):
    jobs = {k: Job(k, [], tmp_path / k.replace("/", "_"), 1) for k in
            ("k2/sft", "k8/sft", "k2/gdpo/s0", "k2/gdpo/s1", "k4/gdpo/s0")}  # fmt: skip
    _done(jobs["k2/sft"].out, 70.0)
    _done(jobs["k8/sft"].out, 2400.0)  # too long to rerun
    _done(jobs["k2/gdpo/s0"].out, 8.0)
    _done(jobs["k2/gdpo/s1"].out, 8.0)
    # k4/gdpo/s0 never finished: nothing to compare with
    assert [j.key for j in sample(list(jobs.values()))] == ["k2/sft", "k2/gdpo/s0"]


def test_compare_counts_values_and_names_the_column_that_differs(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(
        "step,train/loss,train/time/step,train/rollout/generate_s\n0,1.5,0.2,3\n1,nan,0.1,2\n"
    )
    b.write_text(
        "step,train/loss,train/time/step,train/rollout/generate_s\n0,1.5,9.9,1\n1,nan,0.3,4\n"
    )
    assert compare(a, b) == {
        "rows": 2,
        "rows_again": 2,
        "values": 1,
        "max_abs_diff": 0.0,
        "column": None,
        "success_max_abs_diff": 0.0,
    }  # fmt: skip  (NaN in both runs is no value compared)
    b.write_text("step,train/loss\n0,1.25\n1,0.5\n")
    got = compare(a, b)
    assert got["column"] == "train/loss" and got["max_abs_diff"] == float("inf")  # nan vs 0.5


def _within(fn, *args, seconds: float = 900.0):
    """``fn(*args)`` in a thread, failing the test if it hangs (three tiny runs take ~30 s on
    a quiet machine; the bound is for a loaded one)."""
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(value=fn(*args)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{fn.__name__} did not return within {seconds:g} s"
    return out["value"]


def test_a_rerun_at_the_same_code_is_identical_and_a_changed_run_is_named(tmp_path):
    logdir = tmp_path / "run"
    job = _tiny_rl(logdir / "k2" / "gdpo" / "s0", logdir)
    first = _within(run_all, [job], 1, 1, None, "first")[job.key]
    assert not first.get("error"), first
    before = Path(first["csv"]).read_bytes()

    got = _within(recheck, [job], logdir, 1, 1, None)
    [row] = got["jobs"]
    assert got["commit"] == source_commit()
    assert row["max_abs_diff"] == 0.0 and row["values"] > 20 and row["rows"] == row["rows_again"]
    assert Path(first["csv"]).read_bytes() == before  # the first run's folder is not touched
    assert json.loads((logdir / "recheck.json").read_text()) == got
    [text, _] = summary(logdir, "abc1234")
    assert "runs from `abc1234`" in text and f"all {row['values']} logged values" in text

    # the first run's numbers differ from what this code does: the report names the job
    rows = list(csv.DictReader(io.StringIO(before.decode())))
    col = "train/loss"
    rows[0][col] = str(float(rows[0][col]) + 1.0)
    with open(first["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _within(recheck, [job], logdir, 1, 1, None)
    lines = summary(logdir, "abc1234")
    assert lines[0].endswith("these did not:")
    assert lines[2].startswith("- `k2/gdpo/s0`: largest difference 1 (`train/loss`)"), lines


def test_recheck_is_refused_without_report_only(tmp_path, capsys):
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("replicate", root / "scripts" / "replicate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit):
        mod.parse_args(["--recheck", "--logdir", str(tmp_path)])
    assert "--recheck is a --report-only option" in capsys.readouterr().err
    opts = mod.parse_args(["--long", "--report-only", "--recheck", "--logdir", str(tmp_path)])
    assert opts.recheck and opts.report_only


def test_recheck_of_a_credit_folder_without_its_decision_names_the_file(tmp_path):
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("replicate", root / "scripts" / "replicate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "run.json").write_text(json.dumps({"credit": True, "seeds": 1}))
    with pytest.raises(SystemExit, match=r"decision\.json is missing: --recheck needs a finished"):
        mod.main(["--long", "--report-only", "--recheck", "--logdir", str(tmp_path)])
