"""A text-to-SQL sweep (two methods x two seeds, two steps each on the tiny model and the
fixture Spider data): src/report.py compares it on execution match with intervals, and
src/table.py turns the same folder into the paper's table, one row per method."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.task_fixtures import make_spider

from mrtpo.evaluate import tables
from mrtpo.evaluate.analysis.stats import FINAL_WINDOW, mean_ci

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # four training jobs, then eight evaluations


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": "1"}


def _final(metrics: Path, key: str) -> float:
    with open(metrics, newline="") as f:
        vals = [float(r[key]) for r in csv.DictReader(f) if r.get(key)]
    tail = vals[-FINAL_WINDOW:]
    return sum(tail) / len(tail)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, cache_dir):
    tmp = tmp_path_factory.mktemp("t2s_sweep")
    data = make_spider(tmp / "data")
    logs = tmp / "logs"
    cmd = [sys.executable, "src/train.py", "-m", "task=text2sql", "method=gdpo,mrtpo",
           "seed=1,2", "trainer.max_steps=2", f"paths.log_dir={logs}",
           f"paths.cache_dir={cache_dir}", f"paths.data_dir={data}", "rl.prompts_per_step=2",
           "rl.group_size=2", "rollout.sampling.max_new_tokens=8", "callbacks.sample_table=null",
           "callbacks.relevance_dump=null", "hydra/launcher=basic"]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    (folder,) = (logs / "train" / "multiruns").iterdir()
    return folder, data


def test_report_compares_text2sql_runs_on_execution(sweep):
    folder, _ = sweep
    rep = subprocess.run(
        [sys.executable, "src/report.py", str(folder), "--no-plots"],
        cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-2000:]
    final = rep.stdout.split("## Final")[1].split("## Best")[0]
    head = next(line for line in final.splitlines() if line.startswith("| group"))
    assert head.split("|")[4].strip() == "execution"  # the headline comes first
    runs = sorted(p.parent.parent for p in folder.rglob("csv/metrics.csv"))
    for method in ("gdpo", "mrtpo"):
        own = [r for r in runs if json.loads((r / "job.json").read_text())["method"] == method]
        iv = mean_ci([_final(r / "csv/metrics.csv", "train/reward/execution/mean") for r in own])
        line = re.search(rf"^\| method={method} \| 2 \| 2 \| (\S+) ± (\S+) \|", final, re.M)
        assert line, final
        assert (float(line[1]), float(line[2])) == (round(iv.mean, 3), round(iv.half, 3))


def test_table_of_a_sweep_has_a_row_per_method(sweep, tmp_path, cache_dir):
    folder, data = sweep
    out = tmp_path / "table"
    sets = [f"paths.cache_dir={cache_dir}", f"paths.data_dir={data}", "eval.limit=2",
            "rollout.sampling.max_new_tokens=8"]  # fmt: skip
    argv = ["text2sql", str(folder), "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    assert tables.main(argv) == 0
    with open(out / "table.csv", newline="") as f:
        recs = list(csv.DictReader(f))
    dev = {r["method"]: r for r in recs if r["benchmark"] == "Spider dev"}
    assert set(dev) == {"method=gdpo", "method=mrtpo"}
    assert all(int(r["n"]) == 2 for r in dev.values())
    for r in dev.values():
        vals = json.loads(r["values"])
        assert float(r["mean"]) == pytest.approx(sum(vals) / 2)
    md = (out / "table.md").read_text()
    assert "| method=gdpo | 1, 2 |" in md and "Spider-DK (spider_dk): absent" in md
