"""The long toy (``make replicate ARGS=--long``; docs/replication_long.md): a setting where
per-reward credit assignment can matter.

The toy replication's responses are 4–9 tokens long, so there is little to place credit on.
Here every response opens with a free part the checkers never read (``<think>``, filler words,
``</think>``; ``task.free_tokens``) before the answer words they read, and the few-token reward
``mark`` starts rare (its references carry the right mark with probability
``task.mark_success`` in the second warm-start pass). The free part's length is the design axis:
one *cell* is a (K, free length) pair with its own warm start, and every method and seed of a
cell runs from it.

The warm starts follow the toy replication's two passes (``toy_long_sft``, then
``toy_long_sft_noisy``, which stops when the constraints other than ``mark`` are met together
at the toy's rate). A cell's clean pass starts from the clean policy of the cell it learns from
(``start_of``): free part 0 from random weights, a longer free part from the same K's
free-part-0 policy, which already reads the constraints. K = 8 is the exception: its free-part-0
pass learns to read the constraints only from a policy that already reads 8 of them in the toy
replication's format (no free part, no markers), so its chain runs through two toy-format
passes first, K = 4 to its target and K = 8 for ``TOY_READER_STEPS`` (the design history in
``long_report`` has the diagnosis).

Jobs, statistics and claim rules are the toy replication's (``replication.jobs``,
``replication.claims``); this module lays out the cells, runs them and reads them back, and
``long_report`` writes the report (its ``main`` is the entry point: run, then report).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrtpo.evaluate.analysis.runs import read_jsonl, read_metrics, run_series
from mrtpo.run.config import compose
from replication.harness import ROOT, method_dir, parse_method
from replication.jobs import Job, recorded_csv, run_all

Cell = tuple[int, int]  # (K, free part length in filler words, or TOY)

#: The "free part" of a toy-format cell: the toy replication's prompt and response, without
#: the free-part sentence and markers. Such a cell is only a step of a warm-start chain.
TOY = -1

#: The "free part" of a drawn-length cell: each prompt's free part has its own length, drawn
#: from ``DRAWN_RANGE`` (``task.free_tokens=[lo,hi]``), so when to close it cannot be counted.
DRAWN = -2
DRAWN_RANGE = (30, 90)
#: Steps of a drawn-length cell's clean pass (from the same K's 60-word clean policy): a fixed
#: number, since that policy already meets the success target on its first check.
DRAWN_STEPS = 300

#: The free part's lengths (filler words; each adds 6 marker tokens around it).
FREE = (0, 20, 60)
LONG_FREE = max(FREE)
#: The quick mode: the two ends of the length axis at K = 2, whose warm starts take about 2 min
#: here against about 26 for K = 4's (docs/replication_long.md's history).
QUICK_CELLS: tuple[Cell, ...] = ((2, 0), (2, LONG_FREE))
#: The full mode: the length axis at K = 4, and K = 2, 4 and 8 at the longest free part.
FULL_CELLS: tuple[Cell, ...] = (*((4, f) for f in FREE), (2, LONG_FREE), (8, LONG_FREE))
#: Steps of a toy-format pass above K = 4 (K = 8's chain): enough to read every constraint
#: but the include words (the diagnosis: `first` 1.00 from step 1875; its target of 0.6 took
#: 4425 steps in the toy replication, most of them on the include words, which the long
#: format's pass learns anyway).
TOY_READER_STEPS = 2000
#: Methods run in every cell, and the two ablations, run only at the longest free part.
METHODS = ("gdpo", "mrtpo")
ABLATIONS = ("mrtpo_shuffle", "mrtpo_joint")
QUICK_SEEDS, FULL_SEEDS = 3, 8
#: RL steps of both modes. The preset's 50 would add two thirds to the RL runs' time; at K = 4
#: the curves are still rising at step 30, so AUC over 30 steps measures how fast each method
#: learns, which is what the predictions are about, not where it ends.
QUICK_STEPS = FULL_STEPS = 30
SFT_PHASES = ("sft", "sft_noisy")  # folder names; experiment=toy_long_<name>
#: Tokens generated per response: the toy's 12 for the answer, 6 for the two markers, the free
#: part, and half the free part again to spare (a free part that runs past the limit leaves no
#: answer, which scores 0 on every constraint).
ANSWER_TOKENS, MARKER_TOKENS = 12, 6


def token_budget(free: int) -> int:
    free = DRAWN_RANGE[1] if free == DRAWN else free
    return ANSWER_TOKENS + MARKER_TOKENS + free + free // 2


def start_of(cell: Cell) -> Cell | None:
    """The cell whose clean policy this cell's clean pass starts from (None: random weights):
    a longer free part from the same K's free part 0; K ≥ 8 at free part 0 from the same K's
    toy-format policy, which starts from half K's (down to K = 4, from random weights); a
    drawn-length cell from the same K's longest fixed free part."""
    k, free = cell
    if free == DRAWN:
        return (k, LONG_FREE)
    if free > 0:
        return (k, 0)
    if k < 8:
        return None
    return (k, TOY) if free == 0 else (k // 2, TOY)


def cell_name(cell: Cell) -> str:
    k, free = cell
    if free == DRAWN:
        return f"k{k}_d{DRAWN_RANGE[0]}-{DRAWN_RANGE[1]}"
    return f"k{k}_toy" if free == TOY else f"k{k}_f{free}"


def cell_dir(logdir: Path, cell: Cell) -> Path:
    return logdir / cell_name(cell)


def warm_start(logdir: Path, cell: Cell) -> Path:
    return cell_dir(logdir, cell) / SFT_PHASES[-1] / "policy"


@dataclass
class LongOptions:
    """What one long-toy replication runs (``scripts/replicate.py --long``)."""

    cells: list[Cell] = field(default_factory=lambda: list(QUICK_CELLS))
    seeds: int = QUICK_SEEDS
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    ablations: list[str] = field(default_factory=lambda: list(ABLATIONS))  # longest free part
    steps: int | None = QUICK_STEPS  # RL steps (None: the preset's 50)
    threshold: float = 0.5  # success rate for "steps to threshold"
    sft_max_steps: int | None = None
    sft_seed: int = 0
    workers: int = 2
    threads: int = 1
    logdir: Path | None = None
    docs: Path = ROOT / "docs"
    report_only: bool = False
    override: list[str] = field(default_factory=list)
    sft_override: list[str] = field(default_factory=list)
    full: bool = False
    commit: str | None = None
    #: an earlier long-toy run folder whose warm starts this run reuses instead of making its own
    warm_from: Path | None = None
    #: issue 49's credit experiment (``replication.credit``) instead of the cells' runs
    credit: bool = False
    dry_run: bool = False  # the credit experiment's plan only
    recheck: bool = False  # --report-only: rerun a sample at this code (replication.recheck)


#: The options that decide what a warm start is: a reused one must have been made with these.
_WARM_KEYS = ("sft_max_steps", "sft_seed", "sft_override")


def methods_of(cell: Cell, opts: LongOptions) -> list[str]:
    """The methods a cell runs: every cell ``opts.methods``, the longest free part (of those
    in ``opts.cells``) also the ablations."""
    longest = max(f for _, f in opts.cells)
    extra = [m for m in opts.ablations if m not in opts.methods] if cell[1] == longest else []
    return [*opts.methods, *extra]


def _common(cell: Cell, out: Path, logdir: Path) -> list[str]:
    k, free = cell
    fmt = (
        []
        if free == TOY
        else [  # a toy-format cell keeps toy_sft's own
            "task.free_tokens="
            + (f"[{DRAWN_RANGE[0]},{DRAWN_RANGE[1]}]" if free == DRAWN else str(free)),
            f"rollout.sampling.max_new_tokens={token_budget(free)}",
        ]
    )
    return [
        f"task.num_constraints={k}",
        *fmt,
        f"paths.output_dir={out}",
        f"paths.log_dir={logdir}",
        "++trainer.enable_progress_bar=false",
    ]


#: Overrides that never change a job's step limit (its folders, seed and starting weights).
_NO_STEPS = ("paths.", "seed=", "stage.sft.save_dir=", "model.name_or_path=")


def max_steps(overrides: list[str]) -> int:
    """The step limit of a job's composed config; jobs that differ only in ``_NO_STEPS``
    share one composition (a plan of 150 jobs composes about a dozen configs)."""
    return _max_steps(tuple(o for o in overrides if not o.startswith(_NO_STEPS)))


@functools.cache
def _max_steps(overrides: tuple[str, ...]) -> int:
    return int(compose("train.yaml", list(overrides)).trainer.max_steps)


def sft_key(cell: Cell, phase: str) -> str:
    return f"{cell_name(cell)}/{phase}"


def sft_job(cell: Cell, phase: str, opts: LongOptions) -> Job:
    """Warm-start pass ``phase`` of a cell: the clean pass from ``start_of``'s clean policy (or
    random weights), the noisy pass from the cell's own clean policy. A toy-format cell has a
    clean pass only (``toy_sft``, as the toy replication's)."""
    out = cell_dir(opts.logdir, cell) / phase
    toy = cell[1] == TOY
    if toy and phase != SFT_PHASES[0]:
        raise ValueError(f"a toy-format cell ({cell_name(cell)}) has no {phase} pass")
    experiment = "toy_sft" if toy else f"toy_long_{phase}"
    ov = [f"experiment={experiment}", *_common(cell, out, opts.logdir)]
    ov += [f"stage.sft.save_dir={out / 'policy'}", f"seed={opts.sft_seed}"]
    start = cell if phase != SFT_PHASES[0] else start_of(cell)
    if start is not None:
        src = cell_dir(opts.logdir, start) / SFT_PHASES[0] / "policy"
        ov += [f"model.name_or_path={src}", "model.tiny=null"]
    if toy and cell[0] > 4:
        ov.append(f"trainer.max_steps={TOY_READER_STEPS}")
    if cell[1] == DRAWN and phase == SFT_PHASES[0]:
        ov += [f"trainer.max_steps={DRAWN_STEPS}", f"stage.sft.min_steps={DRAWN_STEPS}"]
    if opts.sft_max_steps is not None:
        ov.append(f"trainer.max_steps={opts.sft_max_steps}")
    ov += opts.sft_override
    steps = max_steps(ov)
    after = () if start is None else (sft_key(start, SFT_PHASES[0]),)
    return Job(sft_key(cell, phase), ov, out, steps, after)


def rl_job(cell: Cell, method: str, seed: int, opts: LongOptions) -> Job:
    """RL run of a method spec from the cell's warm start (same prompts and sampling seed for
    every method of a seed)."""
    out = cell_dir(opts.logdir, cell) / method_dir(method) / f"s{seed}"
    name, method_ov = parse_method(method)
    ov = ["experiment=toy_long", f"method={name}", *method_ov, f"seed={seed}"]
    ov += [f"model.name_or_path={warm_start(opts.logdir, cell)}", "model.tiny=null"]
    ov += _common(cell, out, opts.logdir)
    if opts.steps is not None:
        ov.append(f"trainer.max_steps={opts.steps}")
    ov += opts.override
    steps = max_steps(ov)
    return Job(f"{cell_name(cell)}/{method}/s{seed}", ov, out, steps,
               (sft_key(cell, SFT_PHASES[-1]),))  # fmt: skip


def sft_waves(cells: list[Cell]) -> list[list[tuple[Cell, str]]]:
    """Warm-start passes in the order they can run: clean passes once the clean pass they start
    from is done (run even for a cell not compared itself), then every noisy pass."""
    todo: set[Cell] = set()
    for c in cells:
        while c is not None and c not in todo:
            todo.add(c)
            c = start_of(c)
    waves, done = [], set()
    while todo:
        ready = sorted(c for c in todo if start_of(c) is None or start_of(c) in done)
        waves.append([(c, SFT_PHASES[0]) for c in ready])
        done |= set(ready)
        todo -= set(ready)
    waves.append([(c, SFT_PHASES[1]) for c in cells])
    return waves


def reuse_warm_starts(opts: LongOptions) -> str:
    """Copy the warm-start passes of ``opts.cells`` from the run folder ``opts.warm_from``
    (policies, metrics and job records), so that their SFT jobs count as done; return the
    commit they were made at. Refused, naming what differs, unless that run made them with the
    same SFT options and holds every pass needed. Nothing is written to ``warm_from``."""
    import shutil

    src = Path(opts.warm_from).resolve()
    run = src / "run.json"
    if not run.exists():
        raise ValueError(f"--warm-from {src}: no run.json there; give a long-toy run folder")
    saved = json.loads(run.read_text())
    differ = [k for k in _WARM_KEYS if saved.get(k) != getattr(opts, k)]
    if differ:
        raise ValueError(
            f"--warm-from {src}: its warm starts were made with other SFT options "
            + ", ".join(f"{k}={saved.get(k)!r} (here {getattr(opts, k)!r})" for k in differ)
        )
    needed = [(c, ph) for wave in sft_waves(list(opts.cells)) for c, ph in wave]
    missing = []
    for cell, phase in needed:
        job = cell_dir(src, cell) / phase / "job.json"
        ok = job.exists() and not json.loads(job.read_text()).get("error")
        if not ok or not (job.parent / "policy").is_dir():
            missing.append(sft_key(cell, phase))
    if missing:
        raise ValueError(f"--warm-from {src}: no finished warm start for {', '.join(missing)}")
    for cell, phase in needed:
        frm, to = cell_dir(src, cell) / phase, cell_dir(opts.logdir, cell) / phase
        if (to / "job.json").exists():
            continue
        shutil.copytree(frm, to, dirs_exist_ok=True)
        info = json.loads((to / "job.json").read_text())
        csv = Path(info.get("csv") or "")
        if csv.is_relative_to(frm):  # the metrics now lie in the copy
            info["csv"] = str(to / csv.relative_to(frm))
        info["copied_from"] = str(frm)
        (to / "job.json").write_text(json.dumps(info, indent=2))
    return str(saved.get("commit"))


def _chain_first(jobs: list[Job]) -> list[Job]:
    """Warm-start ``jobs`` (in ``sft_waves`` order: every job after those it waits for)
    reordered so that the job with the longest chain of jobs waiting on it comes first: K = 8's
    chain takes about as long as every other warm start together, so it must never queue
    behind them."""
    below: dict[str, int] = {}
    for job in reversed(jobs):
        kids = [below[j.key] for j in jobs if job.key in j.after and j.key in below]
        below[job.key] = 1 + max(kids, default=0)
    return sorted(jobs, key=lambda j: -below[j.key])


def cell_jobs(opts: LongOptions) -> tuple[list[Job], list[Job]]:
    """The cells' warm-start passes (longest chain first) and their RL runs."""
    passes = [p for wave in sft_waves(list(opts.cells)) for p in wave]
    sft = _chain_first([sft_job(c, phase, opts) for c, phase in passes])
    rl = [rl_job(c, m, s, opts) for c in opts.cells for s in range(opts.seeds)
          for m in methods_of(c, opts)]  # fmt: skip
    return sft, rl


def run_cells(opts: LongOptions, console) -> bool:
    """Every warm start and every RL run, in one pool: a job starts once the pass it starts
    from is done, the longest warm-start chain first (finished jobs are skipped: a rerun
    resumes)."""
    if opts.warm_from is not None:
        try:
            made = reuse_warm_starts(opts)
        except ValueError as exc:
            console.print(f"[red]{exc}")
            return False
        console.print(f"warm starts reused from {opts.warm_from} (made at commit {made})")
    sft, rl = cell_jobs(opts)
    res = run_all([*sft, *rl], opts.workers, opts.threads, console, "Warm starts and RL runs")
    failed = [j.key for j in sft if res.get(j.key, {}).get("error")]
    if failed:
        console.print(f"[red]warm start failed for {failed}: their cells' RL runs did not run")
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Reading the runs
# ---------------------------------------------------------------------------------------------

#: Per-step columns read beside ``run_series`` (the cap s and the response length).
EXTRA_COLUMNS = {"train/adv/cap_s": "cap_s", "train/response_len/mean": "length"}


def read_run(csv: str | Path) -> dict[str, list[float]]:
    """``run_series`` of one RL run plus the columns of ``EXTRA_COLUMNS``."""
    out = run_series(csv)
    rows = sorted((r for r in read_metrics(csv) if "train/success" in r), key=lambda r: r["step"])
    for col, name in EXTRA_COLUMNS.items():
        if any(col in r for r in rows):
            out[name] = [r.get(col, float("nan")) for r in rows]
    return out


@dataclass
class CellRuns:
    cell: Cell
    sft: dict[str, dict[str, Any]]  # SFT summary per warm-start pass
    runs: dict[str, dict[int, dict[str, list[float]]]]  # method -> seed -> series
    relevance: list[dict] = field(default_factory=list)  # relevance.jsonl records, MRTPO runs


def read_cells(opts: LongOptions) -> list[CellRuns]:
    from mrtpo.lightning.sft import read_summary

    out = []
    for cell in opts.cells:
        d = cell_dir(opts.logdir, cell)
        if not warm_start(opts.logdir, cell).exists():
            continue
        sft = {ph: read_summary(d / ph / "policy") for ph in SFT_PHASES}
        runs: dict[str, dict[int, dict[str, list[float]]]] = {}
        recs: list[dict] = []
        for m in methods_of(cell, opts):
            for s in range(opts.seeds):
                job = d / method_dir(m) / f"s{s}" / "job.json"
                info = json.loads(job.read_text()) if job.exists() else {}
                if info.get("error") or not info.get("csv"):
                    continue
                series = read_run(recorded_csv(Path(info["csv"]), job.parent))
                if series["success"]:
                    runs.setdefault(m, {})[s] = series
                if m == "mrtpo":
                    for path in sorted(job.parent.rglob("relevance.jsonl")):
                        recs += [dict(r, seed=s) for r in read_jsonl(path)]
        out.append(CellRuns(cell, sft, runs, recs))
    return out
