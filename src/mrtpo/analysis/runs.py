"""Reading what training runs wrote: Lightning's ``metrics.csv`` and the JSON-lines dumps."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import re
import subprocess
from pathlib import Path

#: the project root of a source checkout (src/mrtpo/analysis/runs.py -> <root>)
ROOT = Path(__file__).resolve().parents[3]


def source_commit(root: Path = ROOT) -> str:
    """Short hash of HEAD, with ``+dirty`` when ``configs/``, ``src/`` or ``scripts/`` (the
    harnesses) have uncommitted changes, untracked files included: what a reader needs to
    rerun the same code."""
    try:

        def git(*a: str) -> str:
            return subprocess.run(
                ["git", *a], cwd=root, capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()

        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "configs", "src", "scripts")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a Lightning metrics.csv, numbers only (empty cells dropped: Lightning writes one
    row per logging call, so most cells of a row are empty)."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = {}
            for k, v in r.items():
                if v not in ("", None):
                    with contextlib.suppress(ValueError):
                        row[k] = float(v)
            rows.append(row)
    return rows


#: A row of an RL step: every task logs the summed reward; ``train/success`` only a task with
#: a success check (synthetic, a custom task with ``task.success``).
STEP_KEYS = ("train/success", "train/reward/total/mean")


def _step_rows(path: str | Path) -> list[dict[str, float]]:
    rows = [r for r in read_metrics(path) if any(k in r for k in STEP_KEYS)]
    rows.sort(key=lambda r: r["step"])
    return rows


def rl_curves(path: str | Path) -> dict[str, list[float]]:
    """Per-step series of an RL run: ``success`` (where the task logs it) and each reward's
    mean, by reward name."""
    rows = _step_rows(path)
    out: dict[str, list[float]] = {}
    if any("train/success" in r for r in rows):
        out["success"] = [r.get("train/success", math.nan) for r in rows]
    for k in rows[0] if rows else {}:
        m = re.fullmatch(r"train/reward/(.+)/mean", k)
        if m and m.group(1) != "total":
            out[m.group(1)] = [r.get(k, math.nan) for r in rows]
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a JSON-lines file (``samples.jsonl``, ``relevance.jsonl``); [] if absent."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


#: Per-step replay metrics of a run, by the name ``run_series`` gives them.
REPLAY_KEYS = {
    "train/replay/share": "replay/share",  # share of candidate (response, reward) pairs replayed
    "train/time/replay_share": "time/replay_share",  # share of the step's time spent replaying
}


def run_series(path: str | Path) -> dict[str, list[float]]:
    """``rl_curves`` plus what replay cost and found, per step: ``replay/share``,
    ``time/replay_share`` and ``replay/top80/<reward>`` (share of a response's tokens holding
    80% of that reward's relevance). NaN where a step did not log it (GDPO never replays)."""
    rows = _step_rows(path)
    out = rl_curves(path)
    keys = {k for r in rows for k in r}
    for col, name in REPLAY_KEYS.items():
        if col in keys:
            out[name] = [r.get(col, math.nan) for r in rows]
    for col in sorted(keys):
        m = re.fullmatch(r"train/replay/top80_token_share/(.+)", col)
        if m:
            out[f"replay/top80/{m.group(1)}"] = [r.get(col, math.nan) for r in rows]
    return out
