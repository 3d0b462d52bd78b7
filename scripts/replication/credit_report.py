"""The credit experiment's report (``scripts/replicate.py --long --credit``): it replaces
``docs/replication_long.md`` with the K = 8 arms (each with its paired differences and
verdicts), the decisions the rule made, P5 at the new defaults, a diagnostics table per arm
read from the runs' ``metrics.csv``, and the drawn-length check.

``main`` is the entry point: run the two phases (``replication.credit``), then write the report.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from mrtpo.evaluate.analysis.runs import source_commit
from mrtpo.evaluate.analysis.stats import mean_ci
from replication import claims as C
from replication import credit as X
from replication.harness import ROOT
from replication.jobs import quieted, run_folder
from replication.long import (
    DRAWN_RANGE,
    SFT_PHASES,
    CellRuns,
    LongOptions,
    cell_dir,
    warm_start,
)
from replication.long_report import (
    DESIGN_HISTORY,
    PREDICTIONS,
    _chain,
    _slope_claim,
    _starts,
    label,
)
from replication.recheck import recheck
from replication.recheck import summary as recheck_summary

#: The commit that holds the decision rule (the last entry of ``DESIGN_HISTORY``), made before
#: any run of the experiment.
DECISION_COMMIT = "19ceb99"
#: The previous full report's mean AUC at K = 8, 60 words (runs at db32ea3) of the two arms run
#: the same way here: with its warm starts reused they should come back.
PREVIOUS_K8 = {"gdpo": 0.135, "batch/delete": 0.113}
#: The drawn-length check passes when the closing tag's energy share lies wholly below this.
CLOSE_SHARE = 0.5
#: Segments of the toy's responses (``SyntheticTask.segments``), in the table's order.
SEGMENTS = ("free", "close", "answer", "mark", "other")


def cell_label(cell) -> str:
    return label(cell)


def arm_of(spec: str) -> str:
    """An arm's label for a method spec (the spec itself when it is no arm)."""
    names = {v: k for k, v in X.ARMS.items()}
    return names.get(spec, spec.replace("mrtpo_joint@", "joint@").replace("mrtpo@", ""))


def _verdict_word(iv, ahead: str = "ahead", behind: str = "behind") -> str:
    s = iv.sign
    return f"**{ahead}**" if s > 0 else f"**{behind}**" if s < 0 else "inconclusive"


def arms_section(add, tab: C.Table) -> None:
    """The cell's arms: per arm its AUC, final success and `mark` steps; then each MRTPO
    arm − GDPO and − joint (Δ AUC, paired by seed) with a verdict."""
    runs = tab.get(X.CELL, {})
    add(f"## The arms at {label(X.CELL)}")
    add("")
    add("| arm | method | seeds | AUC | final | steps to `mark` ≥ 0.5 |")
    add("|---|---|---|---|---|---|")
    for name, spec in X.ARMS.items():
        xs = list(runs.get(spec, {}).values())
        if not xs:
            add(f"| {name} | `{spec}` | 0 | – | – | – |")
            continue
        vals = [C.level_text(mean_ci(x[k] for x in xs), d).split(" (n")[0]
                for k, d in (("auc", 3), ("final", 3), ("mark_steps", 1))]  # fmt: skip
        add(f"| {name} | `{spec}` | {len(xs)} | " + " | ".join(vals) + " |")
    add("")
    add("Paired differences in AUC (same seed: same prompts, same first batch); *ahead* when "
        "the interval lies wholly above 0, *behind* when wholly below:")  # fmt: skip
    add("")
    add("| arm | − GDPO | verdict | − joint | verdict |")
    add("|---|---|---|---|---|")
    for name in [n for n in X.ARMS if n not in ("gdpo", "joint")]:
        row = [name]
        for other in ("gdpo", "joint"):
            iv = mean_ci(X.per_seed(tab, X.CELL, [(name, other)]).values())
            row += [C.ci_text(iv), _verdict_word(iv)]
        add("| " + " | ".join(row) + " |")
    iv = mean_ci(X.per_seed(tab, X.CELL, [("joint", "gdpo")]).values())
    add(f"| joint | {C.ci_text(iv)} | {_verdict_word(iv)} | | |")
    add("")


def checks(runs: X.Runs) -> list[str]:
    """The rule's two checks: no sign flip in a token-cap run, and the arms run as in the
    previous report give its AUC again."""
    flips = [x["diag"].get("sign_flip", math.nan) for spec, by_s in runs.get(X.CELL, {}).items()
             if "cap=token" in spec for x in by_s.values()]  # fmt: skip
    flips = [f for f in flips if not math.isnan(f)]
    out = [f"sign flips under cap=token: largest run mean {max(flips):.2g} over {len(flips)} runs"
           + (" (none: as the cap guarantees)" if max(flips) == 0 else " (**a defect**)")
           if flips else "sign flips under cap=token: not logged"]  # fmt: skip
    for arm, old in PREVIOUS_K8.items():
        xs = runs.get(X.CELL, {}).get(X.ARMS[arm], {})
        now = mean_ci(C.summarize(x["series"], 0.5, "mark", 10)["auc"] for x in xs.values())
        same = "the same" if f"{now.mean:.3f}" == f"{old:.3f}" else "**not the same**"
        out.append(f"{arm}: AUC {now.mean:.3f} here, {old:.3f} in the previous report ({same})")
    return out


def decision_section(add, decision: X.Decision, runs: X.Runs, missed: dict | None = None) -> None:
    add("## The decisions")
    add("")
    add("By the rule fixed before any run (design history, last entry"
        + (f", commit `{DECISION_COMMIT}`" if DECISION_COMMIT else "") + "):")  # fmt: skip
    add("")
    for line in decision.reasons:
        add(f"- {line}")
    add(f"- new defaults for P5: **cap={decision.cap}, context={decision.context}** "
        f"(`{decision.spec()}`)")  # fmt: skip
    for line in checks(runs):
        add(f"- check: {line}")
    if X.CELL in (missed or {}):
        add(f"- check: {label(X.CELL)}'s warm start missed its target (*Starting points*): every "
            "arm above starts RL from a policy the other cells would not start from, so these "
            "decisions follow the rule on weaker evidence than it was written for")  # fmt: skip
    add("")


def p5_claim(tab: C.Table, decision: X.Decision) -> tuple[C.Claim, C.Claim]:
    """P5 at the decided defaults (its rule unchanged: the slope in K of each seed's MRTPO −
    GDPO Δ AUC), and the same slope for the joint ablation."""
    cells = set(X.p5_cells())

    def renamed(spec: str) -> C.Table:
        return {c: {"mrtpo": by.get(spec, {}), "gdpo": by.get(X.GDPO, {})}
                for c, by in tab.items() if c in cells}  # fmt: skip

    title = "The gain grows with K at the longest free part (new defaults)"
    main = _slope_claim(5, title, renamed(decision.spec()), 0)
    joint = _slope_claim(5, "joint − GDPO, the same slope", renamed(decision.spec(X.JOINT)), 0)
    return main, joint


def missed_starts(opts: LongOptions) -> dict:
    """P5's cells whose clean pass stopped at its step limit short of its success target, with
    where it stopped: such a cell does not start RL where the others do (issue 42's rule)."""
    from mrtpo.lightning.sft import read_summary

    out = {}
    for cell in X.p5_cells():
        policy = cell_dir(opts.logdir, cell) / SFT_PHASES[0] / "policy"
        summary = read_summary(policy) if policy.exists() else {}
        if not summary.get("reached", True):
            out[cell] = summary
    return out


def p5_without_missed(add, tab: C.Table, decision: X.Decision, missed: dict) -> None:
    """Issue 42's rule for a cell whose warm start missed: say so, and read P5 over the rest."""
    for cell, summary in missed.items():
        success = (summary.get("history") or [{}])[-1].get("success", math.nan)
        add(f"   - {label(cell)} did not reach its start: its clean pass stopped at its step "
            f"limit ({summary.get('steps', '–')} steps) at held-out success {success:.3f}, "
            "short of the target every other cell starts from (*Starting points* below)")  # fmt: skip
    rest = {c: by for c, by in tab.items() if c not in missed}
    if len({c[0] for c in rest if c in set(X.p5_cells())}) < 2:
        return
    main, joint = p5_claim(rest, decision)
    add(f"   - by the rule fixed for K = 8's chain (issue 42, design history), P5 over the cells "
        f"that did: {main.verdict}: {main.statistic}")  # fmt: skip
    joint_stat = joint.statistic.replace("MRTPO − GDPO", "joint − GDPO")
    add(f"   - the joint ablation over the same cells: {joint.verdict}: {joint_stat}")


def p5_section(add, tab: C.Table, decision: X.Decision, missed: dict | None = None) -> None:
    main, joint = p5_claim(tab, decision)
    add("## P5 at the new defaults")
    add("")
    add(f"GDPO, the joint ablation and MRTPO at cap={decision.cap}, context={decision.context}, "
        f"K = {', '.join(map(str, X.P5_K))} at 60 words, {X.SEEDS} seeds each; the rule is the "
        "design's P5.")  # fmt: skip
    add("")
    add(main.line())
    joint_stat = joint.statistic.replace("MRTPO − GDPO", "joint − GDPO")
    add(f"   - beside it, the joint ablation: {joint.verdict}: {joint_stat}")
    if missed:
        p5_without_missed(add, tab, decision, missed)
    add("")


def _diag_cells(runs: X.Runs, spec: str, key: str) -> str:
    vals = [x["diag"].get(key, math.nan) for x in runs.values()]
    iv = mean_ci(v for v in vals if not math.isnan(v))
    if math.isnan(iv.mean):
        return "–"
    digits = 2 if abs(iv.mean) >= 0.1 or iv.mean == 0 else 4
    return f"{iv.mean:.{digits}f}"


def diagnostics_section(add, runs: X.Runs) -> None:
    """One row per (cell, arm) with replay: the credit diagnostics, each the mean over its
    seeds of the run's mean over steps (``credit.read_diagnostics``)."""
    cols = [("q/q̄ p50", "q_p50"), ("p99", "q_p99"), ("max", "q_max"), ("cosine", "cosine"),
            *((f"energy: {s}", f"share/{s}") for s in SEGMENTS),
            ("cap binds", "cap_bound"), ("sign flips", "sign_flip"),
            ("credit change", "credit_change")]  # fmt: skip
    add("## Credit diagnostics per arm")
    add("")
    add("Per run, the mean over its steps of each per-step diagnostic in its `metrics.csv`, then "
        "the mean over seeds: q/q̄ quantiles over replayed tokens, the mean pairwise cosine of a "
        "response's reward profiles, the share of the reallocated credit's energy on each part "
        "of the response (the closing tag is `close`), the share of tokens where the cap binds, "
        "the share whose sign differs from the response's, and the mean relative change of a "
        "response's total credit.")  # fmt: skip
    add("")
    add("| cell | arm | " + " | ".join(h for h, _ in cols) + " |")
    add("|---|---|" + "---|" * len(cols))
    for cell in sorted(runs):
        for spec, by_seed in sorted(runs[cell].items()):
            if spec == X.GDPO:
                continue
            vals = [_diag_cells(by_seed, spec, k) for _, k in cols]
            add(f"| {cell_label(cell)} | {arm_of(spec)} | " + " | ".join(vals) + " |")
    add("")


def drawn_check(runs: X.Runs) -> list[tuple[str, C.Interval, C.Interval, str]]:
    """Per check arm: the closing tag's energy share in the drawn cell and in the fixed cell,
    and the verdict (passes when the drawn cell's interval lies wholly below CLOSE_SHARE)."""
    out = []
    for name, spec in X.CHECK_ARMS.items():
        shares = [
            mean_ci(x["diag"].get("share/close", math.nan)
                    for x in runs.get(cell, {}).get(spec, {}).values())
            for cell in (X.DRAWN_CELL, X.CELL)
        ]  # fmt: skip
        v = C.below_verdict(shares[0], CLOSE_SHARE)
        word = {C.REPRODUCED: "passes", C.NOT_REPRODUCED: "fails"}.get(v, "inconclusive")
        out.append((name, shares[0], shares[1], word))
    return out


def drawn_section(add, runs: X.Runs) -> None:
    add("## The drawn-length check")
    add("")
    add(f"Does the closing tag stop carrying the energy when the free part's length is drawn "
        f"per prompt ({DRAWN_RANGE[0]}–{DRAWN_RANGE[1]} words) instead of fixed at 60? Passes "
        f"when the drawn cell's closing-tag share of the reallocated energy lies wholly below "
        f"{CLOSE_SHARE:g}.")  # fmt: skip
    add("")
    add("| arm | drawn: `close` share | fixed 60: `close` share | check |")
    add("|---|---|---|---|")
    rows = drawn_check(runs)
    for name, drawn, fixed, word in rows:
        add(f"| {name} | {C.level_text(drawn)} | {C.level_text(fixed)} | **{word}** |")
    add("")
    if any(C.below_verdict(fixed, CLOSE_SHARE) == C.REPRODUCED for _, _, fixed, _ in rows):
        add(f"The fixed-length cell's share lies below {CLOSE_SHARE:g} as well (the audit found "
            "51–55% on `</` at K = 8 on the previous report's warm start): on these warm starts "
            "the check cannot tell what drawing the length changes.")  # fmt: skip
        add("")


def starts_section(add, opts: LongOptions, tab: C.Table) -> None:
    """The long toy's table of where each cell's warm-start passes stopped and how RL started
    (cells whose warm start is there), and the clean passes run only as another's start."""
    from mrtpo.lightning.sft import read_summary

    cells = []
    for cell in opts.cells:
        if warm_start(opts.logdir, cell).exists():
            sft = {
                ph: read_summary(cell_dir(opts.logdir, cell) / ph / "policy") for ph in SFT_PHASES
            }
            cells.append(CellRuns(cell, sft, {}))
    if cells:
        _starts(add, cells, tab)
        _chain(add, opts)


def design_section(add, opts: LongOptions, wall_s: float) -> None:
    add("## Design (fixed before any run)")
    add("")
    add(f"- the cell {label(X.CELL)} with {opts.seeds} seeds, {opts.steps} RL steps, arms "
        + ", ".join(f"{k} (`{v}`)" for k, v in X.ARMS.items())
        + "; then P5 at K = " + ", ".join(map(str, X.P5_K)) + " for GDPO, joint and MRTPO at the "
        "decided defaults; the drawn-length check at " + cell_label(X.DRAWN_CELL)
        + f" ({', '.join(X.CHECK_ARMS)}, {min(X.CHECK_SEEDS, opts.seeds)} seeds)")  # fmt: skip
    if opts.warm_from:
        add(f"- warm starts of the fixed cells reused from `{opts.warm_from}` (`--warm-from`)")
    add("- the long toy's predictions, as first stated:")
    for p in PREDICTIONS:
        add(f"  - {p}")
    add("- how the design came about, in order (the last entry is this experiment's rule):")
    for line in DESIGN_HISTORY:
        add(f"  - {line}")
    add(f"- wall time: **{wall_s / 60:.1f} min** on {os.cpu_count()} CPU cores ({opts.workers} "
        f"worker processes, {opts.threads} thread each; {platform.machine()})")  # fmt: skip
    add("")


def write_report(runs: X.Runs, opts: LongOptions, wall_s: float, out: Path) -> Path:
    tab = X.table(runs, opts.threshold)
    decision = X.decide(tab)
    lines: list[str] = []
    add = lines.append
    add("# The long toy: credit that measures information (issue 49)")
    add("")
    add(
        f"_Generated by `scripts/replicate.py --long --credit` on "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, runs from commit "
        f"`{opts.commit}`, report written at commit `{source_commit()}`; do not edit by hand._"
    )
    add("")
    lines += recheck_summary(opts.logdir, opts.commit)
    add(
        "The previous full report found MRTPO behind GDPO and the joint ablation at K = 8. This "
        "one tests the two fixes issue 49 built, the cap per token and contexts that keep "
        "every position, at that cell, then asks P5 again at the defaults they decide."
    )
    add("")
    design_section(add, opts, wall_s)
    missed = missed_starts(opts)
    decision_section(add, decision, runs, missed)
    arms_section(add, tab)
    p5_section(add, tab, decision, missed)
    diagnostics_section(add, runs)
    drawn_section(add, runs)
    starts_section(add, opts, tab)
    add("## Reproduce")
    add("")
    add("```")
    add("python scripts/replicate.py --long --credit --warm-from <long-toy run>  # the runs")
    add("python scripts/replicate.py --long --credit --dry-run                   # the plan")
    add("python scripts/replicate.py --long --report-only --logdir <this run's folder>")
    add("python scripts/replicate.py --long --report-only --recheck --logdir <it>  # part again")
    add("```")
    add("")
    add(f"Raw runs are under `{os.path.relpath(opts.logdir, opts.docs.parent)}`.")
    add("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


_RUN_KEYS = ("seeds", "steps", "threshold", "sft_max_steps", "sft_seed", "workers", "threads",
             "override", "sft_override", "commit", "warm_from", "credit")  # fmt: skip


def _start(opts: LongOptions, console) -> bool:
    """Record the run's options and run both phases."""
    opts.logdir.mkdir(parents=True, exist_ok=True)
    opts.commit = opts.commit or source_commit()
    saved = {k: getattr(opts, k) for k in _RUN_KEYS}
    saved["warm_from"] = None if opts.warm_from is None else str(Path(opts.warm_from).resolve())
    (opts.logdir / "run.json").write_text(json.dumps(saved, indent=2))
    return X.run_phases(opts, console)


@quieted()
def main(opts: LongOptions) -> int:
    """Plan (``dry_run``), run, or re-read (``report_only``) the experiment; write its report."""
    from rich.console import Console

    console = Console()
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    default = ROOT / "logs" / "replicate_long" / f"{stamp}_credit"
    opts.logdir = run_folder(opts.logdir, opts.report_only, default, "a run")
    opts = X.credit_options(opts)
    if opts.dry_run:
        for line in X.plan(opts):
            console.print(line, markup=False, highlight=False)
        return 0
    run_file, wall_file = opts.logdir / "run.json", opts.logdir / "wall_s.json"
    t0 = time.perf_counter()
    if opts.report_only:
        for key, value in json.loads(run_file.read_text()).items():
            setattr(opts, key, value)
        if opts.recheck:
            chosen = opts.logdir / "decision.json"
            if not chosen.is_file():
                raise SystemExit(f"{chosen} is missing: --recheck needs a finished run folder")
            chosen = json.loads(chosen.read_text())
            decision = X.Decision(chosen["cap"], chosen["context"])
            jobs = X.phase1_jobs(opts) + X.phase2_jobs(opts, decision)
            recheck(jobs, opts.logdir, opts.workers, opts.threads, console)
    elif not _start(opts, console):
        return 1
    else:
        prev = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else 0.0
        wall_file.write_text(json.dumps({"wall_s": prev + time.perf_counter() - t0}))
    wall = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else float("nan")
    out = write_report(X.read_runs(opts), opts, wall, opts.docs / "replication_long.md")
    console.print(f"[bold green]report:[/bold green] {out}  (wall time {wall / 60:.1f} min)")
    return 0
