"""A sweep's summary (``summary.csv`` / ``summary.md``, one row per job, rewritten by
``recorder.RunRecorder`` after every job) and the formatting the reports share (numbers,
intervals, names on one line, markdown tables, figure names).
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
from omegaconf import OmegaConf

from mrtpo.evaluate.analysis.jobs import (
    SEED,
    Run,
    find_runs,
    is_number,
    labels,
    metric_names,
    override_key,
    read_json,
)
from mrtpo.evaluate.analysis.runs import write_file
from mrtpo.evaluate.analysis.stats import FINAL_WINDOW, SMOOTH, Interval

#: The markdown templates (``mrtpo/evaluate/templates/*.md.j2``): text, so nothing is escaped.
MARKDOWN = jinja2.Environment(
    loader=jinja2.PackageLoader("mrtpo.evaluate", "templates"),
    trim_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)


def plural(k: int, noun: str) -> str:
    return f"{k} {noun}" + ("" if k == 1 else "s")


def fmt(x: float | None, digits: int = 3) -> str:
    """A number with ``digits`` decimals; "–" for None, NaN, inf or what is no number."""
    return f"{x:.{digits}f}" if is_number(x) else "–"


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
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _digest(name: str, n: int = 8) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:n]


#: A metric name longer than this is shown cut, with a short hash of the whole name.
LONGEST_NAME = 100


def shown(metric: str) -> str:
    """A metric's name on one line; past ``LONGEST_NAME`` cut, with its PNG's hash."""
    text = one_line(metric)
    if len(text) <= LONGEST_NAME:
        return text
    return f"{text[: LONGEST_NAME - 24]}... ({len(metric):,} characters, #{_digest(metric)})"


def figure_names(metrics: Sequence[str]) -> dict[str, str]:
    """A PNG file name per metric, never shared: ``curves_<name>.png`` with ``/`` as ``_``
    for a short name of letters, digits and ``_.-/`` that no other metric cleans to; any
    other name is cleaned, cut and given a short hash of itself (``-<hash>``)."""
    clean = {m: re.sub(r"[^A-Za-z0-9_.-]+", "_", m) for m in metrics}
    count = Counter(c.casefold() for c in clean.values())
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

    lines = ["| " + " | ".join(map(cell, r)) + " |" for r in [head, *rows]]
    lines.insert(1, "|" + "---|" * len(head))
    return "\n".join(lines)


def summary_rows(runs: Sequence[Run], root: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and one row per run (overrides also one column per experiment key)."""
    metrics = metric_names(runs)
    keys = list(dict.fromkeys(override_key(o) for r in runs for o in r.group))
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
    """``python src/<train|eval>.py -m <the sweep's overrides>``, from Hydra's ``multirun.yaml``."""
    try:
        saved = OmegaConf.load(root / "multirun.yaml").hydra
        script = str(saved.job.get("name") or "train")
        return f"python src/{script}.py -m " + " ".join(str(o) for o in saved.overrides.task)
    except Exception:  # none, or not Hydra's
        return None


# ---- An evaluation sweep's summary (src/eval.py -m): one row per job, its eval metrics -----------

#: The metrics an evaluation summary shows, where a job wrote them: each benchmark's headline.
EVAL_HEADLINES = ("exec_acc", "prompt_level_strict_acc", "inst_level_strict_acc",
                  "muldimif_overall", "bfcl/non_live/summary_ast", "bfcl/live/summary_ast",
                  "exact_match", "success", "coverage")  # fmt: skip


def eval_metrics(folder: Path) -> dict[str, Any] | None:
    """An evaluation job's ``metrics.json`` (None: the folder holds none, or not an object)."""
    data = read_json(folder / "metrics.json")
    return data if data and isinstance(data, dict) else None


def write_eval_summary(root: Path, runs: Sequence[Run]) -> tuple[Path, Path]:
    """An evaluation sweep's summary: split, examples and headline metrics of each job."""
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
    md_rows = [[row["job"], row["overrides"], row["split"], row["status"], row["examples"],
                *[fmt(row[k]) if row[k] != "" else "–" for k in metrics]] for row in rows]  # fmt: skip
    table = markdown_table(["job", "overrides", "split", "status", "examples", *metrics], md_rows)
    return _write_summary_csv(root, head, rows), _write_md(root, "Evaluation sweep", runs, common,
                                                           table)  # fmt: skip


def _write_md(root: Path, title: str, runs: Sequence[Run], common: list[str], table: str,
              intro: Sequence[str] = (), end: Sequence[str] = ()) -> Path:  # fmt: skip
    """``<root>/summary.md``: title, command, ``intro``, common overrides, table, failed, end."""
    cmd = sweep_command(root)
    lines = [f"# {title}: {one_line(root.name)}", "", *([f"`{one_line(cmd)}`", ""] if cmd else [])]
    lines += [*intro, *([f"Every job: `{one_line(' '.join(common))}`."] if common else [])]
    lines += ["", table, ""]
    lines += [f"- job {'' if r.job_num is None else r.job_num} failed: `{(r.error or '?')[:300]}`"
              for r in runs if r.status == "failed"]  # fmt: skip
    write_file(root / "summary.md", "\n".join([*lines, *end]) + "\n")
    return root / "summary.md"


def _write_summary_csv(root: Path, head: list[str], rows: list[dict]) -> Path:
    """``<root>/summary.csv`` from the rows, written atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=head, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    write_file(root / "summary.csv", buf.getvalue())
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
    metrics = metric_names(runs)
    names, common = labels([r.group for r in runs])
    md_head = ["job", "overrides", SEED, "status", "steps", "wall (s)"]
    md_head += [f"{shown(m)} final / best" for m in metrics]
    md_rows = [
        [row["job"], names[r.group], row[SEED], row["status"] or "?", r.steps, fmt(r.wall_s, 1),
         *[f"{fmt(row[f'{m}/final'])} / {fmt(row[f'{m}/best'])}" for m in metrics]]
        for r, row in zip(runs, rows, strict=True)
    ]  # fmt: skip
    intro = [f"{plural(len(runs), 'job')}. final: mean of the last {FINAL_WINDOW} steps; best: "
             f"highest {SMOOTH}-step moving average."]  # fmt: skip
    end = [f"- warning: {one_line(w)}" for r in runs for w in r.warnings]
    end += [""] * any(r.status == "failed" or r.warnings for r in runs)
    end.append(f"Compare over seeds: `python src/report.py {root}`")
    table = markdown_table(md_head, md_rows)
    return _write_summary_csv(root, head, rows), _write_md(root, "Sweep summary", runs, common,
                                                           table, intro, end)  # fmt: skip
