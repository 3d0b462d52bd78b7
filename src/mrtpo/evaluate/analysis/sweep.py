"""Comparing runs: a record of every job, the summary of a sweep, and ``src/report.py``.

Three pieces, all reading what runs already write (``csv/metrics.csv``, ``.hydra/``):

- ``RunRecorder`` (a Hydra callback, ``hydra.callbacks`` in configs/hydra/default.yaml) writes
  ``job.json`` beside each job's metrics — the resolved ``run_name``, task / method / model,
  seed, overrides, status and wall time, which ``.hydra/config.yaml`` leaves unresolved — and,
  in a multirun, rewrites ``summary.csv`` and ``summary.md`` of the sweep folder after every
  job and once more at the end (a failed job makes Hydra stop before ``on_multirun_end``, so
  the summary is never missing the jobs that did finish).
- ``find_runs`` / ``group_runs``: run folders under any folders or globs, grouped by their
  overrides minus the seed and the plumbing (paths, callbacks, loggers).
- ``report``: per group, the mean ± t interval over seeds of each reward's and success's final
  and best value, paired differences by seed against a ``--baseline`` group, and one
  learning-curve PNG per metric (mean over seeds with its band).

"final" is the mean of the last ``FINAL_WINDOW`` steps and "best" the highest
``SMOOTH``-step moving average (the toy replication's definitions): one step's value is a
mean over a handful of sampled responses, too noisy to report on its own. The statistics are
``mrtpo.evaluate.analysis.stats``; the metrics reader is ``mrtpo.evaluate.analysis.runs``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import hashlib
import io
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mrtpo.evaluate.analysis.runs import check_output, read_metrics, rl_curves, write_file
from mrtpo.evaluate.analysis.stats import (
    FINAL_WINDOW,
    SMOOTH,
    Interval,
    finite,
    intervals,
    mean_ci,
    paired_interval,
    smooth,
)
from mrtpo.safe_files import pid_alive as _alive

log = logging.getLogger(__name__)

#: Written by each job beside its metrics (``run.json`` is taken: the replication's log folder).
RUN_JSON = "job.json"
METRICS = Path("csv") / "metrics.csv"
#: Override keys that change where and how a run is recorded, not what it learns: left out of
#: the groups (a sweep repeated with another ``paths.log_dir`` is the same experiment).
PLUMBING_PREFIXES = ("paths.", "hydra.", "callbacks.", "logger.")
PLUMBING_KEYS = frozenset({"logger", "callbacks", "ckpt_path", "resume", "print_config"})
SEED = "seed"


# ---------------------------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------------------------


def override_key(override: str) -> str:
    """``+a.b=1`` / ``++a.b=1`` / ``a.b=1`` -> ``a.b``; ``~a.b`` stays ``~a.b``."""
    return override.split("=", 1)[0].lstrip("+")


def is_plumbing(key: str) -> bool:
    return key in PLUMBING_KEYS or key.startswith(PLUMBING_PREFIXES)


def experiment_overrides(overrides: Iterable[str]) -> tuple[str, ...]:
    """The overrides that define what a run learns, minus the seed: a group's key.

    The last override of a key wins (as in Hydra), and the result is sorted so that the order
    they were typed in does not split a group.
    """
    by_key: dict[str, str] = {}
    for o in overrides:
        k = override_key(o)
        if k != SEED and not is_plumbing(k):
            by_key[k] = f"{k}={o.split('=', 1)[1]}" if "=" in o else o
    return tuple(sorted(by_key.values()))


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run folder: what it was started with and what it logged."""

    path: Path
    overrides: list[str] | None  # None: the folder records none (a run composed in code)
    seed: str | None
    status: str | None  # "completed" / "failed" from job.json; None when unknown
    wall_s: float | None
    run_name: str | None
    curves: dict[str, list[float]] = field(default_factory=dict)
    job_num: int | None = None
    error: str | None = None
    max_steps: int | None = None  # trainer.max_steps it was last started with (None: unknown)
    warnings: list[str] = field(default_factory=list)  # what of its records was ignored, why

    @property
    def steps(self) -> int:
        return max((len(c) for c in self.curves.values()), default=0)

    @property
    def incomplete(self) -> bool:
        """Short of ``trainer.max_steps`` and not recorded as completed: still running, or
        stopped (killed, interrupted) before its last step."""
        done = self.status in ("completed", "failed")
        return not done and self.max_steps is not None and self.steps < self.max_steps

    @property
    def progress(self) -> str:
        """Whether an incomplete run is still running: its ``run.lock`` names the process
        that holds the folder while it runs (the file goes when the run ends), alive on this
        machine; else it stopped (killed, or interrupted) before its last step."""
        holder = _lock_holder(self.path)
        if holder is None:
            return "stopped before its last step"
        pid, host = holder
        if host != _HOST:
            return f"running on {host} (process {pid}), or stopped there"
        return f"still running (process {pid})" if _alive(pid) else "stopped (its process died)"

    @property
    def group(self) -> tuple[str, ...]:
        """Its overrides minus seed and plumbing; a run that recorded none (no job.json, no
        .hydra/) is grouped with the other runs of its parent folder (``<method>/s<seed>``)."""
        if self.overrides is None:
            return (f"folder={self.path.parent}",)
        return experiment_overrides(self.overrides)

    @property
    def seed_key(self) -> str:
        """What pairs runs across groups: the seed, or (unknown) the run's own folder, which
        pairs with nothing."""
        return self.seed if self.seed is not None else f"?{self.path}"

    def final_best(self, metric: str) -> tuple[float, float]:
        return final_best(self.curves.get(metric, []))


_HOST = socket.gethostname()


def _lock_holder(folder: Path) -> tuple[int, str] | None:
    """(pid, host) that ``run.lock`` of a run folder names (None: no holder recorded)."""
    try:
        info = json.loads((folder / "run.lock").read_text(encoding="utf-8"))
        return int(info["pid"]), str(info["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def final_best(curve: Sequence[float]) -> tuple[float, float]:
    """(mean of the last ``FINAL_WINDOW`` steps, highest ``SMOOTH``-step moving average) over
    the steps where the metric is finite (NaN: a reward that applied to no response); NaNs
    for a curve without a finite value."""
    v = finite(curve)
    if not v:
        return math.nan, math.nan
    tail = v[-FINAL_WINDOW:]
    return sum(tail) / len(tail), max(smooth(v, SMOOTH))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _saved_overrides(run: Path) -> list[str] | None:
    p = run / ".hydra" / "overrides.yaml"
    if not p.is_file():
        return None
    try:
        return [str(o) for o in OmegaConf.load(p)]
    except Exception:
        return None


def _saved_seed(run: Path) -> str | None:
    p = run / ".hydra" / "config.yaml"
    if not p.is_file():
        return None
    try:
        seed = OmegaConf.load(p).get(SEED)
    except Exception:
        return None
    return None if seed is None else str(seed)


def _saved_setting(run: Path, key: str) -> Any:
    """``key`` of the run's newest start: its latest resume's config
    (``.hydra/resumes/<time>-<pid>/``), else its own; None when unknown."""
    hydra = run / ".hydra"
    resumes = sorted((hydra / "resumes").glob("*/config.yaml"), key=lambda p: p.parent.name)
    for p in [*reversed(resumes), hydra / "config.yaml"]:
        if not p.is_file():
            continue
        try:
            return OmegaConf.select(OmegaConf.load(p), key, default=None)
        except Exception:
            continue
    return None


def _saved_max_steps(run: Path) -> int | None:
    """``trainer.max_steps`` of the run's newest start; None when unknown or not positive."""
    value = _saved_setting(run, "trainer.max_steps")
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def beta_short(run: Path) -> str | None:
    """A note when the run's logged ``train/beta`` never reached its ``method.beta`` (a
    warm-up, ``method.beta_warmup_steps``, longer than the run): its relevance share was
    smaller than the one named, and it differs less from GDPO than the setting says."""
    beta = _saved_setting(run, "method.beta")
    path = run / METRICS
    if not _is_number(beta) or beta <= 0 or not path.is_file():
        return None
    try:
        logged = [r["train/beta"] for r in read_metrics(path) if "train/beta" in r]
    except (OSError, ValueError):
        return None
    top = max((b for b in logged if math.isfinite(b)), default=None)
    if top is None or top >= beta * (1 - 1e-6):
        return None
    warmup = _saved_setting(run, "method.beta_warmup_steps")
    return (
        f"beta never reached method.beta={beta:g} (at most {top:.3g}; method.beta_warmup_steps="
        f"{warmup} is longer than its {len(logged)} steps): {run}"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) and abs(v) < 2**53) or (isinstance(v, float) and math.isfinite(v))


#: The keys of job.json that are read, what each must be, and its name in a warning.
JOB_KEYS = (
    ("overrides", lambda v: isinstance(v, list) and all(isinstance(o, str) for o in v),
     "a list of strings"),
    (SEED, lambda v: isinstance(v, str) or _is_int(v), "a number or a string"),
    ("status", lambda v: isinstance(v, str), "a string"),
    ("wall_s", _is_number, "a number"),
    ("run_name", lambda v: isinstance(v, str), "a string"),
    ("job_num", _is_int, "a whole number"),
    ("error", lambda v: isinstance(v, str), "a string"),
)  # fmt: skip


def _a(value: Any) -> str:
    """``an int``, ``a list``: what a JSON value is, for a message."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def read_job(folder: Path) -> tuple[dict[str, Any], list[str]]:
    """The keys of a run's ``job.json`` that have the right type, and a warning naming the
    file and key for each thing left out (the run is then read from ``.hydra/``, as a run
    without job.json). ({}, []) when the folder holds none."""
    path = folder / RUN_JSON
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, []
    except json.JSONDecodeError as exc:
        return {}, [f"{path}: not valid JSON (line {exc.lineno}: {exc.msg}); ignored"]
    except (OSError, ValueError, RecursionError) as exc:  # a folder, not UTF-8, too deep
        return {}, [f"{path}: cannot be read ({type(exc).__name__}: {exc}); ignored"[:400]]
    if not isinstance(info, dict):
        return {}, [f"{path}: not a JSON object ({_a(info)}); ignored"]
    kept: dict[str, Any] = {}
    warnings = []
    for key, ok, what in JOB_KEYS:
        value = info.get(key)
        if value is None or ok(value):
            kept[key] = value
        else:
            warnings.append(f'{path}: "{key}" is not {what} ({_a(value)}); ignored')
    return kept, warnings


def load_run(folder: str | Path) -> Run:
    """A run folder (one holding ``csv/metrics.csv``): its ``job.json`` when the job wrote one
    (the keys of the right type), else Hydra's saved overrides and config, and its curves."""
    folder = Path(folder)
    info, warnings = read_job(folder)
    overrides = info.get("overrides")
    if overrides is None:
        overrides = _saved_overrides(folder)
    seed = next((o.split("=", 1)[1] for o in overrides or [] if override_key(o) == SEED), None)
    if seed is None:
        seed = str(info[SEED]) if info.get(SEED) is not None else _saved_seed(folder)
    wall = info.get("wall_s")
    if wall is None:  # a run from before job.json: from its first to its last file write
        cfg, metrics = folder / ".hydra" / "config.yaml", folder / METRICS
        if cfg.is_file() and metrics.is_file():
            wall = max(0.0, metrics.stat().st_mtime - cfg.stat().st_mtime)
    metrics = folder / METRICS
    curves: dict[str, list[float]] = {}
    if metrics.is_file():
        try:
            curves = rl_curves(metrics, warnings)
        except (OSError, ValueError) as exc:  # not a CSV table, unreadable
            warnings.append(f"{exc}; the run's metrics are left out")
    return Run(
        path=folder,
        overrides=overrides,
        seed=seed,
        status=info.get("status"),
        wall_s=None if wall is None else float(wall),
        run_name=info.get("run_name"),
        curves=curves,
        job_num=info.get("job_num"),
        error=info.get("error"),
        max_steps=_saved_max_steps(folder),
        warnings=warnings,
    )


def _natural(path: Path) -> list:
    """Sort key: ``2_...`` before ``10_...``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_runs(sources: Iterable[str | Path]) -> list[Run]:
    """Every run folder under the given folders or glob patterns (a folder holding
    ``csv/metrics.csv``, or the ``job.json`` of a job that failed before logging; a
    ``metrics.csv`` path names its run too). Runs nested in another run's folder (its warm
    starts) belong to that run and are not listed."""
    folders: set[Path] = set()
    for src in sources:
        matches = sorted(glob.glob(str(src))) if glob.has_magic(str(src)) else [str(src)]
        if not matches or not all(Path(m).exists() for m in matches):
            raise FileNotFoundError(
                f"{src}: no such folder (give a run or sweep folder, or a glob)"
            )
        for m in map(Path, matches):
            if m.is_file() and m.name == "metrics.csv":
                folders.add(m.parent.parent.resolve())
            elif m.is_dir():
                folders.update(p.parent.parent.resolve() for p in m.rglob(str(METRICS)))
                folders.update(p.parent.resolve() for p in m.rglob(RUN_JSON))
    tops = [f for f in folders if not any(a in folders for a in f.parents)]
    return [load_run(f) for f in sorted(tops, key=_natural)]


def group_runs(runs: Iterable[Run]) -> dict[tuple[str, ...], list[Run]]:
    """Runs by their overrides minus the seed, in the order the groups first appear."""
    groups: dict[tuple[str, ...], list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    return groups


def labels(keys: Sequence[tuple[str, ...]]) -> tuple[dict[tuple[str, ...], str], list[str]]:
    """A short label per group (the overrides that differ between groups) and the overrides
    every group shares."""
    common = [o for o in (keys[0] if keys else ()) if all(o in k for k in keys)]
    out = {}
    for k in keys:
        own = [o for o in k if o not in common]
        out[k] = " ".join(own) if own else ("(defaults)" if not k else "(all runs)")
    return out, common


#: Each task's headline, first found wins: success (the synthetic and custom tasks' every
#: check met; instruction following's all-constraints rate, its constraint slots c0..c12 being
#: rewards), text-to-SQL's execution match, tool calling's correctness.
HEADLINE = ("success", "execution", "correctness")


def headline(names: Iterable[str]) -> str | None:
    names = list(names)
    return next((h for h in HEADLINE if h in names), None)


def metric_names(runs: Iterable[Run], metrics: Sequence[str] = ()) -> list[str]:
    """The metrics named (``--metric``), else the task's headline first, then each reward in
    the order the runs logged them."""
    names: list[str] = []
    for r in runs:
        names += [m for m in r.curves if m not in names]
    if metrics:
        unknown = [m for m in metrics if m not in names]
        if unknown:
            raise ValueError(
                f"--metric {' '.join(unknown)}: not logged by these runs; they log "
                f"{', '.join(names)}"
            )
        return list(metrics)
    first = headline(names)
    return sorted(names, key=lambda m: m != first)


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}" + ("" if k == 1 else "s")


def fmt(x: float | None, digits: int = 3) -> str:
    """A number with ``digits`` decimals; "–" for None, NaN, inf or what is no number."""
    return f"{x:.{digits}f}" if _is_number(x) else "–"


def fmt_ci(iv: Interval, digits: int = 3) -> str:
    """``mean ± half``; the mean alone when one value gives no interval."""
    if iv.n == 0 or not math.isfinite(iv.mean):
        return "–"
    if not math.isfinite(iv.half):
        return f"{iv.mean:.{digits}f}"
    return f"{iv.mean:.{digits}f} ± {iv.half:.{digits}f}"


def one_line(text: Any) -> str:
    """``text`` with line breaks and other unprintable characters written as escapes
    (``\\n``), so that a name from a run's files cannot end a markdown line or table row."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _digest(name: str, n: int = 8) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:n]


#: A metric name longer than this is shown cut, with a short hash of the whole name.
LONGEST_NAME = 100


def shown(metric: str) -> str:
    """A metric's name as tables and titles show it: on one line, and a name longer than
    ``LONGEST_NAME`` cut, with the hash its PNG's name carries (``figure_names``)."""
    text = one_line(metric)
    if len(text) <= LONGEST_NAME:
        return text
    return f"{text[: LONGEST_NAME - 24]}... ({len(metric):,} characters, #{_digest(metric)})"


def figure_names(metrics: Sequence[str]) -> dict[str, str]:
    """A PNG file name per metric, never shared: ``curves_<name>.png`` with ``/`` as ``_``
    for a short name of letters, digits and ``_.-/`` that no other metric cleans to; any
    other name is cleaned, cut and given a short hash of itself (``-<hash>``)."""
    clean = {m: re.sub(r"[^A-Za-z0-9_.-]+", "_", m) for m in metrics}
    count: dict[str, int] = {}
    for c in clean.values():
        count[c.casefold()] = count.get(c.casefold(), 0) + 1
    out: dict[str, str] = {}
    taken: set[str] = set()
    for m, c in clean.items():
        plain = c == m.replace("/", "_") and len(c) <= LONGEST_NAME and count[c.casefold()] == 1
        name = f"curves_{c}.png" if plain else f"curves_{c[:80]}-{_digest(m)}.png"
        if name.casefold() in taken:  # a plain name that looks like another's hashed one
            name = f"curves_{c[:80]}-{_digest(m, 64)}.png"
        taken.add(name.casefold())
        out[m] = name
    return out


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    def cell(c: Any) -> str:
        return one_line(c).replace("|", r"\|")

    lines = ["| " + " | ".join(map(cell, head)) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(map(cell, r)) + " |")
    return "\n".join(lines)


def _atomic_write(path: Path, text: str) -> None:
    """Several jobs of a parallel sweep may rewrite the summary at once: each writes its own
    file and renames it, so a reader never sees half a file (``runs.write_file``: a random
    temporary name, and never through a link planted at ``path``)."""
    write_file(path, text)


# ---------------------------------------------------------------------------------------------
# A sweep's summary (one row per job)
# ---------------------------------------------------------------------------------------------


def summary_rows(runs: Sequence[Run], root: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and one row per run: job, folder, status, seed, overrides (all, and one column
    per experiment key), steps, wall time, final and best value of each metric."""
    metrics = metric_names(runs)
    keys: list[str] = []
    for r in runs:
        keys += [override_key(o) for o in r.group if override_key(o) not in keys]
    head = ["job", "run", "status", SEED, "overrides", *keys, "steps", "wall_s"]
    head += [f"{m}/{kind}" for m in metrics for kind in ("final", "best")]
    rows = []
    for r in runs:
        row: dict[str, Any] = {
            "job": r.job_num if r.job_num is not None else "",
            "run": str(r.path.relative_to(root)) if r.path.is_relative_to(root) else str(r.path),
            "status": r.status or ("incomplete" if r.incomplete else ""),
            SEED: r.seed if r.seed is not None else "",
            "overrides": " ".join(r.overrides or []),
            "steps": r.steps,
            "wall_s": "" if r.wall_s is None else round(r.wall_s, 1),
        }
        row.update({override_key(o): o.split("=", 1)[-1] for o in r.group})
        for m in metrics:
            final, best = r.final_best(m)
            row[f"{m}/final"], row[f"{m}/best"] = final, best
        rows.append(row)
    return head, rows


def sweep_command(root: Path) -> str | None:
    """``python src/<train|eval>.py -m <the sweep's overrides>``, from Hydra's
    ``multirun.yaml``."""
    p = root / "multirun.yaml"
    if not p.is_file():
        return None
    try:
        saved = OmegaConf.load(p).hydra
        ov = saved.overrides.task
        script = str(saved.job.get("name") or "train")
    except Exception:
        return None
    return f"python src/{script}.py -m " + " ".join(str(o) for o in ov)


# ---------------------------------------------------------------------------------------------
# An evaluation sweep's summary (src/eval.py -m): one row per job, its eval metrics
# ---------------------------------------------------------------------------------------------

#: The metrics an evaluation summary shows, where a job wrote them: each benchmark's headline.
EVAL_HEADLINES = ("exec_acc", "prompt_level_strict_acc", "inst_level_strict_acc",
                  "muldimif_overall", "bfcl/non_live/summary_ast", "bfcl/live/summary_ast",
                  "exact_match", "success", "coverage")  # fmt: skip


def eval_metrics(folder: Path) -> dict[str, Any] | None:
    """An evaluation job's ``metrics.json`` (None: the folder holds none, or not an object)."""
    data = _read_json(folder / "metrics.json")
    return data if data and isinstance(data, dict) else None


def write_eval_summary(root: Path, runs: Sequence[Run]) -> tuple[Path, Path]:
    """``summary.csv`` / ``summary.md`` of an evaluation sweep: split, examples and the
    headline metrics of each job."""
    found = {r.path: eval_metrics(r.path) or {} for r in runs}
    metrics = [m for m in EVAL_HEADLINES if any(m in v for v in found.values())]
    names, common = labels([r.group for r in runs])
    head = ["job", "run", "status", "overrides", "split", "examples", *metrics]
    rows = []
    for r in runs:
        m, scored = found[r.path], found[r.path].get("scored") or {}
        rows.append({"job": "" if r.job_num is None else r.job_num,
                     "run": str(r.path.relative_to(root)) if r.path.is_relative_to(root)
                     else str(r.path), "status": r.status or ("completed" if m else "?"),
                     "overrides": names[r.group], "split": scored.get("split", ""),
                     "examples": scored.get("examples", ""),
                     **{k: m.get(k, "") for k in metrics}})  # fmt: skip
    csv_path, md_path = _write_summary_csv(root, head, rows), root / "summary.md"
    md_rows = [[row["job"], row["overrides"], row["split"], row["status"], row["examples"],
                *[fmt(row[k]) if row[k] != "" else "–" for k in metrics]] for row in rows]  # fmt: skip
    cmd = sweep_command(root)
    lines = [f"# Evaluation sweep: {one_line(root.name)}", ""]
    lines += [f"`{one_line(cmd)}`", ""] if cmd else []
    if common:
        lines.append(f"Every job: `{one_line(' '.join(common))}`.")
    head_md = ["job", "overrides", "split", "status", "examples", *metrics]
    lines += ["", markdown_table(head_md, md_rows), ""]
    lines += [f"- job {r.job_num} failed: `{(r.error or '?')[:300]}`" for r in runs
              if r.status == "failed"]  # fmt: skip
    _atomic_write(md_path, "\n".join(lines) + "\n")
    return csv_path, md_path


def _write_summary_csv(root: Path, head: list[str], rows: list[dict]) -> Path:
    """``<root>/summary.csv`` from the rows, written atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=head, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    _atomic_write(root / "summary.csv", buf.getvalue())
    return root / "summary.csv"


def write_summary(root: str | Path) -> tuple[Path, Path] | None:
    """``summary.csv`` and ``summary.md`` in a sweep folder; None when it holds no run yet."""
    root = Path(root)
    runs = find_runs([root])
    if not runs:
        return None
    if not any(r.curves for r in runs) and any(eval_metrics(r.path) for r in runs):
        return write_eval_summary(root.resolve(), runs)
    head, rows = summary_rows(runs, root.resolve())
    csv_path, md_path = _write_summary_csv(root, head, rows), root / "summary.md"

    metrics = metric_names(runs)
    names, common = labels([r.group for r in runs])
    md_head = ["job", "overrides", SEED, "status", "steps", "wall (s)"]
    md_head += [f"{shown(m)} final / best" for m in metrics]
    md_rows = []
    for r, row in zip(runs, rows, strict=True):
        cells = [row["job"], names[r.group], row[SEED], row["status"] or "?", r.steps]
        cells.append(fmt(r.wall_s, 1))
        for m in metrics:
            cells.append(f"{fmt(row[f'{m}/final'])} / {fmt(row[f'{m}/best'])}")
        md_rows.append(cells)
    cmd = sweep_command(root)
    lines = [f"# Sweep summary: {one_line(root.name)}", ""]
    if cmd:
        lines += [f"`{one_line(cmd)}`", ""]
    lines += [
        f"{_n(len(runs), 'job')}. final: mean of the last {FINAL_WINDOW} steps; best: highest "
        f"{SMOOTH}-step moving average.",
    ]
    if common:
        lines.append(f"Every job: `{one_line(' '.join(common))}`.")
    lines += ["", markdown_table(md_head, md_rows), ""]
    for r, row in zip(runs, rows, strict=True):
        if r.status == "failed":
            lines.append(f"- job {row['job']} failed: `{(r.error or '?')[:300]}`")
    lines += [f"- warning: {one_line(w)}" for r in runs for w in r.warnings]
    if any(r.status == "failed" or r.warnings for r in runs):
        lines.append("")
    lines.append(f"Compare over seeds: `python src/report.py {root}`")
    _atomic_write(md_path, "\n".join(lines) + "\n")
    return csv_path, md_path


# ---------------------------------------------------------------------------------------------
# The Hydra callback
# ---------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def _is_worker() -> bool:
    """DDP workers re-run the entry point; only the launching process records the run."""
    return any(os.environ.get(v, "0") != "0" for v in ("LOCAL_RANK", "RANK"))


def _sweep_dir(config: DictConfig) -> Path | None:
    """The sweep folder of a multirun job: its output folder minus ``hydra.sweep.subdir``
    (which may hold slashes when an override value is a path)."""
    out = OmegaConf.select(config, "hydra.runtime.output_dir")
    sub = OmegaConf.select(config, "hydra.sweep.subdir")
    if not out or sub is None:
        return None
    n = len(Path(str(sub)).parts)
    out = Path(str(out))
    return out.parents[n - 1] if 0 < n <= len(out.parents) else None


def _run_dir(config: DictConfig) -> Path:
    """Where the job's metrics go: ``paths.output_dir`` (Hydra's output folder unless
    overridden)."""
    try:
        out = OmegaConf.select(config, "paths.output_dir")
    except Exception:
        out = None
    return Path(str(out or OmegaConf.select(config, "hydra.runtime.output_dir")))


class RunRecorder(Callback):
    """Writes ``job.json`` for each job (resolved run name, overrides, status, wall time) and a
    multirun's ``summary.csv`` / ``summary.md``. Hydra turns an exception raised here into a
    warning, so recording never fails a run. A job stopped by SIGTERM or SIGINT
    (``mrtpo.run.signals.RunInterrupted``) is recorded as ``"interrupted"`` and ends its sweep."""

    def __init__(self, summary: bool = True) -> None:
        self.summary = summary
        self._started: dict[str, tuple[float, str]] = {}

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._started[str(_run_dir(config))] = (time.monotonic(), _now())

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if _is_worker():
            return
        out = _run_dir(config)
        failed = getattr(getattr(job_return, "status", None), "name", "") == "FAILED"
        # the property re-raises a failed job's exception; the field holds it
        error = getattr(job_return, "_return_value", None) if failed else None
        status = getattr(error, "job_status", "failed") if failed else "completed"
        refused = failed and not getattr(error, "trained", False)  # (interrupted: it trained)
        if refused and OmegaConf.select(config, "resume", default=None):
            return  # a refused resume leaves the run folder exactly as it was
        if not out.is_dir():
            return
        t0, started = self._started.pop(str(out), (None, None))
        wall = time.monotonic() - t0 if t0 is not None else None
        choices = OmegaConf.select(config, "hydra.runtime.choices", default={}) or {}
        try:
            run_name = str(OmegaConf.select(config, "run_name"))
        except Exception:  # an interpolation that cannot resolve here: keep it as written
            run_name = None
        invocation = {
            "started": started,
            "finished": _now(),
            "wall_s": None if wall is None else round(wall, 3),
            "status": status,
            "error": repr(error)[:2000] if failed else None,
            "overrides": [str(o) for o in getattr(job_return, "overrides", None) or []],
        }
        previous = _read_json(out / RUN_JSON).get("invocations", [])
        invocations = [*previous, invocation]  # a resumed run continues in the same folder
        first = invocations[0]
        record = {
            "run_name": run_name,
            "task": choices.get("task"),
            "method": choices.get("method"),
            "model": choices.get("model"),
            SEED: OmegaConf.select(config, SEED, default=None),
            "job_num": OmegaConf.select(config, "hydra.job.num", default=None),
            # the overrides the run was created with; a resume's own are in its invocation
            "overrides": first["overrides"],
            "status": invocation["status"],
            "error": invocation["error"],
            "wall_s": round(sum(i.get("wall_s") or 0.0 for i in invocations), 3),
            "started": first["started"],
            "finished": invocation["finished"],
            "invocations": invocations,
        }
        _atomic_write(out / RUN_JSON, json.dumps(record, indent=2) + "\n")
        mode = OmegaConf.select(config, "hydra.mode", default=None)
        multirun = getattr(mode, "name", str(mode)).endswith("MULTIRUN")
        if self.summary and multirun:
            sweep = _sweep_dir(config)
            if sweep is not None:
                write_summary(sweep)
        if multirun and status == "interrupted":  # the signal was for the sweep: no next job
            raise SystemExit(getattr(error, "exit_status", 1))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.summary:
            return
        root = Path(str(config.hydra.sweep.dir))
        written = write_summary(root) if root.is_dir() else None
        if written:
            print(f"sweep summary: {written[1]}  (compare: python src/report.py {root})")


# ---------------------------------------------------------------------------------------------
# The report over seeds
# ---------------------------------------------------------------------------------------------


def _by_seed(runs: Sequence[Run], metric: str, which: int) -> dict[str, float]:
    """``{seed: value}``; runs sharing a seed (a repeated sweep) are averaged."""
    vals: dict[str, list[float]] = {}
    for r in runs:
        vals.setdefault(r.seed_key, []).append(r.final_best(metric)[which])
    return {s: sum(v) / len(v) for s, v in vals.items() if all(map(math.isfinite, v))}


def baseline_of(
    group: tuple[str, ...], spec: Sequence[str], groups: Sequence[tuple[str, ...]]
) -> tuple[str, ...] | None:
    """The group to compare ``group`` with: its own overrides with ``spec`` (``method=gdpo``)
    put in their place; failing that, the one group matching ``spec``."""
    spec_keys = {override_key(s) for s in spec}
    want = experiment_overrides([o for o in group if override_key(o) not in spec_keys] + [*spec])
    if want in groups:
        return want
    wanted = set(experiment_overrides(spec))
    matching = [g for g in groups if wanted <= set(g)]
    return matching[0] if len(matching) == 1 else None


@dataclass
class Report:
    text: str  # markdown: what the command prints and writes to report.md
    figures: list[Path]


def _why_left_out(r: Run) -> str:
    if r.status == "failed":
        return "failed"
    if not r.steps:
        return "no RL steps logged"
    return f"incomplete: {r.steps} of {r.max_steps} steps, {r.progress}; --incomplete counts it"


def _left_out(skipped: Sequence[Run]) -> list[str]:
    """One line per run left out of the report (the first five), then a count of the rest."""
    lines = [f"Left out ({_why_left_out(r)}): {r.path}" for r in skipped[:5]]
    if len(skipped) > 5:
        lines.append(f"... and {len(skipped) - 5} more runs left out (failed, incomplete or no RL "
                     "steps)")  # fmt: skip
    return lines


def _counted(iv: Interval, of: int) -> str:
    """``mean ± half``, with ``(n=k)`` when the metric has a value in only k of the ``of``
    seeds (or seed pairs) the row counts."""
    text = fmt_ci(iv)
    return f"{text} (n={iv.n})" if 0 < iv.n < of else text


#: Said under a table with a row that counts incomplete runs (``--incomplete``).
PARTIAL = (
    "*: partial: the row counts runs short of trainer.max_steps (still running, or stopped; "
    "named above), whose final and best values are over the steps logged so far."
)

#: Said under a table in which some cell averages fewer seeds than its row counts.
FEWER = (
    "(n=k): the mean is over k seeds (or seed pairs), not all of the row's: the metric has no "
    "finite value in the others (a reward that applied to no response, or a metric a run did "
    "not log)."
)


def _paired_section(groups, names, metrics, baseline, level) -> list[str]:
    """The report's lines of paired differences (by seed) of each group's final values
    against its baseline group."""
    keys = list(groups)
    lines: list[str] = []
    rows = []
    for k, rs in groups.items():
        b = baseline_of(k, baseline, keys)
        if b is None or b == k:
            continue
        diffs = [paired_interval(_by_seed(rs, m, 0), _by_seed(groups[b], m, 0), level)
                 for m in metrics]  # fmt: skip
        pairs = max(d.n for d in diffs)
        rows.append([names[k], names[b], pairs, *[_counted(d, pairs) for d in diffs]])
    spec = " ".join(baseline)
    lines += ["", f"## Paired differences of the final value against `{spec}` (by seed)", ""]
    if rows:
        lines.append(markdown_table(["group", "baseline", "seed pairs", *map(shown, metrics)],
                                    rows))  # fmt: skip
        if any("(n=" in str(c) for r in rows for c in r[3:]):
            lines += ["", FEWER]
    else:
        lines.append(f"No group matches `{spec}`: groups are {[names[k] for k in keys]}")
    return lines


def _tables(groups, names, metrics, level) -> list[str]:
    """The final and best tables: per group, its seeds, steps and each metric's interval."""
    lines: list[str] = []
    for which, title in (
        (0, f"Final (mean of the last {FINAL_WINDOW} steps)"),
        (1, f"Best ({SMOOTH}-step moving average)"),
    ):
        head = ["group", "seeds", "steps", *map(shown, metrics)]
        rows = []
        for k, rs in groups.items():
            ivs = intervals(
                {m: list(_by_seed(rs, m, which).values()) for m in metrics}, level=level
            )
            seeds = len({r.seed_key for r in rs})
            steps = "/".join(map(str, sorted({r.steps for r in rs})))
            steps += "*" * any(r.incomplete for r in rs)  # partial: PARTIAL says so
            rows.append([names[k], seeds, steps, *[_counted(ivs[m], seeds) for m in metrics]])
        lines += ["", f"## {title}", "", markdown_table(head, rows)]
        if any("(n=" in str(c) for r in rows for c in r[3:]):
            lines += ["", FEWER]
        if any(str(r[2]).endswith("*") for r in rows):
            lines += ["", PARTIAL]
    return lines


def _preamble(groups, names, common, skipped, used, level) -> list[str]:
    """What the report counts: runs, groups, the runs left out and why, the incomplete runs
    counted (``--incomplete``), and what was ignored of the runs' records."""
    pct = f"{100 * level:g}%"
    lines = [
        f"{_n(len(used), 'run')} in {_n(len(groups), 'group')}; mean ± {pct} t interval over "
        "seeds.",
    ]
    if common:
        lines.append(f"Every run: `{' '.join(common)}`.")
    lines += _left_out(skipped)
    for k, rs in groups.items():
        part = [f"{r.steps} of {r.max_steps} steps, {r.progress}" for r in rs if r.incomplete]
        if part:
            lines.append(f"Counted although incomplete (--incomplete): {names[k]}: "
                         f"{len(part)} incomplete ({', '.join(part)}).")  # fmt: skip
    lines += [f"Warning: {w}" for r in [*used, *skipped] for w in r.warnings]
    lines += [f"Warning: {note}" for r in used if (note := beta_short(r.path))]
    return [one_line(line) for line in lines]  # paths and names from the runs' files


def report(
    runs: Sequence[Run],
    out: Path | None = None,
    baseline: Sequence[str] = (),
    level: float = 0.95,
    plots: bool = True,
    only: Sequence[str] = (),
    incomplete: bool = False,
) -> Report:
    """The paper-style table of ``runs`` grouped by their overrides minus the seed. Runs that
    are incomplete (short of ``trainer.max_steps``, not recorded as completed) are left out
    and named, unless ``incomplete``; then they are counted and named."""
    skipped = [r for r in runs if r.status == "failed" or not r.steps
               or (r.incomplete and not incomplete)]  # fmt: skip
    used = [r for r in runs if r not in skipped]
    if not used and any(eval_metrics(r.path) for r in runs):
        return eval_report(runs, level)
    if not used:
        short = sum(r.incomplete for r in runs)
        also = f"; {short} incomplete (still running or stopped): --incomplete counts them"
        raise ValueError(
            "no finished RL run with logged steps among "
            f"{len(runs)} run folder(s) (their csv/metrics.csv hold no train/reward rows)"
            + (also if short else "")
        )
    groups = group_runs(used)
    names, common = labels(list(groups))
    metrics = metric_names(used, only)
    lines = _preamble(groups, names, common, skipped, used, level)
    lines += _tables(groups, names, metrics, level)
    if baseline:
        lines += _paired_section(groups, names, metrics, baseline, level)
    figures: list[Path] = []
    if plots and out is not None:
        paths = {m: out / name for m, name in figure_names(metrics).items()}
        for p in [*paths.values(), out / "report.md"]:
            check_output(p)  # before anything is written
        out.mkdir(parents=True, exist_ok=True)
        for m, path in paths.items():
            plot_metric({names[k]: [r.curves.get(m, []) for r in rs] for k, rs in groups.items()},
                        m, path, level)  # fmt: skip
            figures.append(path)
        lines += ["", "Learning curves: " + ", ".join(f"[{p.name}]({p.name})" for p in figures)]
    return Report("\n".join(lines) + "\n", figures)


def eval_report(runs: Sequence[Run], level: float = 0.95) -> Report:
    """Evaluation jobs (``src/eval.py -m``) grouped by their overrides minus the seed: the
    mean ± t interval of each benchmark headline over the group's jobs."""
    found = {r.path: eval_metrics(r.path) for r in runs}
    used = [r for r in runs if found[r.path]]
    metrics = [m for m in EVAL_HEADLINES if m != "coverage" and any(m in found[r.path]
               for r in used)]  # fmt: skip
    groups = group_runs(used)
    names, common = labels(list(groups))
    lines = [f"{_n(len(used), 'evaluation')} in {_n(len(groups), 'group')}; mean ± "
             f"{100 * level:g}% t interval over each group's jobs."]  # fmt: skip
    if common:
        lines.append(f"Every job: `{one_line(' '.join(common))}`.")
    rows = []
    for k, rs in groups.items():
        vals = {m: [found[r.path].get(m) for r in rs] for m in metrics}
        ivs = intervals({m: [v for v in vs if _is_number(v)] for m, vs in vals.items()}, level)
        rows.append([names[k], len(rs), *[fmt_ci(ivs[m]) for m in metrics]])
    lines += ["", markdown_table(["group", "jobs", *metrics], rows)]
    return Report("\n".join(lines) + "\n", [])


def bounds(curves: dict[str, list[list[float]]]) -> tuple[float, float]:
    """(0, 1) when every finite value of the curves is in [0, 1] (a rate, a binary reward's
    mean): a t band over a few seeds reaches past them (to 1.6), where no run can be; else
    no bounds."""
    values = [v for runs in curves.values() for c in runs for v in c if math.isfinite(v)]
    rate = bool(values) and min(values) >= 0 and max(values) <= 1
    return (0.0, 1.0) if rate else (-math.inf, math.inf)


def curve_band(
    runs: list[list[float]], level: float = 0.95, cut: tuple[float, float] = (-math.inf, math.inf)
) -> tuple[list[float], list[float], list[float]]:
    """(mean, low, high) per step of the smoothed curves of one group's seeds, over the steps
    every seed reached: the t band, cut at ``cut``."""
    ys = [smooth(c) for c in runs if c]
    n = min((len(y) for y in ys), default=0)
    mean, lo, hi = [], [], []
    for t in range(n):
        iv = mean_ci([y[t] for y in ys], level)
        h = iv.half if math.isfinite(iv.half) else 0.0
        mean.append(iv.mean)
        lo.append(max(iv.mean - h, cut[0]))
        hi.append(min(iv.mean + h, cut[1]))
    return mean, lo, hi


def plot_metric(
    curves: dict[str, list[list[float]]], metric: str, path: Path, level: float = 0.95
) -> None:
    """One metric per step, smoothed: a line per group (mean over its seeds) with the t band
    (``curve_band``; a rate's band cut at 0 and 1), over the steps every seed of the group
    reached. The legend goes below the axes, where no curve runs through it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cut = bounds(curves)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for label, runs in curves.items():
        mean, lo, hi = curve_band(runs, level, cut)
        if not mean:
            continue
        x = list(range(1, len(mean) + 1))
        n_seeds = sum(1 for c in runs if c)
        (line,) = ax.plot(x, mean, lw=1.6, label=f"{label} (n={n_seeds})")
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    said = ", cut at 0 and 1" if math.isfinite(cut[1]) else ""
    ax.set_title(f"{shown(metric)} (moving average {SMOOTH}; band: {100 * level:g}% over seeds{said})",
                 fontsize=9)  # fmt: skip
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(fontsize=7, loc="outside lower center", ncol=2, frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, buf.getvalue())


def default_out(sources: Sequence[str]) -> Path:
    """Where report.md and the figures go without ``--out``: the one run or sweep folder
    given (beside a sweep's summary.md), else ``reports/`` in the current folder. Several
    folders' common parent is often logs/train/multiruns, which holds one folder per sweep:
    files there would be picked up by a ``multiruns/*`` glob as if they were sweeps."""
    dirs = [Path(m) for s in sources for m in (glob.glob(s) if glob.has_magic(s) else [s])]
    dirs = {(d if d.is_dir() else d.parent).resolve() for d in dirs}
    return dirs.pop() if len(dirs) == 1 else Path("reports")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python src/report.py",
        description="Compare training runs over seeds: runs are grouped by their overrides "
        "minus the seed; prints mean ± t interval of each reward's and success's final and "
        "best value, and writes one learning-curve PNG per metric.",
    )
    p.add_argument("sources", nargs="+", help="run or sweep folders, or globs (quote them)")
    p.add_argument("--out", type=Path, help="folder for report.md and the PNGs (default: the "
                   "folder given, or reports/ for several)")  # fmt: skip
    p.add_argument("--baseline", nargs="+", default=[], metavar="KEY=VALUE",
                   help="paired differences by seed against this group, e.g. method=gdpo")  # fmt: skip
    p.add_argument("--level", type=float, default=0.95, help="interval level (default 0.95)")
    p.add_argument("--no-plots", action="store_true", help="print the table only")
    p.add_argument("--metric", nargs="+", default=[], metavar="NAME",
                   help="the metrics to compare (default: all, the task's headline first: "
                   "success, execution or correctness)")  # fmt: skip
    p.add_argument("--incomplete", action="store_true",
                   help="count runs short of trainer.max_steps that are not recorded as "
                   "completed (still running, or stopped); by default they are left out "
                   "and named")  # fmt: skip
    a = p.parse_args(argv)
    if not 0.0 < a.level < 1.0:
        p.error(f"--level must be in (0, 1), got {a.level}")
    for b in a.baseline:
        if "=" not in b:
            p.error(f"--baseline takes KEY=VALUE overrides (e.g. method=gdpo), got {b!r}")
    args = {"baseline": a.baseline, "level": a.level, "only": a.metric,
            "incomplete": a.incomplete}  # fmt: skip
    runs: list[Run] = []
    try:
        runs = find_runs(a.sources)
        if not runs:
            raise ValueError(f"no run folders (with {METRICS}) under {' '.join(a.sources)}")
        out = a.out or default_out(a.sources)
        rep = report(runs, out, plots=not a.no_plots, **args)
        if not a.no_plots:
            write_file(out / "report.md", rep.text)
    except (OSError, ValueError) as exc:
        return _failed(exc, runs, args)
    print(rep.text, end="")
    if not a.no_plots:
        print(f"\nwrote {out / 'report.md'} and {len(rep.figures)} figures in {out}")
    return 0


def _failed(exc: Exception, runs: Sequence[Run] | None, args: dict[str, Any]) -> int:
    """The one error line of ``main`` (exit status 2). When the runs were read but a file
    could not be written (a read-only run folder), the table is printed first."""
    if isinstance(exc, OSError) and runs and exc.filename and exc.strerror:
        with contextlib.suppress(OSError, ValueError):
            print(report(runs, None, plots=False, **args).text)
        print(f"error: cannot write {exc.filename}: {exc.strerror}; give --out <a writable "
              "folder>, or --no-plots")  # fmt: skip
    else:
        print(f"error: {one_line(exc)}")
    return 2
