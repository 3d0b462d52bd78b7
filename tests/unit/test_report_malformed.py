"""The report tools on a malformed metrics.csv and hostile metric names (issue 47, item 14).

A cell over csv's 131,072-character limit and a row longer than the header gave tracebacks in
``src/report.py`` and ``RunResult.history()``; an extra metric named with a newline split
report.md's table header; a 5,000-character name stopped the report ("File name too long");
names that clean to the same file name shared one PNG. Now the bad column (or row) is left out
and named in one line, names are written on one line, and each metric gets its own PNG.
Hand-made run folders as Lightning and Hydra write them; the real report code.
"""

from __future__ import annotations

import csv
import logging
import re

from tests.unit.test_report_faults import DONE, make_job

from mrtpo.api import RunResult
from mrtpo.evaluate.analysis.jobs import find_runs
from mrtpo.evaluate.analysis.report import main, report
from mrtpo.evaluate.analysis.runs import read_metrics

HUGE = 200_000  # characters: past csv's default field limit of 131,072


def _rewrite(folder, edit) -> None:
    """Read ``csv/metrics.csv`` as rows of cells, let ``edit`` change them, write it back."""
    path = folder / "csv" / "metrics.csv"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    edit(rows)
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def _sweep(tmp_path):
    root = tmp_path / "sweep"
    runs = [make_job(root, str(i), "gdpo", i + 1, [0.2 * (i + 1)] * 3, job=DONE) for i in (0, 1)]
    return root, runs


def _add_column(rows, name, values) -> None:
    """A column ``name``: ``values`` in the step rows, empty in the last (another logging call)."""
    rows[0].append(name)
    for i, r in enumerate(rows[1:]):
        r.append(values[i] if i < len(values) else "")


def _table_header_ok(text: str) -> None:
    """Every markdown table line opens and closes a row on its own line."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            head = lines[i - 1]
            assert head.startswith("| ") and head.endswith(" |"), head
            assert head.count(" | ") + 1 == line.count("---|"), (head, line)


def test_a_cell_past_the_csv_limit_leaves_its_column_out_named(tmp_path, capsys, caplog):
    root, (first, _) = _sweep(tmp_path)
    col = "train/reward/first/mean"

    def huge(rows):
        rows[2][rows[0].index(col)] = "9" * 10 + "x" * HUGE

    _rewrite(first, huge)
    assert main([str(root), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert f"Warning: {first / 'csv' / 'metrics.csv'}: column '{col}'" in out
    assert f"line 3: {10 + HUGE:,} characters" in out and "left out" in out
    assert "| (all runs) | 2 | 3 | 0.300 ± 1.271 | 0.400 (n=1) |" in out  # 'first': seed 2 only
    caplog.set_level(logging.WARNING, logger="mrtpo.api")
    rows = RunResult(first).history()
    assert len(rows) == 4 and all(col not in r for r in rows) and rows[0]["train/success"] == 0.2
    assert any(f"column '{col}'" in r.getMessage() for r in caplog.records)


def test_a_row_longer_than_the_header_is_left_out_named(tmp_path, capsys, caplog):
    root, (first, _) = _sweep(tmp_path)
    _rewrite(first, lambda rows: rows.insert(2, [*rows[1], "7", "8"]))
    assert main([str(root), "--no-plots"]) == 0
    out = capsys.readouterr().out
    metrics = first / "csv" / "metrics.csv"
    assert f"Warning: {metrics}: line 3 has 8 cells for the header's 6 columns" in out
    caplog.set_level(logging.WARNING, logger="mrtpo.api")
    rows = RunResult(first).history()
    assert len(rows) == 4 and all(None not in r for r in rows)
    assert any("line 3 has 8 cells" in r.getMessage() for r in caplog.records)
    assert len(read_metrics(metrics)) == 4


def test_an_extra_named_with_a_newline_stays_in_its_header_cell(tmp_path, capsys):
    root, runs = _sweep(tmp_path)
    for run in runs:
        _rewrite(run, lambda rows: _add_column(rows, "train/extra/first/bad\nname", ["1"] * 3))
    out = tmp_path / "out"
    assert main([str(root), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    _table_header_ok(text)
    assert "extra/first/bad\\nname" in text
    assert not [line for line in text.splitlines() if line.startswith("name")]


def test_a_5000_character_extra_name_is_shortened_not_a_stop(tmp_path, capsys):
    root, runs = _sweep(tmp_path)
    name = "train/extra/first/" + "n" * 5000
    for run in runs:
        _rewrite(run, lambda rows: _add_column(rows, name, ["0.5"] * 3))
    out = tmp_path / "out"
    assert main([str(root), "--out", str(out)]) == 0, capsys.readouterr().out
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 3 and all(len(p.encode()) <= 128 for p in pngs), pngs
    text = (out / "report.md").read_text()
    _table_header_ok(text)
    assert "n" * 5000 not in text and max(map(len, text.splitlines())) < 2000


def test_names_that_clean_to_the_same_string_get_a_png_each(tmp_path):
    root, runs = _sweep(tmp_path)
    names = ["train/extra/first/a b", "train/extra/first/a_b", "train/extra/first/a/b"]
    for run in runs:
        for name in names:
            _rewrite(run, lambda rows, name=name: _add_column(rows, name, ["0.5"] * 3))
    rep = report(find_runs([root]), tmp_path / "out")
    files = sorted(p.name for p in rep.figures)
    assert len(files) == len(set(files)) == 5 and all(p.is_file() for p in rep.figures)
    # a name no other cleans to keeps its plain file name; the three others get a hash each
    assert files[-2:] == ["curves_first.png", "curves_success.png"]
    assert all(re.fullmatch(r"curves_extra_first_a_b-[0-9a-f]{8}\.png", f) for f in files[:3])
    for f in files:
        assert f"[{f}]({f})" in rep.text


def test_a_last_line_cut_by_a_kill_costs_that_row_not_the_column(tmp_path):
    """A writer killed mid-line leaves a cell such as ``0.2e-``: only that row goes."""
    _, (first, _) = _sweep(tmp_path)
    metrics = first / "csv" / "metrics.csv"
    with open(metrics, "a", newline="") as f:
        f.write("0,9,0.2e-")
    warnings: list[str] = []
    rows = read_metrics(metrics, warnings)
    assert len(rows) == 4 and all("train/success" in r for r in rows[:3])
    assert warnings == [f"{metrics}: line 6 is incomplete (a killed writer?); left out"]


def test_an_override_with_a_newline_stays_on_the_evaluation_report_line(tmp_path):
    import json

    from mrtpo.evaluate.analysis.summary import write_summary

    root = tmp_path / "evals"
    for i in (0, 1):
        job = root / str(i)
        job.mkdir(parents=True)
        info = {**DONE, "overrides": ["eval.split=a\nb", f"seed={i}"], "job_num": i}
        (job / "job.json").write_text(json.dumps(info))
        (job / "metrics.json").write_text(json.dumps({"exact_match": 0.5}))
    text = report(find_runs([root]), None).text
    assert "Every job: `eval.split=a\\nb`." in text
    md = write_summary(root)[1].read_text()
    assert "Every job: `eval.split=a\\nb`." in md and "\nb`" not in md
