"""src/eval.py -m: one flat folder per job (a responses path does not nest folders), and a
summary of the eval metrics with the eval command line (not training columns)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from hydra.utils import instantiate
from tests.conftest import compose_config

ROOT = Path(__file__).resolve().parents[2]


def test_eval_sweep_summary(tmp_path, cache_dir):
    task = instantiate(compose_config("eval.yaml", [f"paths.cache_dir={cache_dir}"]).task)
    ex = task.examples("val")[:2]
    preds = {}
    for name, text in (("good", ex[0].reference), ("bad", "")):
        path = tmp_path / "preds" / name / "p.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps({"id": e.id, "response": text}) + "\n" for e in ex))
        preds[name] = path
    logs = tmp_path / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, "src/eval.py", "-m", f"eval.responses={preds['good']},{preds['bad']}",
         "eval.limit=2", f"paths.log_dir={logs}", f"paths.cache_dir={cache_dir}",
         "hydra/launcher=basic"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (sweep,) = (logs / "eval" / "multiruns").iterdir()
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 2 and all((j / "metrics.json").is_file() for j in jobs)  # not nested
    rows = list(csv.DictReader((sweep / "summary.csv").read_text().splitlines()))
    assert [r["split"] for r in rows] == ["val", "val"]
    assert [float(r["success"]) for r in rows] == [
        json.loads((j / "metrics.json").read_text())["success"] for j in jobs
    ]
    md = (sweep / "summary.md").read_text()
    assert "`python src/eval.py -m eval.responses=" in md and "success" in md
    assert "steps" not in md and "src/train.py" not in md
    rep = subprocess.run([sys.executable, "src/report.py", str(sweep), "--no-plots"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-2000:]
    assert "2 evaluations in 2 groups" in rep.stdout and "| group | jobs | success |" in rep.stdout
