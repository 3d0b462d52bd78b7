"""Toy replication of the paper's claims, on a CPU (``make replicate``; ``--full`` for K = 2, 4, 8).

For each K (number of rewards): one warm start in two SFT passes — ``experiment=toy_sft`` learns
the task from clean references until held-out success reaches a target, then
``experiment=toy_sft_noisy`` trains on references that often break a constraint until success
has fallen to RL's starting level — then RL from that same checkpoint with every method and
seed (``experiment=toy_replication``; the same prompts and sampling seeds for every method,
since both follow ``seed``). Runs go through ``mrtpo.lightning.pipeline.build`` in worker processes
(``replication.jobs``), one CPU thread each. Then ``toy_report.write_report`` writes
``<docs>/replication.md``: per K, steps to reach a success threshold, final success and area
under the success curve (mean and 95% interval over seeds, and paired differences against
GDPO), learning-curve PNGs, and the relevance statistics — how much of each reward's
Jensen–Shannon relevance falls on the tokens its checker reads — with a picture of one
response shaded by each reward's relevance (PNG and HTML).

The report opens with the design (from the composed presets and this module's constants,
fixed before any result) and one line per claim of the paper — reproduced, not reproduced or
inconclusive, by a rule stated in the design — with its statistic and 95% interval: the gain
over GDPO and its trend in K, the few-token reward's compliance after ``COMPLIANCE_STEP``
steps, the ablation order, the β curve, the replayed share over training, and how
concentrated each reward's relevance is. Nothing in the report is written by hand: every
number and verdict comes from the runs.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrtpo.evaluate.analysis.runs import read_jsonl, read_metrics, run_series
from mrtpo.run.config import CONFIG_DIR, compose
from replication.jobs import Job, recorded_csv, run_all
from replication.plots import plot_curves, plot_relevance
from replication.relevance import pick_record, relevance_stats, replay_records

#: The source checkout (configs/ lives beside src/).
ROOT = CONFIG_DIR.parent
#: Quick mode's methods (``make replicate``).
METHODS = ("grpo", "gdpo", "mrtpo", "mrtpo_shuffle", "mrtpo_joint")
#: The β curve: MRTPO at the paper's other two values (β = 0.5 is plain ``mrtpo``).
BETA_METHODS = ("mrtpo@beta=0.25", "mrtpo@beta=0.75")
#: Baselines that join the full mode once their method config exists.
OPTIONAL_METHODS = ("cort", "opsd")
#: Rollout schedules a method spec may name after its ``@`` (``mrtpo@one_step_off``), with the
#: overrides that run one (issue 39; docs/rollout.md "Schedules"): the HF engine generates
#: batch t + 1 from a private copy of step t's weights while the trainer updates on batch t.
SCHEDULES: dict[str, tuple[str, ...]] = {
    "one_step_off": ("rollout.schedule=one_step_off", "rollout.engine.own_copy=true"),
}
#: Is learning hurt by stale samples? The full mode runs these again under ``one_step_off``,
#: with the seeds, warm start and configs of their ``sync`` runs, at ``SCHEDULE_K`` only.
SCHEDULE_METHODS = ("gdpo@one_step_off", "mrtpo@one_step_off")
SCHEDULE_K = (4,)
BASELINE = "gdpo"
#: Methods whose token weights are phased in, and the share of the run the phase-in takes in
#: these short runs (CoRT: configs/method/cort.yaml's 30 steps are 10% of the 300-step
#: instruction-following presets; here the same 10% of the RL steps).
WARMUP_SHARE = {"cort": 0.1}
#: The toy's design fixed MRTPO's beta from the first RL step (its runs came before the method
#: configs' 10-step ramp, docs/method.md "Schedule"); the harness keeps that, explicitly.
MRTPO_WARMUP_STEPS = 0
SFT_PHASES = ("sft", "sft_noisy")  # folder names; experiment=toy_<name>
#: K -> the K whose clean-pass policy this K's clean pass starts from (a curriculum); every
#: other K starts from random weights. From random weights the toy policy did not learn 6 or
#: 8 constraints at once within the clean pass's step limit (see DESIGN_HISTORY).
CURRICULUM: dict[int, int] = {8: 4}
QUICK_K, FULL_K = (4,), (2, 4, 8)
QUICK_SEEDS, FULL_SEEDS = 5, 8
#: The few-token reward (``task.closing_mark``): the response's closing mark.
FEW_TOKEN = "mark"
#: Claim 2: the few-token reward's compliance "after N steps" (the paper's tool-calling
#: format reward: 97% under MRTPO after 10 steps, 2% under GDPO).
COMPLIANCE_STEP = 10
#: Claim 6: the paper finds 80% of a reward's distance on 13–29% of the tokens.
CONCENTRATION = (0.13, 0.29)
#: What was decided about the design after a look at any run, in the order it happened.
#: (The report repeats this list.)
DESIGN_HISTORY = (
    "Before any run: the second warm-start pass was set to 20% clean references and a stop "
    "at held-out success ≤ 0.25, so that every K crosses the target; it replaces 35% clean "
    "references and at least 200 steps, which stopped wherever step 200 left the policy.",
    "After an SFT-only calibration (no RL): the few-token constraint first replaced each "
    "layout's last constraint, and K = 4's clean pass learned `last` slowly without the word "
    "count (0.23 after 1000 steps), so `mark` takes the last `include` slot instead and the "
    "count stays.",
    "After a second SFT-only calibration (no RL): `first` and `last` were both stuck near "
    "0.5 at K = 4 after 1900 steps (the two words mixed up) while the mark's sentence read "
    "'Put the mark ! at the end.'; it now reads 'Add the mark ! after the words.' (no "
    "'end'). K = 8's clean pass was at 0.004 after 1225 steps; the clean pass's step limit "
    "went from 4000 to 2500 to bound the warm start's time.",
    "After the first quick-mode run (commit 43b4a91), whose RL results had been seen: its "
    "second pass (lr 0.001, checks every 5 steps from step 20) stopped at its first check "
    "with held-out success 0.105, far below the 0.25 target, so the target did not set the "
    "start. The pass now runs at lr 0.0003 and checks every 2 steps from step 2. Nothing "
    "else changed; that run's claim lines read: Δ AUC MRTPO − GDPO +0.013 [+0.008, +0.017], "
    "`mark` compliance after 10 steps MRTPO − GDPO −0.026 [−0.064, +0.013], MRTPO − joint "
    "+0.015 [+0.009, +0.022], joint − GDPO −0.002 [−0.005, +0.000], replayed share falling "
    "from 87% to 19%, top-80% token share 0.465 [0.458, 0.473] (K = 4, 5 seeds).",
    "After the first full-mode run (commit 97a0198), whose RL results had been seen: (a) K = "
    "8's clean pass ended at held-out success 0.008 after 2500 steps, so RL at K = 8 started "
    "at 0.004 against 0.27 and 0.33 at K = 2 and 4. SFT-only calibrations (no RL): from K = "
    "4's clean policy, K = 8's clean pass reached 0.15 after 2500 steps and 0.36–0.44 over "
    "3400 more (only the two `include` constraints stayed near 0.5); from random weights "
    "neither a model of hidden size 128 nor K = 6 had learned anything by steps 300 and 500. "
    "K = 8's clean pass now starts from K = 4's clean policy (CURRICULUM) and the clean "
    "pass's step limit went from 2500 to 5000; K = 8 is still not expected to reach the 0.6 "
    "target, only to stay above the second pass's 0.25. (b) OPSD's AUC was 0.73 below "
    "GDPO's: its teacher, the warm start reading the reference as an earlier answer, had never "
    "seen such a context (greedy, it met all constraints on 2% of held-out prompts after it, "
    "against 91% after the plain prompt). Both SFT passes now show half the examples after "
    "the teacher's context (stage.sft.teacher_share = 0.5), for every method's warm start. In "
    "SFT-and-RL calibrations at K = 4, seed 0 (results seen): with a share of 0.25 the teacher "
    "met all constraints on 81% of held-out prompts (88% after the plain prompt) and one OPSD "
    "run stayed at 0.28 success over 50 steps; with 0.5, 98% (75% after the plain prompt, "
    "copying the reference exactly in 67%), and one OPSD run went from 0.31 to 0.42.",
)


def available_methods(full: bool) -> list[str]:
    """The methods a mode runs: quick, or quick + the β curve + baselines that exist now +
    GDPO and MRTPO under ``one_step_off`` (at ``SCHEDULE_K`` only: ``runs_at``)."""
    if not full:
        return list(METHODS)
    extra = [m for m in OPTIONAL_METHODS if (CONFIG_DIR / "method" / f"{m}.yaml").exists()]
    return [*METHODS, *BETA_METHODS, *extra, *SCHEDULE_METHODS]


_SPEC_FORM = "<method>[@<key>=<value>|@<schedule>[,...]] (e.g. mrtpo@beta=0.25, mrtpo@one_step_off)"


def _spec_parts(spec: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """A method spec's config name and, per part after ``@``, its folder label and overrides:
    ``key=value`` overrides ``method.key``; a name in ``SCHEDULES`` sets the rollout schedule."""
    name, sep, rest = spec.partition("@")
    parts = []
    for kv in rest.split(",") if sep else []:
        key, eq, value = kv.partition("=")
        if name and not eq and key.strip() in SCHEDULES:
            parts.append((key.strip(), list(SCHEDULES[key.strip()])))
            continue
        if not (name and key.strip() and eq and value.strip()):
            raise ValueError(f"method spec {spec!r}: expected {_SPEC_FORM}")
        parts.append((key.strip() + value.strip(), [f"method.{key.strip()}={value.strip()}"]))
    if not name:
        raise ValueError(f"method spec {spec!r} names no method (e.g. mrtpo@beta=0.25)")
    return name, parts


def parse_method(spec: str) -> tuple[str, list[str]]:
    """``"mrtpo@beta=0.25,beta_warmup_steps=5"`` -> ``("mrtpo", ["method.beta=0.25", ...])``:
    a method config and overrides of its keys; ``"gdpo@one_step_off"`` -> ``("gdpo",
    ["rollout.schedule=one_step_off", "rollout.engine.own_copy=true"])`` (``SCHEDULES``)."""
    name, parts = _spec_parts(spec)
    return name, [o for _, ov in parts for o in ov]


def method_dir(spec: str) -> str:
    """Folder of a method spec's runs: ``mrtpo@beta=0.25`` -> ``mrtpo_beta0.25``,
    ``mrtpo@one_step_off`` -> ``mrtpo_one_step_off``."""
    name, parts = _spec_parts(spec)
    return name + "".join("_" + label for label, _ in parts)


def schedule_of(spec: str) -> str:
    """The rollout schedule a method spec names (``sync`` when it names none)."""
    return next((p for p, _ in _spec_parts(spec)[1] if p in SCHEDULES), "sync")


def sync_spec(spec: str) -> str:
    """The same spec without its schedule: the ``sync`` runs a schedule variant pairs with
    (``mrtpo@one_step_off`` -> ``mrtpo``)."""
    name, _, rest = spec.partition("@")
    keep = [p for p in rest.split(",") if p.strip() not in SCHEDULES] if rest else []
    return name + ("@" + ",".join(keep) if keep else "")


def runs_at(spec: str, k: int, k_values: list[int]) -> bool:
    """Whether a method spec runs at K: a schedule variant at the ``SCHEDULE_K`` among the
    run's K values (at every K when there is none of them), any other spec at every K."""
    if schedule_of(spec) == "sync":
        return True
    return k in SCHEDULE_K or not any(x in SCHEDULE_K for x in k_values)


@dataclass
class Options:
    """What one replication runs (the command line of ``scripts/replicate.py``)."""

    k_values: list[int] = field(default_factory=lambda: list(QUICK_K))
    seeds: int = QUICK_SEEDS
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    steps: int | None = None  # RL steps (None: the preset's)
    threshold: float | None = (
        None  # success rate for "steps to threshold" (None: the run's, or 0.5)
    )
    sft_max_steps: int | None = None
    sft_seed: int = 0
    workers: int = 2
    threads: int = 1
    logdir: Path | None = None  # None: logs/replicate/<time>
    docs: Path = (
        ROOT / "docs"
    )  # the report goes to <docs>/replication.md, figures to <docs>/figures
    report_only: bool = False
    relevance_prompts: int = 32
    override: list[str] = field(default_factory=list)  # extra RL overrides
    sft_override: list[str] = field(default_factory=list)  # extra overrides of both SFT passes
    full: bool = False
    commit: str | None = None  # the source commit the runs were made with (run.json)
    determinism: bool = True  # rerun one configuration and compare (determinism.json)
    recheck: bool = False  # --report-only: rerun a sample at this code (replication.recheck)


# What a run was made with: --report-only reads these back from the log folder.
_RUN_KEYS = ("k_values", "seeds", "methods", "steps", "full", "override", "sft_override",
             "sft_max_steps", "sft_seed", "workers", "threads", "commit", "threshold")  # fmt: skip
DEFAULT_THRESHOLD = 0.5


# ---------------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------------


def sft_job(k: int, phase: str, opts: Options) -> Job:
    """Warm-start pass ``phase`` for K; the noisy pass starts from the clean pass's policy."""
    logdir = opts.logdir
    out = logdir / f"k{k}" / phase
    ov = [
        f"experiment=toy_{phase}",
        f"task.num_constraints={k}",
        f"paths.output_dir={out}",
        f"paths.log_dir={logdir}",
        "++trainer.enable_progress_bar=false",
        f"stage.sft.save_dir={out / 'policy'}",
        f"seed={opts.sft_seed}",
    ]
    start = k if phase != SFT_PHASES[0] else CURRICULUM.get(k)
    if start is not None:
        ov += [
            f"model.name_or_path={logdir / f'k{start}' / SFT_PHASES[0] / 'policy'}",
            "model.tiny=null",
        ]
    if opts.sft_max_steps is not None:
        ov.append(f"trainer.max_steps={opts.sft_max_steps}")
    ov += opts.sft_override
    cfg = compose("train.yaml", ov)
    return Job(f"k{k}/{phase}", ov, out, int(cfg.trainer.max_steps))


def warm_start(k: int, logdir: Path) -> Path:
    """The policy every RL run of K starts from."""
    return logdir / f"k{k}" / SFT_PHASES[-1] / "policy"


def sft_waves(k_values: list[int]) -> list[list[tuple[int, str]]]:
    """The warm-start passes in the order they can run: each wave's (K, phase) jobs run side
    by side. A K in ``CURRICULUM`` waits for the clean pass of the K it starts from (run
    even when that K is not compared itself)."""
    todo: set[int] = set()
    for k in k_values:
        while k is not None and k not in todo:
            todo.add(k)
            k = CURRICULUM.get(k)
    waves, done = [], set()
    while todo:
        ready = sorted(k for k in todo if CURRICULUM.get(k) is None or CURRICULUM[k] in done)
        waves.append([(k, SFT_PHASES[0]) for k in ready])
        done |= set(ready)
        todo -= set(ready)
    waves.append([(k, SFT_PHASES[1]) for k in k_values])
    return waves


def run_warm_starts(opts: Options, console, workers: int) -> bool:
    for wave in sft_waves(list(opts.k_values)):
        jobs = [sft_job(k, phase, opts) for k, phase in wave]
        phases = sorted({phase for _, phase in wave})
        res = run_all(jobs, workers, opts.threads, console, f"SFT ({', '.join(phases)})")
        failed = [key for key, v in res.items() if v.get("error")]
        if failed:
            console.print(f"[red]SFT failed for {failed}; stopping")
            return False
    return True


def rl_job(k: int, method: str, seed: int, opts: Options, out: Path | None = None) -> Job:
    """RL run of a method spec (``mrtpo@beta=0.25``: method=mrtpo method.beta=0.25); ``out``:
    another folder than the run's own (the determinism rerun)."""
    key = f"k{k}/{method}/s{seed}" + ("" if out is None else "/again")
    out = out or opts.logdir / f"k{k}" / method_dir(method) / f"s{seed}"
    name, method_ov = parse_method(method)
    ov = [
        "experiment=toy_replication",
        f"task.num_constraints={k}",
        f"method={name}",
        *method_ov,
        f"seed={seed}",
        f"model.name_or_path={warm_start(k, opts.logdir)}",
        "model.tiny=null",
        f"paths.output_dir={out}",
        f"paths.log_dir={opts.logdir}",
        "++trainer.enable_progress_bar=false",
    ]
    if opts.steps is not None:
        ov.append(f"trainer.max_steps={opts.steps}")
    steps = (
        opts.steps
        if opts.steps is not None
        else int(compose("train.yaml", ov + opts.override).trainer.max_steps)
    )
    if name in WARMUP_SHARE and not any("beta_warmup_steps" in o for o in method_ov):
        # before opts.override, so an explicit setting wins
        ov.append(f"method.beta_warmup_steps={max(1, round(WARMUP_SHARE[name] * steps))}")
    elif name.startswith("mrtpo") and not any("beta_warmup_steps" in o for o in method_ov):
        ov.append(f"method.beta_warmup_steps={MRTPO_WARMUP_STEPS}")
    ov += opts.override
    return Job(key, ov, out, steps)


def rl_jobs(opts: Options) -> list[Job]:
    """Every RL run of a replication: each K, seed and method spec that runs at that K
    (``runs_at``: a schedule variant only at ``SCHEDULE_K``)."""
    return [
        rl_job(k, m, s, opts)
        for k in opts.k_values
        for s in range(opts.seeds)
        for m in opts.methods
        if runs_at(m, k, opts.k_values)
    ]


#: Columns of metrics.csv that measure time, not the run's numbers: never compared (the rerun
#: check, --recheck).
TIMING = re.compile(r"(^|/)time(/|$)|_s$|tokens_per_s")


def determinism_check(opts: Options, console) -> dict[str, Any] | None:
    """Run one configuration (smallest K, ``mrtpo`` or the first method, seed 0) a second time
    and compare every logged value with the first run, step by step (``determinism.json``)."""
    k = min(opts.k_values)
    method = "mrtpo" if "mrtpo" in opts.methods else opts.methods[0]
    first = opts.logdir / f"k{k}" / method_dir(method) / "s0" / "job.json"
    if not first.exists():
        return None
    again = opts.logdir / "determinism" / f"k{k}_{method_dir(method)}_s0"
    job = rl_job(k, method, 0, opts, out=again)
    res = run_all([job], 1, opts.threads, console, "Determinism (one run again)")[job.key]
    a_csv = json.loads(first.read_text()).get("csv")
    if res.get("error") or not a_csv or not res.get("csv"):
        return None
    out = compare_metrics(a_csv, res["csv"])
    out.update(k=k, method=method, seed=0)
    (opts.logdir / "determinism.json").write_text(json.dumps(out, indent=2))
    return out


def largest_difference(pairs: Iterable[tuple[dict, dict]]) -> dict[str, Any]:
    """Over pairs of rows of two runs' metrics: how many values both logged (timing columns
    and values NaN in both aside), the largest absolute difference, its column, and the
    largest difference of ``train/success``."""
    worst, where, values, success = 0.0, None, 0, 0.0
    for ra, rb in pairs:
        for col, va in ra.items():
            vb = rb.get(col)
            if vb is None or col == "step" or TIMING.search(col):
                continue
            if math.isnan(va) and math.isnan(vb):
                continue
            values += 1
            d = math.inf if math.isnan(va) or math.isnan(vb) else abs(va - vb)
            if col == "train/success":
                success = max(success, d)
            if d > worst:
                worst, where = d, col
    return {"values": values, "max_abs_diff": worst, "column": where,
            "success_max_abs_diff": success}  # fmt: skip


def compare_metrics(a: str | Path, b: str | Path) -> dict[str, Any]:
    """Two runs' logged values compared step by step (``largest_difference``)."""
    ra = {r["step"]: r for r in read_metrics(a) if "step" in r and "train/success" in r}
    rb = {r["step"]: r for r in read_metrics(b) if "step" in r and "train/success" in r}
    steps = sorted(ra.keys() & rb.keys())
    return {"steps": len(steps), **largest_difference((ra[s], rb[s]) for s in steps)}


# ---------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------


@dataclass
class KResult:
    k: int
    sft: dict[str, dict[str, Any]]  # SFT summary per warm-start pass
    curves: dict[str, list[dict[str, list[float]]]] = field(default_factory=dict)
    seeds: dict[str, list[int]] = field(default_factory=dict)
    relevance_sft: dict[str, dict[str, float]] = field(default_factory=dict)
    relevance_rl: dict[str, dict[str, float]] = field(default_factory=dict)
    picture: str | None = None
    teacher: dict[str, float] = field(default_factory=dict)  # teacher_check of the warm start


#: Held-out prompts of the OPSD teacher check (greedy, one response each).
TEACHER_PROMPTS = 64


def teacher_check(policy: Path, k: int, n: int = TEACHER_PROMPTS) -> dict[str, float]:
    """What OPSD's teacher knows: the warm start's greedy held-out success after the plain
    prompt and after the teacher's context (``Task.teacher_messages``: the reference as an
    earlier answer, then the question again), and how often it then repeats the reference."""
    import dataclasses

    from hydra.utils import instantiate

    from mrtpo.core.evaluation import evaluate_examples
    from mrtpo.core.models import load_policy
    from mrtpo.lightning.sft import answer

    cfg = compose("train.yaml", ["experiment=toy_replication", f"task.num_constraints={k}"])
    task = instantiate(cfg.task)
    model, tok = load_policy(str(policy))
    model.eval()
    pairs = [(e, task.teacher_messages(e)) for e in task.examples("val")]
    pairs = [(e, t) for e, t in pairs if t is not None][:n]
    plain = [e for e, _ in pairs]
    shown = [dataclasses.replace(e, messages=t) for e, t in pairs]
    key = task.success_check or "success"
    out: dict[str, float] = {"prompts": float(len(plain))}
    for name, examples in (("plain", plain), ("teacher", shown)):
        roll = answer(model, tok, examples, max_new_tokens=int(cfg.rollout.sampling.max_new_tokens))
        metrics, _ = evaluate_examples(task, roll.examples, roll.texts)
        out[f"success_{name}"] = float(metrics[key])
        out[f"copy_{name}"] = sum(
            t.strip() == (e.reference or "").strip()
            for e, t in zip(roll.examples, roll.texts, strict=True)
        ) / max(len(examples), 1)
    return out


def _read_curves(r: KResult, kdir: Path, opts: Options) -> None:
    """Each finished run's series of one K into ``r.curves`` (and its seed into ``r.seeds``)."""
    for m in opts.methods:
        for s in range(opts.seeds):
            job = kdir / method_dir(m) / f"s{s}" / "job.json"
            if not job.exists():
                continue
            info = json.loads(job.read_text())
            if info.get("error") or not info.get("csv"):
                continue
            csv = recorded_csv(Path(info["csv"]), job.parent)
            c = run_series(csv)
            if schedule_of(m) != "sync":
                c.update(staleness_series(csv))
            if c["success"]:
                r.curves.setdefault(m, []).append(c)
                r.seeds.setdefault(m, []).append(s)


def analyse(opts: Options, console) -> list[KResult]:
    """Read every run of the log folder; draw the figures into ``<docs>/figures``; replay the
    warm start once per K for the relevance statistics (cached as ``relevance_sft.jsonl``)."""
    from hydra.utils import instantiate

    from mrtpo.core.models import load_policy
    from mrtpo.lightning.sft import read_summary

    figs = opts.docs / "figures"
    results = []
    for k in opts.k_values:
        kdir = opts.logdir / f"k{k}"
        policy = warm_start(k, opts.logdir)
        if not policy.exists():
            console.print(f"[yellow]no warm-start policy for K={k} under {kdir}; skipped")
            continue
        r = KResult(k=k, sft={ph: read_summary(kdir / ph / "policy") for ph in SFT_PHASES})
        _read_curves(r, kdir, opts)
        if r.curves:
            plot_curves(r.curves, k, figs / f"replication_k{k}.png")
        # relevance: direct replay of the warm start, and the dumps of the MRTPO runs
        cfg = compose("train.yaml", ["experiment=toy_replication", f"task.num_constraints={k}"])
        task = instantiate(cfg.task)
        _, tok = load_policy(str(policy))
        direct = kdir / "relevance_sft.jsonl"
        if not direct.exists():
            recs = replay_records(
                policy, k, opts.relevance_prompts, 4, 12345, float(cfg.method.beta)
            )
            direct.write_text("".join(json.dumps(x) + "\n" for x in recs))
        sft_recs = read_jsonl(direct)
        r.relevance_sft = relevance_stats(sft_recs, task, tok)
        rl_recs = []
        for s in range(opts.seeds):
            for path in sorted((kdir / "mrtpo" / f"s{s}").rglob("relevance.jsonl")):
                rl_recs += read_jsonl(path)
        r.relevance_rl = relevance_stats(rl_recs, task, tok)
        if any(parse_method(m)[0] == "opsd" for m in opts.methods):
            cached = kdir / "teacher_check.json"
            if not cached.exists():
                cached.write_text(json.dumps(teacher_check(policy, k)))
            r.teacher = json.loads(cached.read_text())
        rec = pick_record([x for x in rl_recs if x.get("step", 0) <= 5] or rl_recs or sft_recs)
        if rec is not None:
            plot_relevance(rec, figs / f"relevance_k{k}.png", figs / f"relevance_k{k}.html")
            r.picture = f"relevance_k{k}.png"
        results.append(r)
    return results


#: The logged maximum, over a step's samples, of how many updates behind the trainer the
#: weights that sampled them were (``train/rollout/staleness/max``; 1 after the first step
#: under ``one_step_off``).
STALENESS_COL = "train/rollout/staleness/max"


def staleness_series(csv: str | Path) -> dict[str, list[float]]:
    """``{"staleness/max": [per RL step]}`` of a run's metrics file (NaN where a step did not
    log it), or nothing when the run never logged it."""
    rows = sorted(
        (r for r in read_metrics(csv) if "step" in r and "train/success" in r),
        key=lambda r: r["step"],
    )
    if not any(STALENESS_COL in r for r in rows):
        return {}
    return {"staleness/max": [r.get(STALENESS_COL, math.nan) for r in rows]}


def _n_params(opts: Options) -> int | None:
    """The warm-start policy's parameter count, from its config.json (None before it exists)."""
    policy = warm_start(opts.k_values[0], opts.logdir) / "config.json"
    if not policy.exists():
        return None
    c = json.loads(policy.read_text())
    h, i, n, v = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                  c["vocab_size"])  # fmt: skip
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    return v * h + n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h


def _sft_text(opts: Options, sft, sft_steps: int, noisy) -> str:
    """The design's line on the two warm-start passes."""
    return (
        f"(1) clean references, lr {sft.lr}, batch {sft.batch_size}, until held-out success "
        f"≥ {sft.target_success} (checked every {sft.eval_every} steps from step "
        f"{sft.min_steps}, at most {sft_steps} steps), from random weights"
        + "".join(
            f"; K = {k}'s from K = {p}'s clean policy (a curriculum)"
            for k, p in sorted(CURRICULUM.items())
            if k in opts.k_values
        )
        + "; (2) from there, references of which "
        f"{noisy.task.reference_success:.0%} meet every constraint (each constraint broken "
        f"independently, so the share is the same at every K), lr {noisy.stage.sft.lr}, at "
        f"least {noisy.stage.sft.min_steps} steps and until held-out success ≤ "
        f"{noisy.stage.sft.target_success}, checked every {noisy.stage.sft.eval_every} "
        f"steps on {noisy.stage.sft.eval_prompts} prompts × {noisy.stage.sft.eval_samples} "
        f"samples: the references' rate is below the target, so every K crosses it, and "
        f"RL starts at about the same success rate for every K (measured below). In both "
        f"passes {sft.teacher_share:.0%} of the examples (fixed by their id) are shown "
        f"after OPSD's teacher context (the reference as an earlier answer, then the "
        f"question again) instead of the prompt, so that the initial model can read a "
        f"reference as a pretrained LLM does: OPSD's teacher is that model"
    )


def describe(opts: Options) -> dict[str, Any]:
    """The settings that shape the result, read from the composed presets."""
    from hydra.utils import instantiate

    ov = [
        "experiment=toy_replication",
        f"method.beta_warmup_steps={MRTPO_WARMUP_STEPS}",
        *opts.override,
    ]
    if opts.steps is not None:
        ov.append(f"trainer.max_steps={opts.steps}")
    cfg = compose("train.yaml", ov)
    sft_cfg = compose("train.yaml", ["experiment=toy_sft", *opts.sft_override])
    sft = sft_cfg.stage.sft
    sft_steps = opts.sft_max_steps if opts.sft_max_steps is not None else sft_cfg.trainer.max_steps
    noisy = compose("train.yaml", ["experiment=toy_sft_noisy", *opts.sft_override])
    tiny = cfg.model.tiny
    n_params = _n_params(opts)
    task = instantiate(cfg.task)
    return {
        "policy": (
            f"Qwen2 architecture, {tiny.num_hidden_layers} layers, hidden {tiny.hidden_size}, "
            f"{tiny.num_attention_heads} heads, vocabulary {tiny.vocab_size} (byte-level BPE "
            f"trained offline), random init (std {tiny.initializer_range})"
            + (f", ~{n_params / 1e3:.0f}k parameters" if n_params else "")
        ),
        "task": (
            f"synthetic word constraints, responses of {task.min_words}–{task.max_words} words; "
            f"SFT on {noisy.task.num_train} generated prompts, RL on the first "
            f"{task.num_train} of them; SFT checks and the direct replay on held-out (val) prompts"
        ),
        "rewards per K": "; ".join(
            f"K = {k}: {', '.join(instantiate(cfg.task, num_constraints=k).reward_names)}"
            for k in opts.k_values
        ),
        "few-token reward": (
            f"`{FEW_TOKEN}` (task.closing_mark={bool(cfg.task.get('closing_mark', False))}): "
            "the prompt says which mark (!, ? or .) must close the response; the checker reads "
            "the response's last visible character and nothing else, so one token (the mark) "
            "and where the response stops decide it"
        ),
        "SFT (warm start)": _sft_text(opts, sft, sft_steps, noisy),
        "RL": (
            f"{cfg.trainer.max_steps} steps × {cfg.rl.prompts_per_step} prompts × "
            f"{cfg.rl.group_size} samples, temperature {cfg.rollout.sampling.temperature}, "
            f"max {cfg.rollout.sampling.max_new_tokens} new tokens, lr {cfg.optim.lr}, "
            f"mini-batch {cfg.rl.mini_batch_size}, clip {cfg.rl.clip_low}/{cfg.rl.clip_high}, "
            f"no KL; MRTPO β={cfg.method.beta} (warm-up {cfg.method.beta_warmup_steps} steps)"
        ),
    }
