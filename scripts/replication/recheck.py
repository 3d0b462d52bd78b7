"""Some of a finished replication's jobs run again at the current code (``--recheck``).

A report names the commit its runs were made at. When ``src/`` has changed since (a refactor
that should change no number), rerunning every job costs hours; rerunning a sample and
comparing every logged value with the first runs says whether the report still describes what
this code does. The sample: every RL job of seed 0 (each method at each K or cell, from the
same warm starts as the first runs) and the warm-start passes that took under
``SFT_LIMIT_S``. The reruns go to ``<run folder>/recheck/`` (emptied first), the comparison to
``recheck.json``, and the report says what it found.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from mrtpo.evaluate.analysis.runs import read_metrics, source_commit, write_file
from replication.harness import largest_difference
from replication.jobs import Job, run_all

#: A warm-start pass is rerun when its first run took less than this (seconds).
SFT_LIMIT_S = 150.0


def sample(jobs: list[Job]) -> list[Job]:
    """Seed 0's RL jobs and the cheap warm-start passes among ``jobs`` that finished."""
    picked = []
    for job in jobs:
        done = job.out / "job.json"
        if not done.exists():
            continue
        first = json.loads(done.read_text())
        if first.get("error") or not first.get("csv"):
            continue
        rl = job.key.endswith("/s0")
        if rl or (not re.search(r"/s\d+$", job.key) and (first.get("wall_s") or 1e9) < SFT_LIMIT_S):
            picked.append(job)
    return picked


def elsewhere(job: Job, root: Path) -> Job:
    """``job`` writing under ``root`` instead of its own folder (every override that names a
    path inside that folder, e.g. the SFT policy's, moves with it); it waits for nothing."""
    out = root / re.sub(r"[^A-Za-z0-9_.-]+", "_", job.key)
    own = str(job.out)

    def moved(o: str) -> str:
        key, _, value = o.partition("=")
        inside = value == own or value.startswith(own + "/")
        return f"{key}={out}{value[len(own) :]}" if inside else o

    ov = [moved(o) for o in job.overrides]
    return replace(job, key=f"{job.key}/recheck", overrides=ov, out=out, after=())


def compare(a: str | Path, b: str | Path) -> dict[str, Any]:
    """Two runs' logged values compared row by row (``harness.largest_difference``)."""
    ra, rb = read_metrics(a), read_metrics(b)
    return {"rows": len(ra), "rows_again": len(rb), **largest_difference(zip(ra, rb))}


def recheck(jobs: list[Job], logdir: Path, workers: int, threads: int, console) -> dict:
    """Rerun ``sample(jobs)`` under ``logdir/recheck`` and write ``logdir/recheck.json``."""
    root = logdir / "recheck"
    if root.is_symlink():
        raise ValueError(f"{root} is a link; remove it (the recheck writes only a real folder)")
    shutil.rmtree(root, ignore_errors=True)
    picked = sample(jobs)
    again = [elsewhere(j, root) for j in picked]
    res = run_all(again, workers, threads, console, f"Recheck ({len(again)} jobs at this code)")
    rows = []
    for job, rerun in zip(picked, again, strict=True):
        first = json.loads((job.out / "job.json").read_text())["csv"]
        got = res.get(rerun.key, {})
        if got.get("error") or not got.get("csv"):
            rows.append({"key": job.key, "error": str(got.get("error") or "no metrics.csv")})
        else:
            rows.append({"key": job.key, **compare(first, got["csv"])})
    out = {"commit": source_commit(), "jobs": rows}
    write_file(logdir / "recheck.json", json.dumps(out, indent=2))  # never through a link
    return out


def summary(logdir: Path | None, runs_commit: str | None) -> list[str]:
    """The report's paragraph on ``recheck.json`` (no lines when there is none)."""
    path = logdir / "recheck.json" if logdir else None
    if path is None or not path.exists():
        return []
    d = json.loads(path.read_text())
    jobs = d["jobs"]
    bad = [
        j for j in jobs if j.get("error") or j["max_abs_diff"] != 0 or j["rows"] != j["rows_again"]
    ]
    values = sum(j.get("values", 0) for j in jobs)
    head = (
        f"**Rechecked at commit `{d['commit']}`** (runs from `{runs_commit}`): {len(jobs)} of "
        "the jobs (every method's seed 0 at each K or cell, and the warm-start passes under "
        f"{SFT_LIMIT_S:.0f} s) were run again at that code"
    )
    if not bad:
        return [f"{head}; all {values} logged values (timing columns aside) are identical.", ""]
    lines = [f"{head}; {len(jobs) - len(bad)} gave identical values, these did not:", ""]
    for j in bad:
        what = j.get("error") or (
            f"largest difference {j['max_abs_diff']:.3g} (`{j['column']}`), rows "
            f"{j['rows']} then {j['rows_again']}"
        )
        lines.append(f"- `{j['key']}`: {what}")
    return [*lines, ""]
