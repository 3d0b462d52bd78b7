"""``src/report.py``: runs compared over seeds.

Per group of runs (``jobs.group_runs``): the mean ± t interval over seeds of each reward's and
success's final and best value, paired differences by seed against a ``--baseline`` group, and
one learning-curve PNG per metric (mean over seeds with its band). The statistics are
``mrtpo.evaluate.analysis.stats``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrtpo.evaluate.analysis.jobs import (
    METRICS,
    Run,
    beta_short,
    experiment_overrides,
    find_runs,
    group_runs,
    is_number,
    labels,
    metric_names,
    override_key,
)
from mrtpo.evaluate.analysis.runs import check_output, write_file
from mrtpo.evaluate.analysis.stats import (
    FINAL_WINDOW,
    SMOOTH,
    Interval,
    intervals,
    mean_ci,
    paired_interval,
    smooth,
)
from mrtpo.evaluate.analysis.summary import (
    EVAL_HEADLINES,
    eval_metrics,
    figure_names,
    fmt_ci,
    markdown_table,
    one_line,
    plural,
    shown,
)


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
    """Paired differences (by seed) of each group's final values against its baseline."""
    keys, rows = list(groups), []
    for k, rs in groups.items():
        b = baseline_of(k, baseline, keys)
        if b is None or b == k:
            continue
        diffs = [paired_interval(_by_seed(rs, m, 0), _by_seed(groups[b], m, 0), level)
                 for m in metrics]  # fmt: skip
        pairs = max(d.n for d in diffs)
        rows.append([names[k], names[b], pairs, *[_counted(d, pairs) for d in diffs]])
    spec = " ".join(baseline)
    lines = ["", f"## Paired differences of the final value against `{spec}` (by seed)", ""]
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
            ivs = {m: mean_ci(_by_seed(rs, m, which).values(), level) for m in metrics}
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
    """What the report counts and leaves out (and why), and what of the records it ignored."""
    lines = [
        f"{plural(len(used), 'run')} in {plural(len(groups), 'group')}; mean ± {100 * level:g}% t "
        "interval over seeds."
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
    """The paper-style table of ``runs`` grouped by overrides minus the seed; incomplete runs
    are left out (counted with ``incomplete``), and named either way."""
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
    """Evaluation jobs grouped by overrides minus the seed: each headline's mean ± t interval."""
    found = {r.path: eval_metrics(r.path) for r in runs}
    used = [r for r in runs if found[r.path]]
    metrics = [m for m in EVAL_HEADLINES if m != "coverage" and any(m in found[r.path]
               for r in used)]  # fmt: skip
    groups = group_runs(used)
    names, common = labels(list(groups))
    lines = [f"{plural(len(used), 'evaluation')} in {plural(len(groups), 'group')}; mean ± "
             f"{100 * level:g}% t interval over each group's jobs."]  # fmt: skip
    if common:
        lines.append(f"Every job: `{one_line(' '.join(common))}`.")
    rows = []
    for k, rs in groups.items():
        vals = {m: [found[r.path].get(m) for r in rs] for m in metrics}
        ivs = intervals({m: [v for v in vs if is_number(v)] for m, vs in vals.items()}, level)
        rows.append([names[k], len(rs), *[fmt_ci(ivs[m]) for m in metrics]])
    lines += ["", markdown_table(["group", "jobs", *metrics], rows)]
    return Report("\n".join(lines) + "\n", [])


def bounds(curves: dict[str, list[list[float]]]) -> tuple[float, float]:
    """(0, 1) when every finite value of the curves is in [0, 1] (a rate, a binary reward's mean): a
    t band over a few seeds reaches past them (to 1.6), where no run can be; else no bounds."""
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
    """One smoothed metric: a line per group (mean over seeds) with its t band (``curve_band``);
    the legend goes below the axes, where no curve runs through it."""
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
    """Without ``--out``: the one folder given, else ``reports/`` here (not several folders'
    common parent, often logs/train/multiruns, where a ``multiruns/*`` glob takes files for
    sweeps)."""
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
