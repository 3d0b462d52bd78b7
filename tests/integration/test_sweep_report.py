"""The acceptance check of comparing runs: a real Hydra multirun of the entry point (two
methods × two seeds, two steps each) leaves summary.csv / summary.md and a job.json per job,
and ``src/report.py`` on that folder prints mean ± interval per method and writes the PNGs.
About 15 s on one CPU thread."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mrtpo.evaluate.analysis.stats import FINAL_WINDOW, mean_ci

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": "1"}


def _final_success(metrics: Path) -> float:
    """The mean of the last steps' success, read straight from the CSV."""
    with open(metrics, newline="") as f:
        vals = [float(r["train/success"]) for r in csv.DictReader(f) if r["train/success"]]
    tail = vals[-FINAL_WINDOW:]
    return sum(tail) / len(tail)


def test_multirun_summary_then_report(tmp_path, cache_dir):
    logs = tmp_path / "logs"
    cmd = [sys.executable, "src/train.py", "-m", "method=gdpo,mrtpo", "seed=1,2",
           "trainer.max_steps=2", f"paths.log_dir={logs}", f"paths.cache_dir={cache_dir}",
           "rl.prompts_per_step=2", "rl.group_size=2", "rollout.sampling.max_new_tokens=4",
           "callbacks.sample_table=null", "callbacks.relevance_dump=null",
           "callbacks.model_checkpoint=null", "hydra/launcher=basic",
           f"model.name_or_path={cache_dir}/models/tiny-qwen2"]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    (sweep,) = (logs / "train" / "multiruns").iterdir()
    assert "sweep summary: " in res.stdout
    # a path-valued override names one flat folder per job, not a nest of folders
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 4 and all((j / "csv" / "metrics.csv").is_file() for j in jobs), jobs
    assert all(f"model.name_or_path={str(cache_dir).replace('/', '_')}_" in j.name for j in jobs)

    rows = list(csv.DictReader((sweep / "summary.csv").read_text().splitlines()))
    assert [(r["method"], r["seed"]) for r in rows] == [
        ("gdpo", "1"), ("gdpo", "2"), ("mrtpo", "1"), ("mrtpo", "2")
    ]  # fmt: skip
    assert {r["status"] for r in rows} == {"completed"} and {r["steps"] for r in rows} == {"2"}
    assert all(float(r["wall_s"]) > 0 for r in rows)
    for r in rows:
        assert float(r["success/final"]) == _final_success(sweep / r["run"] / "csv/metrics.csv")
        assert "train/reward" not in r and any(k.endswith("/best") for k in r)
    md = (sweep / "summary.md").read_text()
    assert md.count("| completed | 2 |") == 4 and "`python src/train.py -m method=gdpo,mrtpo" in md

    # each job's own record: the run name resolved, not ${hydra:runtime.choices...}
    jobs = [json.loads((sweep / r["run"] / "job.json").read_text()) for r in rows]
    assert [j["run_name"] for j in jobs] == ["synthetic-gdpo"] * 2 + ["synthetic-mrtpo"] * 2
    assert [j["job_num"] for j in jobs] == [0, 1, 2, 3]
    assert jobs[0]["overrides"][:2] == ["method=gdpo", "seed=1"]

    rep = subprocess.run(
        [sys.executable, "src/report.py", str(sweep), "--baseline", "method=gdpo"],
        cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert rep.returncode == 0, rep.stderr[-3000:]
    final = rep.stdout.split("## Final")[1].split("## Best")[0]
    for method in ("gdpo", "mrtpo"):
        vals = [_final_success(sweep / r["run"] / "csv/metrics.csv") for r in rows
                if r["method"] == method]  # fmt: skip
        iv = mean_ci(vals)
        line = re.search(rf"^\| method={method} \| 2 \| 2 \| (\S+) ± (\S+) \|", final, re.M)
        assert line, final
        assert (float(line[1]), float(line[2])) == (round(iv.mean, 3), round(iv.half, 3))
    assert "| method=mrtpo | method=gdpo | 2 |" in rep.stdout
    pngs = sorted(p.name for p in sweep.glob("curves_*.png"))
    assert "curves_success.png" in pngs and len(pngs) >= 2  # success and each reward
    assert all((sweep / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    assert (sweep / "report.md").is_file()
