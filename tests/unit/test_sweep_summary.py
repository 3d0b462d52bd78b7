"""Comparing runs without training: hand-made run folders (Lightning-style metrics.csv, Hydra's
.hydra/overrides.yaml or a job.json) -> groups, the sweep summary, the table over seeds and
the paired differences, against numbers computed by hand."""

from __future__ import annotations

import csv
import json
import math

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from mrtpo.evaluate.analysis.jobs import (
    experiment_overrides,
    final_best,
    find_runs,
    group_runs,
    labels,
)
from mrtpo.evaluate.analysis.recorder import RunRecorder
from mrtpo.evaluate.analysis.report import baseline_of, main, report
from mrtpo.evaluate.analysis.summary import write_summary

HEAD = ["epoch", "step", "train/success", "train/reward/first/mean", "train/reward/total/mean",
        "val/loss"]  # fmt: skip


def write_metrics(folder, success, first=None):
    """A metrics.csv as Lightning writes it: one row per step, plus a row of another logging
    call whose train cells are empty."""
    (folder / "csv").mkdir(parents=True, exist_ok=True)
    with open(folder / "csv" / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEAD)
        for step, s in enumerate(success):
            r = first[step] if first is not None else s
            w.writerow([0, step, s, "" if r is None else r, s + r if r is not None else s, ""])
        w.writerow([0, len(success), "", "", "", 0.5])


def make_run(root, num, method, seed, success, *, job_json=False, status="completed", steps=3):
    folder = root / f"{num}_method={method},seed={seed}"
    overrides = [f"method={method}", f"seed={seed}", "trainer.max_steps=3",
                 f"paths.log_dir=/elsewhere/{num}", "callbacks.sample_table=null"]  # fmt: skip
    folder.mkdir(parents=True)
    if job_json:
        error = "ConfigError('rl.group_size=1 is not allowed')" if status == "failed" else None
        info = {"run_name": f"synthetic-{method}", "overrides": overrides, "status": status,
                "seed": seed, "job_num": num, "wall_s": 12.5, "error": error}  # fmt: skip
        (folder / "job.json").write_text(json.dumps(info))
    else:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    if success is not None:
        write_metrics(folder, [success] * steps)
    return folder


# gdpo finals .2 .4 .6: mean .4, sd .2, half t(.975, 2) * .2 / sqrt(3) = 4.3027 * .11547 = .497
# mrtpo finals .5 .6 .7: mean .6, sd .1, half .248; paired by seed .3 .2 .1: .2 ± .248
GDPO = {1: 0.2, 2: 0.4, 3: 0.6}
MRTPO = {1: 0.5, 2: 0.6, 3: 0.7}


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    for i, (s, v) in enumerate(GDPO.items()):
        make_run(root, i, "gdpo", s, v)
    for i, (s, v) in enumerate(MRTPO.items()):
        make_run(root, 3 + i, "mrtpo", s, v, job_json=(s == 3))
    make_run(root, 10, "mrtpo", 4, None, job_json=True, status="failed")
    # a warm start inside a run folder is part of that run, not a run of the sweep
    write_metrics(root / "0_method=gdpo,seed=1" / "warm_start" / "sft", [1.0] * 3)
    return root


def test_final_is_the_last_window_and_best_the_highest_moving_average():
    ramp = [t / 11 for t in range(12)]
    final, best = final_best(ramp)
    assert final == pytest.approx(sum(range(2, 12)) / 10 / 11)  # the last 10 steps
    assert best == pytest.approx(sum(range(7, 12)) / 5 / 11)  # the last 5-step window
    # NaN (the reward applied to no response that step) is skipped, not counted as 0
    assert final_best([math.nan, 1.0, math.nan, 0.0]) == (0.5, 1.0)
    assert all(math.isnan(x) for x in final_best([math.nan]))


def test_group_key_drops_seed_and_plumbing_and_order():
    a = experiment_overrides(["seed=1", "method=gdpo", "paths.log_dir=/a", "rl.group_size=4",
                              "callbacks.progress=null", "logger=csv", "+resume=/r"])  # fmt: skip
    b = experiment_overrides(["rl.group_size=8", "method=gdpo", "seed=2", "++rl.group_size=4"])
    assert a == b == ("method=gdpo", "rl.group_size=4")  # last value of a key wins, + dropped
    assert experiment_overrides(["method=mrtpo"]) != a


def test_find_runs_lists_jobs_in_order_and_skips_nested_warm_starts(sweep):
    runs = find_runs([sweep])
    assert [r.path.name.split("_")[0] for r in runs] == ["0", "1", "2", "3", "4", "5", "10"]
    assert [r.seed for r in runs] == ["1", "2", "3", "1", "2", "3", "4"]
    assert runs[0].curves["success"] == [0.2, 0.2, 0.2]  # the val-only row is not a step
    assert runs[0].curves["first"] == [0.2, 0.2, 0.2] and "total" not in runs[0].curves
    assert runs[5].wall_s == 12.5 and runs[5].run_name == "synthetic-mrtpo"
    assert runs[6].status == "failed" and runs[6].steps == 0
    # a glob and a metrics.csv path name the same runs
    assert [r.path for r in find_runs([str(sweep / "*_method=gdpo*")])] == [
        r.path for r in runs[:3]
    ]
    assert [r.path for r in find_runs([runs[1].path / "csv" / "metrics.csv"])] == [runs[1].path]
    with pytest.raises(FileNotFoundError, match="no such folder"):
        find_runs([sweep / "missing"])


def test_groups_and_their_labels(sweep):
    groups = group_runs(find_runs([sweep]))
    keys = list(groups)
    assert keys == [("method=gdpo", "trainer.max_steps=3"), ("method=mrtpo", "trainer.max_steps=3")]
    assert [len(v) for v in groups.values()] == [3, 4]
    names, common = labels(keys)
    assert names == {keys[0]: "method=gdpo", keys[1]: "method=mrtpo"}
    assert common == ["trainer.max_steps=3"]


def test_baseline_is_the_same_group_with_the_baseline_values():
    g = [("method.beta=0.25", "method=gdpo"), ("method.beta=0.5", "method=gdpo"),
         ("method.beta=0.5", "method=mrtpo")]  # fmt: skip
    assert baseline_of(g[2], ["method=gdpo"], g) == g[1]
    # no gdpo run with beta=0.5: the one group that matches is not unique -> none
    assert baseline_of(("method.beta=0.75", "method=mrtpo"), ["method=gdpo"], g) is None
    assert baseline_of(("method=mrtpo",), ["method=gdpo"], [("method=gdpo",)]) == ("method=gdpo",)


def test_report_table_and_paired_differences(sweep, tmp_path):
    rep = report(find_runs([sweep]), tmp_path / "fig", baseline=["method=gdpo"])
    final = rep.text.split("## Final")[1].split("## Best")[0]
    assert "| group | seeds | steps | success | first |" in final
    assert "| method=gdpo | 3 | 3 | 0.400 ± 0.497 | 0.400 ± 0.497 |" in final
    assert "| method=mrtpo | 3 | 3 | 0.600 ± 0.248 | 0.600 ± 0.248 |" in final  # failed seed 4 out
    assert "Left out (failed)" in rep.text and "10_method=mrtpo,seed=4" in rep.text
    assert "Every run: `trainer.max_steps=3`" in rep.text
    paired = rep.text.split("## Paired differences")[1]
    assert "| method=mrtpo | method=gdpo | 3 | 0.200 ± 0.248 | 0.200 ± 0.248 |" in paired
    assert sorted(p.name for p in rep.figures) == ["curves_first.png", "curves_success.png"]
    for p in rep.figures:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_seed_gives_a_mean_without_interval_and_duplicate_seeds_average(tmp_path):
    root = tmp_path / "s"
    make_run(root, 0, "gdpo", 1, 0.2)
    make_run(root, 1, "gdpo", 1, 0.4)  # the same seed again (a repeated sweep): averaged
    make_run(root, 2, "mrtpo", 1, 0.9)
    rep = report(find_runs([root]), None, baseline=["method=gdpo"])
    assert "| method=gdpo | 1 | 3 | 0.300 | 0.300 |" in rep.text
    assert "| method=mrtpo | method=gdpo | 1 | 0.600 | 0.600 |" in rep.text
    assert rep.figures == []


def test_runs_without_recorded_overrides_group_by_their_parent_folder(tmp_path):
    # the toy replication's layout: <k>/<method>/s<seed>, composed in code (no .hydra/)
    for method, vals in (("gdpo", (0.1, 0.3)), ("mrtpo", (0.5, 0.7))):
        for s, v in enumerate(vals):
            write_metrics(tmp_path / "k4" / method / f"s{s}", [v] * 2)
    groups = group_runs(find_runs([tmp_path]))
    assert [len(v) for v in groups.values()] == [2, 2]
    assert "| folder=" in report(find_runs([tmp_path])).text


def test_sweep_summary_files(sweep):
    csv_path, md_path = write_summary(sweep)
    rows = list(csv.DictReader(csv_path.read_text().splitlines()))
    assert [r["seed"] for r in rows] == ["1", "2", "3", "1", "2", "3", "4"]
    assert [r["method"] for r in rows] == ["gdpo"] * 3 + ["mrtpo"] * 4
    assert rows[0]["trainer.max_steps"] == "3" and "paths.log_dir" not in rows[0]
    assert float(rows[2]["success/final"]) == pytest.approx(0.6)
    assert float(rows[2]["first/best"]) == pytest.approx(0.6)
    assert rows[5]["status"] == "completed" and rows[5]["wall_s"] == "12.5"
    assert rows[6]["status"] == "failed" and rows[6]["steps"] == "0"
    assert "paths.log_dir=/elsewhere/0" in rows[0]["overrides"]  # all of a job's overrides
    md = md_path.read_text()
    assert "| 5 | method=mrtpo | 3 | completed | 3 | 12.5 | 0.700 / 0.700 | 0.700 / 0.700 |" in md
    assert "| 10 | method=mrtpo | 4 | failed | 0 | 12.5 | – / – | – / – |" in md
    assert "job 10 failed: `ConfigError('rl.group_size=1 is not allowed')`" in md
    assert f"python src/report.py {sweep}" in md
    empty = sweep.parent / "empty"
    empty.mkdir()
    assert write_summary(empty) is None and not list(empty.iterdir())


def test_cli(sweep, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(sweep), "--baseline", "method=gdpo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| method=gdpo | 3 | 3 | 0.400 ± 0.497 |" in printed
    assert (out / "report.md").read_text() in printed
    assert (out / "curves_success.png").is_file()
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(sweep), "--baseline", "gdpo"])
    assert "KEY=VALUE" in capsys.readouterr().err


def test_cli_with_several_sweeps_writes_to_reports_not_beside_them(tmp_path, monkeypatch, capsys):
    """Two sweeps' common parent is logs/train/multiruns: a report.md or PNG written there is
    taken for a sweep by the next `multiruns/*` glob (src/table.py, the README test)."""
    multiruns = tmp_path / "multiruns"
    make_run(multiruns / "gdpo", 0, "gdpo", 1, 0.2)
    make_run(multiruns / "mrtpo", 0, "mrtpo", 1, 0.5)
    monkeypatch.chdir(tmp_path)
    assert main([str(multiruns / "gdpo"), str(multiruns / "mrtpo")]) == 0
    assert sorted(p.name for p in multiruns.iterdir()) == ["gdpo", "mrtpo"]
    assert (tmp_path / "reports" / "report.md").read_text() in capsys.readouterr().out
    assert main([str(multiruns / "*")]) == 0  # one glob of several sweeps: the same
    assert sorted(p.name for p in multiruns.iterdir()) == ["gdpo", "mrtpo"]
    assert main([str(multiruns / "gdpo")]) == 0  # one sweep: its own report, beside it
    assert (multiruns / "gdpo" / "report.md").is_file()


def _job_config(out, **extra):
    return OmegaConf.create(
        {
            "run_name": "synthetic-gdpo",
            "seed": 3,
            "hydra": {
                "runtime": {"output_dir": str(out), "choices": {"task": "synthetic"}},
                "mode": "RUN",
                "job": {"num": 0},
            },
            **extra,
        }
    )


def test_recorder_writes_job_json_and_appends_a_resume(tmp_path):
    rec, cfg = RunRecorder(), _job_config(tmp_path)
    for _ in range(2):  # the run, then a resume into the same folder
        rec.on_job_start(cfg)
        rec.on_job_end(cfg, JobReturn(overrides=["seed=3"], status=JobStatus.COMPLETED))
    info = json.loads((tmp_path / "job.json").read_text())
    assert info["run_name"] == "synthetic-gdpo" and info["task"] == "synthetic"
    assert info["seed"] == 3 and info["status"] == "completed"
    assert len(info["invocations"]) == 2
    assert info["wall_s"] == pytest.approx(sum(i["wall_s"] for i in info["invocations"]))


def test_recorder_leaves_a_refused_resume_untouched(tmp_path):
    cfg = _job_config(tmp_path, resume=str(tmp_path))
    ret = JobReturn(overrides=[], status=JobStatus.FAILED, _return_value=ValueError("refused"))
    RunRecorder().on_job_end(cfg, ret)
    assert list(tmp_path.iterdir()) == []
    # a failed new run is recorded, with its error
    RunRecorder().on_job_end(_job_config(tmp_path), ret)
    info = json.loads((tmp_path / "job.json").read_text())
    assert info["status"] == "failed" and "refused" in info["error"]


def test_recorder_writes_beside_the_metrics_when_output_dir_is_overridden(tmp_path):
    metrics_dir = tmp_path / "elsewhere"
    metrics_dir.mkdir()
    cfg = _job_config(tmp_path, paths={"output_dir": str(metrics_dir)})
    RunRecorder().on_job_end(cfg, JobReturn(overrides=[], status=JobStatus.COMPLETED))
    assert (metrics_dir / "job.json").is_file() and not (tmp_path / "job.json").exists()
