"""src/table.py: one command per paper table, on the tiny model (generation kept short)."""

from __future__ import annotations

import csv
import json

import pytest
from tests.conftest import SHARED_DATA, compose_config
from tests.task_fixtures import make_spider

from mrtpo.evaluate import tables
from mrtpo.evaluate.job import run

SHORT = ["eval.limit=2", "rollout.sampling.max_new_tokens=8"]


def _paths(cache_dir, data_dir):
    return [f"paths.cache_dir={cache_dir}", f"paths.data_dir={data_dir}"]


def _direct(tmp_path, cache_dir, data_dir, split, *extra):
    """The same split through eval.py's job, as a researcher would run it by hand."""
    out = tmp_path / "direct" / split
    overrides = [
        "task=text2sql",
        f"eval.split={split}",
        f"eval.output={out}",
        f"paths.output_dir={out}",
        *_paths(cache_dir, data_dir),
        *SHORT,
        *extra,
    ]
    metrics = run(compose_config("eval.yaml", overrides), overrides=overrides)
    return metrics, out


def _table(tmp_path, family, folders, cache_dir, data_dir):
    out = tmp_path / "table"
    argv = [family, *map(str, folders), "--out", str(out)]
    for o in [*_paths(cache_dir, data_dir), *SHORT]:
        argv += ["--set", o]
    assert tables.main(argv) == 0
    return out


def _count_policy_loads(monkeypatch) -> list[str]:
    """The model folders the real loader is asked for from now on (it still loads them)."""
    import mrtpo.core.models

    loads: list[str] = []
    real = mrtpo.core.models.load_policy

    def counted(name_or_path, *args, **kwargs):
        loads.append(str(name_or_path))
        return real(name_or_path, *args, **kwargs)

    monkeypatch.setattr(mrtpo.core.models, "load_policy", counted)
    return loads


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_text2sql_table_equals_eval_runs_and_lists_absent(tmp_path, cache_dir):
    """Fixture data (Spider dev only): dev is scored as eval.py scores it, the five other
    splits are listed as absent, and the CSV holds one row per benchmark scored + average."""
    data = make_spider(tmp_path / "data")
    direct, direct_out = _direct(tmp_path, cache_dir, data, "spider_dev")
    tiny = cache_dir / "models" / "tiny-qwen2"
    out = _table(tmp_path, "text2sql", [tiny, tiny], cache_dir, data)
    md = (out / "table.md").read_text()
    for column in ("Spider test", "Spider-Syn", "Spider-Realistic", "Spider-DK", "BIRD dev"):
        assert f"- {column} (" in md and "absent" in md.split(f"- {column} (")[1].split("\n")[0]
    recs = _rows(out / "table.csv")
    assert {r["benchmark"] for r in recs} == {"Spider dev", "average"}
    dev = next(r for r in recs if r["benchmark"] == "Spider dev")
    assert float(dev["mean"]) == pytest.approx(direct["exec_acc"])
    assert json.loads(dev["values"]) == [direct["exec_acc"]] * 2
    table_rows = (out / "evals" / "00_tiny-qwen2" / "spider_dev" / "results.jsonl").read_text()
    assert table_rows == (direct_out / "results.jsonl").read_text()


def test_text2sql_table_on_public_data(tmp_path, cache_dir, monkeypatch):
    """Every text-to-SQL split present under ../shared/data is scored (equal to its own eval
    run) with the policy loaded once, every missing one listed as absent."""
    if not (SHARED_DATA / "spider" / "dev.json").is_file():
        pytest.skip(f"public Spider files not found under {SHARED_DATA}")
    tiny = cache_dir / "models" / "tiny-qwen2"
    direct = {}
    for bench in tables.FAMILIES["text2sql"]:
        try:
            direct[bench.column] = _direct(tmp_path, cache_dir, SHARED_DATA, bench.split)[0]
        except FileNotFoundError:
            continue
    loads = _count_policy_loads(monkeypatch)
    out = _table(tmp_path, "text2sql", [tiny], cache_dir, SHARED_DATA)
    assert len(direct) >= 2 and len(loads) == 1, (list(direct), loads)  # not one per split
    recs = {r["benchmark"]: r for r in _rows(out / "table.csv")}
    assert set(recs) == {*direct, "average"}
    for column, metrics in direct.items():
        assert float(recs[column]["mean"]) == pytest.approx(metrics["exec_acc"])
    md = (out / "table.md").read_text()
    for bench in tables.FAMILIES["text2sql"]:
        if bench.column not in direct:
            assert f"- {bench.column} ({bench.split}): absent" in md


def test_unknown_family_and_missing_folder_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="unknown task family 'sqll'"):
        tables.main(["sqll", str(tmp_path)])
    with pytest.raises(SystemExit, match="no such folder"):
        tables.main(["text2sql", str(tmp_path / "nope")])
