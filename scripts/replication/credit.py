"""The credit experiment of issue 49 (``scripts/replicate.py --long --credit``): the cap and
the context form of MRTPO's credit, tested at the cell where the long toy found MRTPO behind
(K = 8, 60 free words), then P5 again at the new defaults.

Two phases, each one pool of jobs (``replication.jobs.run_all``):

1. every warm start not reused, the six arms of the cell (``ARMS``: GDPO, the joint ablation and
   MRTPO × cap {batch, token} × context {delete, mask}) for ``SEEDS`` seeds, GDPO at the other
   K of P5, and the drawn-length check (``DRAWN_CELL``: MRTPO at cap=token in both contexts);
2. after ``decide`` has applied the decision rule (the design history in ``long_report``, fixed
   before any run) to phase 1's runs: MRTPO and the joint ablation at the new defaults (cap
   token or batch, context mask or delete, as decided) at the other K, and the joint ablation
   at K = 8 in that context when phase 1 did not run it.

Every method is named with its cap and context (``mrtpo@cap=token,context=mask``), so no arm
depends on what ``configs/method/mrtpo.yaml`` says. The fixed 60-word cells are the long toy's
own, so their warm starts can be reused (``--warm-from``); the drawn cell's are made here from
the K = 8 60-word clean policy. ``estimate`` gives the plan's minutes from the previous full
report's timings (``plan`` prints them; ``--dry-run``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from mrtpo.evaluate.analysis.runs import read_metrics
from mrtpo.evaluate.analysis.stats import Interval, mean_ci
from replication import claims as C
from replication.harness import method_dir
from replication.jobs import Job, recorded_csv, run_all
from replication.long import (
    DRAWN,
    DRAWN_RANGE,
    DRAWN_STEPS,
    LONG_FREE,
    SFT_PHASES,
    TOY,
    Cell,
    LongOptions,
    _chain_first,
    cell_dir,
    cell_name,
    read_run,
    reuse_warm_starts,
    rl_job,
    sft_job,
    sft_key,
    sft_waves,
)

CELL: Cell = (8, LONG_FREE)
P5_K = (2, 4, 8)
SEEDS = 8
#: Seeds of the drawn-length check: it reads diagnostics, not a paired difference in AUC.
CHECK_SEEDS = 4
DRAWN_CELL: Cell = (8, DRAWN)
GDPO, JOINT = "gdpo", "mrtpo_joint"


def mrtpo(cap: str, context: str, name: str = "mrtpo") -> str:
    return f"{name}@cap={cap},context={context}"


#: The arms of the cell: label -> method spec.
ARMS: dict[str, str] = {
    "gdpo": GDPO,
    "joint": mrtpo("token", "delete", JOINT),
    **{f"{cap}/{ctx}": mrtpo(cap, ctx) for cap in ("batch", "token") for ctx in ("delete", "mask")},
}
#: The drawn-length check's arms.
CHECK_ARMS = {k: ARMS[k] for k in ("token/delete", "token/mask")}


def p5_cells() -> list[Cell]:
    return [(k, LONG_FREE) for k in P5_K]


@dataclass
class Decision:
    """What the decision rule chose, and the numbers it chose by (label -> interval)."""

    cap: str
    context: str
    numbers: dict[str, Interval] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    def spec(self, name: str = "mrtpo") -> str:
        return mrtpo(self.cap, self.context, name)


# ---------------------------------------------------------------------------------------------
# The decision rule (stated in long_report.DESIGN_HISTORY before any run)
# ---------------------------------------------------------------------------------------------


def per_seed(tab: C.Table, cell: Cell, pairs: list[tuple[str, str]], key: str = "auc"):
    """Each seed's mean over ``pairs`` (arm labels a, b) of a − b; seeds that lack any arm are
    left out. One number per seed: the pairs share the seed's prompts, so they are one
    observation."""
    runs = tab.get(cell, {})
    seeds = set.intersection(*[set(runs.get(ARMS[x], {})) for p in pairs for x in p])
    return {s: sum(runs[ARMS[a]][s][key] - runs[ARMS[b]][s][key] for a, b in pairs) / len(pairs)
            for s in sorted(seeds)}  # fmt: skip


def _interval(d: dict) -> Interval:
    return mean_ci(d.values())


def decide(tab: C.Table, cell: Cell = CELL) -> Decision:
    """The rule: the cap stays ``token`` unless token − batch (per seed, averaged over the two
    contexts) lies wholly below 0; the context becomes ``mask`` only when mask − delete at the
    chosen cap lies wholly above 0 (inconclusive keeps the paper's ``delete``)."""
    cap_d = per_seed(tab, cell, [("token/delete", "batch/delete"), ("token/mask", "batch/mask")])
    cap_iv = _interval(cap_d)
    cap = "batch" if C.claim_verdict(cap_iv, +1) == C.NOT_REPRODUCED else "token"
    ctx_d = per_seed(tab, cell, [(f"{cap}/mask", f"{cap}/delete")])
    ctx_iv = _interval(ctx_d)
    context = "mask" if C.claim_verdict(ctx_iv, +1) == C.REPRODUCED else "delete"
    half = per_seed(tab, cell, [("token/mask", "token/delete"), ("batch/delete", "batch/mask")])
    inter = {s: 2 * v for s, v in half.items()}  # (mask − delete at token) − (at batch)
    numbers = {"cap": cap_iv, "context": ctx_iv, "interaction": _interval(inter)}
    reasons = [
        f"cap: token − batch, Δ AUC per seed over both contexts {C.ci_text(cap_iv)} → "
        + (f"**{cap}**" if cap == "batch" else "**token** (not wholly below 0)"),
        f"context: mask − delete at cap={cap}, Δ AUC {C.ci_text(ctx_iv)} → **{context}**"
        + ("" if context == "mask" else " (mask needs the interval wholly above 0)"),
        f"beside them, the interaction (mask − delete at token) − (at batch) "
        f"{C.ci_text(numbers['interaction'])}",
    ]
    return Decision(cap, context, numbers, reasons)


# ---------------------------------------------------------------------------------------------
# The plan: jobs of each phase, and their minutes
# ---------------------------------------------------------------------------------------------


def credit_options(opts: LongOptions) -> LongOptions:
    """``opts`` with the experiment's cells (P5's and the drawn check's)."""
    cells = [*p5_cells(), DRAWN_CELL]
    return dataclasses.replace(opts, cells=cells, methods=[GDPO], ablations=[])


def _sft_jobs(opts: LongOptions) -> list[Job]:
    passes = [p for wave in sft_waves(list(opts.cells)) for p in wave]
    return _chain_first([sft_job(c, phase, opts) for c, phase in passes])


def phase1_jobs(opts: LongOptions) -> list[Job]:
    """Warm starts, the cell's arms, GDPO at P5's other K, the drawn-length check."""
    jobs = _sft_jobs(opts)
    jobs += [rl_job(CELL, spec, s, opts) for s in range(opts.seeds) for spec in ARMS.values()]
    others = [c for c in p5_cells() if c != CELL]
    jobs += [rl_job(c, GDPO, s, opts) for c in others for s in range(opts.seeds)]
    check = min(CHECK_SEEDS, opts.seeds)
    jobs += [
        rl_job(DRAWN_CELL, spec, s, opts) for s in range(check) for spec in CHECK_ARMS.values()
    ]
    return jobs


def phase2_jobs(opts: LongOptions, decision: Decision) -> list[Job]:
    """MRTPO and the joint ablation at the decided defaults where phase 1 did not run them."""
    done = set(ARMS.values())
    jobs = []
    for cell in p5_cells():
        for spec in (decision.spec(), decision.spec(JOINT)):
            if cell == CELL and spec in done:
                continue
            jobs += [rl_job(cell, spec, s, opts) for s in range(opts.seeds)]
    return jobs


#: Minutes of one worker, from the previous full report (63.8 min on 2 workers = 127.6
#: worker-minutes): its warm starts' steps at 0.25 s a step without a free part (K = 8's
#: 4050 steps took 17 min), 0.15 s in the toy format and 0.68 s at 60 words (the quick runs'
#: ratio of 60-word to free-part-0 steps, 2.7), about 77 worker-minutes, leave about 50 for its
#: 128 RL runs: 0.46 min for a 60-word run at K = 4, scaled by the replayed contexts (K + 1).
SFT_S_PER_STEP = {0: 0.25, TOY: 0.15, LONG_FREE: 0.68, DRAWN: 0.75}
NOISY_MIN = 1.5
RL_MIN = {2: 0.40, 4: 0.46, 8: 0.60}
#: The clean passes' steps in the previous full report (a pass of a cell made anew here).
SFT_STEPS = {(2, 0): 150, (2, LONG_FREE): 50, (4, 0): 1725, (4, LONG_FREE): 1550, (4, TOY): 625,
             (8, TOY): 2000, (8, 0): 4050, (8, LONG_FREE): 1550, DRAWN_CELL: DRAWN_STEPS}  # fmt: skip


def job_minutes(job: Job, reused: frozenset[str] = frozenset()) -> float:
    """A job's estimated worker-minutes (0 when its ``job.json`` says it is done, or its key
    is one of the warm starts ``reused``)."""
    done = job.out / "job.json"
    if job.key in reused or (done.exists() and not json.loads(done.read_text()).get("error")):
        return 0.0
    name, _, rest = job.key.partition("/")
    cell = next(c for c in _known_cells() if cell_name(c) == name)
    if rest == SFT_PHASES[1]:
        return NOISY_MIN
    if rest == SFT_PHASES[0]:
        return SFT_STEPS.get(cell, 1550) * SFT_S_PER_STEP.get(cell[1], 0.68) / 60
    return RL_MIN.get(cell[0], 0.6) * job.steps / 30


def _known_cells() -> list[Cell]:
    return [*SFT_STEPS, *p5_cells()]


def estimate(jobs: list[Job], workers: int, reused: frozenset[str] = frozenset()) -> float:
    """Wall minutes of ``jobs`` on ``workers`` workers taking them in order once the jobs they
    wait for are done (``run_all``'s rule), from ``job_minutes``."""
    free = [0.0] * max(1, workers)
    end: dict[str, float] = {}
    left = list(jobs)
    while left:
        job = next(j for j in left if all(k in end or k not in {x.key for x in jobs}
                                           for k in j.after))  # fmt: skip
        left.remove(job)
        i = min(range(len(free)), key=free.__getitem__)
        start = max([free[i], *(end.get(k, 0.0) for k in job.after)])
        end[job.key] = free[i] = start + job_minutes(job, reused)
    return max(free)


def reused_keys(opts: LongOptions) -> frozenset[str]:
    """The warm-start passes ``--warm-from`` would copy: every pass of the fixed cells (none
    when it names no long-toy run folder)."""
    if opts.warm_from is None or not (Path(opts.warm_from) / "run.json").exists():
        return frozenset()
    return frozenset(sft_key(c, ph) for wave in sft_waves(p5_cells()) for c, ph in wave)


def plan(opts: LongOptions) -> list[str]:
    """The experiment's plan, in lines: each phase's jobs and estimated minutes (phase 2 for
    both contexts the rule can choose)."""
    one = phase1_jobs(opts)
    sft = [j for j in one if j.key.rsplit("/", 1)[-1] in SFT_PHASES]
    reused = reused_keys(opts)
    t1 = estimate(one, opts.workers, reused)
    lines = [f"credit experiment → {opts.logdir}  ({opts.workers} workers, {opts.seeds} seeds, "
             f"{opts.steps} RL steps; drawn check: free part {DRAWN_RANGE[0]}–{DRAWN_RANGE[1]} "
             f"words, {min(CHECK_SEEDS, opts.seeds)} seeds)",
             f"phase 1: {len(one)} jobs ({len(sft)} warm-start passes, "
             f"{sum(job_minutes(j, reused) == 0 for j in sft)} of them done or reused), about "
             f"{t1:.0f} min"]  # fmt: skip
    if opts.warm_from is not None and not reused:
        lines.append(f"--warm-from {opts.warm_from}: no long-toy run folder there (no run.json); "
                     "the run would refuse it, and the minutes above make every warm start")  # fmt: skip
    lines += [f"  {j.key}" for j in one]
    for ctx in ("delete", "mask"):
        two = phase2_jobs(opts, Decision("token", ctx))
        t2 = estimate(two, opts.workers)
        lines.append(f"phase 2 if context={ctx}: {len(two)} RL runs, about {t2:.0f} min "
                     f"(total about {t1 + t2:.0f} min)")  # fmt: skip
        lines += [f"  {j.key}" for j in two]
    return lines


# ---------------------------------------------------------------------------------------------
# Running and reading
# ---------------------------------------------------------------------------------------------


def reuse(opts: LongOptions, console) -> bool:
    """Copy the fixed cells' warm starts from ``opts.warm_from`` (the drawn cell's are made)."""
    if opts.warm_from is None:
        return True
    fixed = dataclasses.replace(opts, cells=p5_cells())
    try:
        made = reuse_warm_starts(fixed)
    except ValueError as exc:
        console.print(f"[red]{exc}")
        return False
    console.print(f"warm starts reused from {opts.warm_from} (made at commit {made})")
    return True


def run_phases(opts: LongOptions, console) -> bool:
    """Phase 1, the decision from its runs, then phase 2 (finished jobs are skipped)."""
    if not reuse(opts, console):
        return False
    one = phase1_jobs(opts)
    res = run_all(one, opts.workers, opts.threads, console, "Credit experiment, phase 1")
    failed = [j.key for j in one if res.get(j.key, {}).get("error")]
    if failed:
        console.print(f"[red]phase 1: {len(failed)} jobs failed ({', '.join(failed[:5])})")
        return False
    decision = decide(table(read_runs(opts)))
    (opts.logdir / "decision.json").write_text(json.dumps(dataclasses.asdict(decision) | {
        "numbers": {k: list(v) for k, v in decision.numbers.items()}}, indent=2))  # fmt: skip
    for line in decision.reasons:
        console.print(line)
    two = phase2_jobs(opts, decision)  # with the warm starts they wait for (done: skipped)
    res = run_all([*_sft_jobs(opts), *two], opts.workers, opts.threads, console,
                  "Credit experiment, phase 2")  # fmt: skip
    return not any(res.get(j.key, {}).get("error") for j in two)


#: Diagnostics read from each run's metrics.csv: column -> name (mean over the steps logging it).
DIAG_COLUMNS = {
    "train/replay/q_ratio/p50": "q_p50",
    "train/replay/q_ratio/p99": "q_p99",
    "train/replay/q_ratio/max": "q_max",
    "train/replay/profile_cosine": "cosine",
    "train/adv/cap_bound_share": "cap_bound",
    "train/adv/sign_flip_share": "sign_flip",
    "train/adv/credit_change": "credit_change",
}
SHARE_PREFIX = "train/replay/energy_share/"


def read_diagnostics(csv: str | Path) -> dict[str, float]:
    """Per run: each ``DIAG_COLUMNS`` column and each ``energy_share/<segment>`` (as
    ``share/<segment>``), the mean over the steps that logged it (NaN when none did)."""
    rows = read_metrics(csv)
    cols = {c: n for c, n in DIAG_COLUMNS.items()}
    cols |= {c: "share/" + c.removeprefix(SHARE_PREFIX) for r in rows for c in r
             if c.startswith(SHARE_PREFIX)}  # fmt: skip
    out = {}
    for col, name in cols.items():
        vals = [r[col] for r in rows if col in r and not math.isnan(r[col])]
        out[name] = sum(vals) / len(vals) if vals else math.nan
    return out


Runs = dict[Cell, dict[str, dict[int, dict]]]  # cell -> spec -> seed -> {"series", "diag"}


def read_runs(opts: LongOptions) -> Runs:
    """Every finished RL run of the experiment's cells: its series and diagnostics."""
    out: Runs = {}
    for cell in opts.cells:
        d = cell_dir(opts.logdir, cell)
        if not d.is_dir():
            continue
        for folder in sorted(p for p in d.iterdir() if p.is_dir() and p.name not in SFT_PHASES):
            for job in sorted(folder.glob("s*/job.json")):
                info = json.loads(job.read_text())
                if info.get("error") or not info.get("csv"):
                    continue
                csv = recorded_csv(Path(info["csv"]), job.parent)
                spec = info.get("spec") or _spec_of(folder.name)
                if spec is None:
                    continue
                seed = int(job.parent.name[1:])
                series = read_run(csv)
                if series.get("success"):
                    out.setdefault(cell, {}).setdefault(spec, {})[seed] = {
                        "series": series, "diag": read_diagnostics(csv)}  # fmt: skip
    return out


def known_specs() -> list[str]:
    caps, ctxs = ("batch", "token", "response", "none"), ("delete", "mask")
    return [GDPO, *(mrtpo(c, x, n) for n in ("mrtpo", JOINT) for c in caps for x in ctxs)]


def _spec_of(folder: str) -> str | None:
    return next((s for s in known_specs() if method_dir(s) == folder), None)


def table(runs: Runs, threshold: float = 0.5) -> C.Table:
    from replication.long_report import summarize

    return {cell: {spec: {s: summarize(x["series"], threshold) for s, x in by_s.items()}
                   for spec, by_s in by_spec.items()} for cell, by_spec in runs.items()}  # fmt: skip
