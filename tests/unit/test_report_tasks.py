"""src/report.py on runs of tasks without a success check (text-to-SQL, tool calling,
instruction following): hand-made metrics.csv files, the headline first, --metric."""

from __future__ import annotations

import csv
import json

import pytest

from mrtpo.evaluate.analysis.jobs import find_runs, metric_names
from mrtpo.evaluate.analysis.report import main, report
from mrtpo.evaluate.analysis.stats import mean_ci

HEAD = ["step", "train/reward/format/mean", "train/reward/execution/mean",
        "train/reward/total/mean"]  # fmt: skip


def _run(folder, method, seed, execution):
    (folder / "csv").mkdir(parents=True)
    with open(folder / "csv" / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEAD)
        for step, e in enumerate(execution):
            w.writerow([step, 1.0, e, 1.0 + e])
    job = {"overrides": [f"method={method}", f"seed={seed}"], "seed": seed, "status": "completed"}
    (folder / "job.json").write_text(json.dumps(job))


def _sweep(tmp_path):
    vals = {("gdpo", 1): [0.0, 0.2], ("gdpo", 2): [0.2, 0.4], ("mrtpo", 1): [0.2, 0.6],
            ("mrtpo", 2): [0.4, 0.8]}  # fmt: skip
    for i, ((m, s), v) in enumerate(vals.items()):
        _run(tmp_path / f"{i}", m, s, v)
    return vals


def test_text2sql_runs_are_compared_on_execution(tmp_path):
    vals = _sweep(tmp_path)
    runs = find_runs([tmp_path])
    assert [r.steps for r in runs] == [2] * 4
    assert metric_names(runs) == ["execution", "format"]
    text = report(runs, plots=False).text
    final = text.split("## Final")[1].split("## Best")[0]
    assert "| group | seeds | steps | execution | format |" in final
    for m in ("gdpo", "mrtpo"):
        iv = mean_ci([sum(v) / len(v) for (mm, _), v in vals.items() if mm == m])
        assert f"| method={m} | 2 | 2 | {iv.mean:.3f} ± {iv.half:.3f} |" in final


def test_metric_option_names_the_columns(tmp_path, capsys):
    _sweep(tmp_path)
    assert main([str(tmp_path), "--no-plots", "--metric", "format"]) == 0
    out = capsys.readouterr().out
    assert "| group | seeds | steps | format |" in out and "execution" not in out
    assert main([str(tmp_path), "--no-plots", "--metric", "exec_acc"]) == 2
    assert "--metric exec_acc: not logged by these runs; they log format, execution" in (
        capsys.readouterr().out
    )


def test_no_step_rows_is_still_refused(tmp_path):
    (tmp_path / "r" / "csv").mkdir(parents=True)
    (tmp_path / "r" / "csv" / "metrics.csv").write_text("step,val/loss\n0,1.0\n")
    with pytest.raises(ValueError, match="hold no train/reward rows"):
        report(find_runs([tmp_path]), plots=False)
