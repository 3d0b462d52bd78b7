"""src/table.py on what a hostile pass gave it (issue 37, cases 2 and 12): a table in which no
cell could be scored, and table.md / table.csv planted as symlinks to a user's file."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
from tests.task_fixtures import make_spider

from mrtpo.evaluate import tables


def test_no_cell_scored_exits_non_zero_with_one_line(tmp_path, cache_dir, capsys):
    """A policy folder whose model cannot load: the one split with data fails, the others
    are absent; the table is still written (it lists why), and the exit status says so."""
    data = make_spider(tmp_path / "data")
    broken = tmp_path / "broken-policy"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    out = tmp_path / "table"
    argv = ["text2sql", str(broken), "--out", str(out), "--set", f"paths.data_dir={data}",
            "--set", f"paths.cache_dir={cache_dir}", "--set", "eval.limit=2"]  # fmt: skip
    assert tables.main(argv) == 1
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == (
        f"error: no benchmark was scored (1 failed, 5 absent, 0 skipped of 6 cells): see "
        f"'Not scored' in {out / 'table.md'}"
    )
    md = (out / "table.md").read_text()
    assert "Spider dev (spider_dev): failed for" in md and "cannot load the model" in md


def _table() -> tables.Table:
    """A scored table as build() leaves it: two seeds of one policy, one benchmark scored."""
    benches = tables.FAMILIES["toolcall"]
    sources = [tables.Source(Path(f"/runs/{s}"), [], ("method=mrtpo",), str(s)) for s in (1, 2)]
    t = tables.Table("toolcall", benches, sources)
    for i, v in enumerate((0.5, 0.7)):
        t.cells[i, 0] = tables.Cell(value=v)
        t.cells[i, 1] = tables.Cell(status="absent", reason="no BFCL live data")
    return t


def test_outputs_planted_as_symlinks_are_refused_and_their_targets_left_alone(tmp_path):
    out = tmp_path / "table"
    out.mkdir()
    user = tmp_path / "precious.txt"
    user.write_text("mine\n")
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    for name in ("table.md", "table.csv"):
        (out / name).symlink_to(user)
        # refused before anything is evaluated, and by the writer itself
        with pytest.raises(SystemExit, match=f"error: refusing to write {out / name}: it is a "):
            tables.main(["toolcall", str(policy), "--out", str(out)])
        with pytest.raises(ValueError, match=f"refusing to write {out / name}: it is a symbolic"):
            tables.write(_table(), out)
        assert user.read_text() == "mine\n" and not (out / "evals").exists()
        assert [p.name for p in out.iterdir()] == [name]  # nothing else written either
        (out / name).unlink()
    md, path_csv = tables.write(_table(), out)
    recs = list(csv.DictReader(io.StringIO(path_csv.read_text())))
    assert recs[0]["benchmark"] == "BFCL Non-Live" and float(recs[0]["mean"]) == pytest.approx(0.6)
    assert "| method=mrtpo | 1, 2 | 0.600 ± 1.271 |" in md.read_text()
