"""Toy replication of the paper's claims, on a CPU (``make replicate``; ``--full`` for K = 2, 4, 8).

For each K (number of rewards): one warm start in two SFT passes — ``experiment=toy_sft`` learns
the task from clean references until held-out success reaches a target, then
``experiment=toy_sft_noisy`` trains on references that often break a constraint until success
has fallen to RL's starting level — then RL from that same checkpoint with every method and
seed (``experiment=toy_replication``; the same prompts and sampling seeds for every method,
since both follow ``seed``). Runs go through ``mrtpo.lightning.pipeline.build`` in worker processes
(``replication.jobs``), one CPU thread each. Then ``write_report`` writes
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

import itertools
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mrtpo.evaluate.analysis.runs import read_jsonl, read_metrics, run_series, source_commit
from mrtpo.evaluate.analysis.stats import (
    FINAL_WINDOW,
    SMOOTH,
    Interval,
    censored_steps,
    mean_ci,
    paired_differences,
    run_stats,
    trend,
)
from mrtpo.run.config import CONFIG_DIR, compose
from replication import claims as claims_mod
from replication.jobs import Job, quieted, recorded_csv, run_all
from replication.plots import plot_curves, plot_gain_vs_k, plot_relevance, plot_replay_share
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


#: Columns of metrics.csv that measure time, not the computation: left out of the rerun check.
_TIMING = ("time/", "tokens_per_s")


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


def compare_metrics(a: str | Path, b: str | Path) -> dict[str, Any]:
    """Largest absolute difference between two runs' logged values (timing columns aside),
    over every step and column both logged, and the column where it occurred."""
    ra = {r["step"]: r for r in read_metrics(a) if "step" in r and "train/success" in r}
    rb = {r["step"]: r for r in read_metrics(b) if "step" in r and "train/success" in r}
    worst, where, values, success = 0.0, None, 0, 0.0
    for step in sorted(ra.keys() & rb.keys()):
        for col, va in ra[step].items():
            vb = rb[step].get(col)
            if vb is None or col == "step" or any(t in col for t in _TIMING):
                continue
            if math.isnan(va) and math.isnan(vb):
                continue
            values += 1
            d = math.inf if math.isnan(va) or math.isnan(vb) else abs(va - vb)
            if col == "train/success":
                success = max(success, d)
            if d > worst:
                worst, where = d, col
    return {
        "steps": len(ra.keys() & rb.keys()),
        "values": values,
        "max_abs_diff": worst,
        "column": where,
        "success_max_abs_diff": success,
    }


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


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fmt(m: float, h: float, digits: int = 3) -> str:
    if m is None or math.isnan(m):
        return "–"
    if h is None or math.isnan(h):
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {h:.{digits}f}"


def verdict(d_mean: float, d_half: float, what: str) -> str:
    if math.isnan(d_mean):
        return f"{what}: no data"
    if math.isnan(d_half):
        return f"{what}: {d_mean:+.3f} (one seed, no interval)"
    lo, hi = d_mean - d_half, d_mean + d_half
    if lo > 0:
        word = "higher, and the 95% interval excludes zero"
    elif hi < 0:
        word = "lower, and the 95% interval excludes zero"
    else:
        word = "not distinguishable from zero at this number of seeds"
    return f"{what}: {d_mean:+.3f} [{lo:+.3f}, {hi:+.3f}] — {word}"


def interpret(diffs: dict[str, tuple[Interval, Interval, Interval]]) -> list[str]:
    """Plain-language reading of the paired AUC differences against GDPO (rules, not prose
    written after seeing the numbers)."""
    out = []
    if "mrtpo" not in diffs:
        return out
    gain = diffs["mrtpo"][0].sign
    if gain > 0:
        out.append(
            "**MRTPO learned faster than GDPO** on this toy (higher area under the success "
            "curve, interval excluding zero)."
        )
    elif gain < 0:
        out.append("**MRTPO learned more slowly than GDPO** on this toy.")
    else:
        out.append(
            "**MRTPO did not beat GDPO by a margin these seeds can resolve here.** The "
            "paper's claim is not confirmed at this scale; the effect, if any, is small next "
            "to the seed-to-seed noise."
        )
    if "mrtpo_shuffle" in diffs and gain > 0:
        sh = diffs["mrtpo_shuffle"][0].sign
        out.append(
            "Shuffling MRTPO's token weights within each response (same weights, random "
            "positions) "
            + (
                "removes the gain, so it comes from *where* the credit goes, not from "
                "reweighting as such."
                if sh <= 0
                else "keeps a gain, so part of the effect does not depend on where the credit goes."
            )
        )
    if "mrtpo_joint" in diffs:
        j = diffs["mrtpo_joint"][0]
        jm, mm = j.mean, diffs["mrtpo"][0].mean
        word = {1: "beats GDPO", 0: "is not distinguishable from GDPO", -1: "trails GDPO"}
        out.append(
            f"The joint ablation (one relevance profile for all rewards together) "
            f"{word[j.sign]}, with a mean gain "
            f"{'below' if jm < mm else 'at or above'} MRTPO's."
        )
    return out


def _paired(runs: dict, base: dict, what) -> dict:
    """``what(summary)`` of each seed's run minus the baseline's, for the seeds both have."""
    return paired_differences(
        {s: what(x) for s, x in runs.items()}, {s: what(x) for s, x in base.items()}
    )


def _provenance(opts: Options) -> str:
    """Which code made the numbers: the runs' commit (recorded in run.json when they ran) and,
    if different, the commit that rewrote the report."""
    now = source_commit()
    if opts.commit is None:
        return f"runs' commit not recorded; report written at commit `{now}`"
    if opts.commit == now:
        return f"from commit `{now}`"
    return f"runs from commit `{opts.commit}`, report rewritten at commit `{now}`"


def write_report(
    results: list[KResult], opts: Options, settings: dict[str, Any], wall_s: float, out: Path
) -> Path:
    lines: list[str] = []
    add = lines.append
    thr = DEFAULT_THRESHOLD if opts.threshold is None else opts.threshold
    runs = {r.k: {m: dict(zip(r.seeds[m], c, strict=True)) for m, c in r.curves.items()}
            for r in results}  # fmt: skip
    tab = claims_mod.table(runs, thr, FEW_TOKEN, COMPLIANCE_STEP)
    # the claims compare methods under the same schedule: the schedule variants have a
    # section of their own (_schedule_section)
    found = claims_mod.evaluate(
        tab, sync_methods(opts.methods), FEW_TOKEN, COMPLIANCE_STEP, CONCENTRATION[1]
    )
    _flag_starts(found[0], results, tab)
    _intro(add, opts)
    _claim_lines(add, found)
    _design_section(add, opts, results, settings, thr, wall_s)
    _starts(add, results, tab)
    by_k: dict[int, dict[str, tuple[Interval, Interval, Interval]]] = {}
    auc_gain: dict[int, list[float]] = {}  # K -> MRTPO − GDPO Δ AUC per seed (trend in K)
    for r in results:
        add(f"## K = {r.k}")
        add("")
        _warm_start_lines(add, r)
        stats = {
            m: dict(zip(r.seeds[m], (run_stats(c["success"], thr) for c in runs), strict=True))
            for m, runs in r.curves.items()
        }
        _method_table(add, stats, opts, thr)
        if BASELINE in stats:
            _paired_section(add, r, stats, opts, by_k, auc_gain)
        add(f"![learning curves, K={r.k}](figures/replication_k{r.k}.png)")
        add("")
        _relevance_section(add, r)
    if len(by_k) > 1:
        _across_k(add, by_k, auc_gain, opts)
    _claim_details(add, found, tab, opts, results)
    _schedule_section(add, tab, runs, opts)
    _caveats_and_reproduce(add, opts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


def _intro(add, opts: Options) -> None:
    """The report's title, provenance line and what the toy is."""
    add("# Toy replication: the paper's claims at toy scale")
    add("")
    add(
        "_Generated by `scripts/replicate.py` "
        f"({'`make replicate ARGS=--full`' if opts.full else '`make replicate`'}) on "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, {_provenance(opts)}; "
        "do not edit by hand._"
    )
    add("")
    add(
        "The paper's tables need 7B models and GPUs. This miniature asks the same question on a "
        "CPU: a small policy learns to write word sequences under K programmatically checked "
        "constraints (first word, last word, words to include or avoid, word count, the closing "
        "mark), each a binary reward decided by different tokens of the response. Per K, one warm start in "
        "two SFT passes — first on clean reference responses until the policy has learned to "
        "read the constraints off the prompt, then on references that often break a "
        "constraint until its success rate has fallen to a low target — so that RL starts "
        "from a policy that *can* meet every constraint but often does not. Then RL from that "
        "same checkpoint with each method and seed (same prompts and sampling seeds for every "
        "method). *Success* is the share of sampled responses meeting all K constraints."
    )
    add("")


def _design_section(add, opts: Options, results: list[KResult], settings: dict[str, Any],
                    thr: float, wall_s: float) -> None:  # fmt: skip
    mode = "full" if opts.full else "quick"
    add("## Design (fixed before any result)")
    add("")
    add(f"- mode: **{mode}**, K = {', '.join(str(r.k) for r in results)}; "
        f"seeds: {opts.seeds}; methods: {', '.join(opts.methods)}")  # fmt: skip
    add(
        "- pairing: every method runs every seed from the same warm start of its K; a seed "
        "fixes the RL prompts and the sampling seed, so all methods' first batches are the "
        "same, and every comparison is a paired difference by seed"
    )
    _schedule_design(add, opts)
    add(f"- modes: quick = K {', '.join(map(str, QUICK_K))}, {QUICK_SEEDS} seeds, "
        f"{', '.join(available_methods(False))}; full = K {', '.join(map(str, FULL_K))}, "
        f"{FULL_SEEDS} seeds, {', '.join(available_methods(True))} (the "
        f"{', '.join(SCHEDULE_METHODS)} runs at K = {', '.join(map(str, SCHEDULE_K))} only)")  # fmt: skip
    missing = [m for m in OPTIONAL_METHODS if m not in available_methods(True)]
    if missing:
        add(f"- not run: {', '.join(missing)} (no configs/method/<name>.yaml in this checkout: "
            "the method does not exist yet)")  # fmt: skip
    for k, v in settings.items():
        add(f"- {k}: {v}")
    _rules(add, thr)
    add("- how the design came about, in order (what was seen before each change):")
    for line in DESIGN_HISTORY:
        add(f"  - {line}")
    add(
        f"- wall time: **{wall_s / 60:.1f} min** for the whole run on {os.cpu_count()} CPU "
        f"cores ({opts.workers} worker processes, {opts.threads} thread each; "
        f"{platform.processor() or platform.machine()})"
    )
    add(
        f"- statistics: mean ± half-width of the 95% t-interval over seeds; success curves "
        f"smoothed by a trailing {SMOOTH}-step average before the threshold test; *final* = "
        f"mean success over the last {FINAL_WINDOW} steps; *AUC* = mean success over all "
        "steps (area under the curve divided by its length). A run that never reaches the "
        "threshold counts as the number of steps it ran (a lower bound), so its mean is too."
    )
    add("")


def _warm_start_lines(add, r: KResult) -> None:
    """Where each warm-start pass of a K stopped."""
    for phase, what in (
        (SFT_PHASES[0], "learn the task (clean references)"),
        (SFT_PHASES[1], "lower the success rate (references that often break a constraint)"),
    ):
        sm = r.sft.get(phase)
        if not sm:
            continue
        last = sm["history"][-1] if sm.get("history") else {}
        rates = ", ".join(
            f"{n.split('/', 1)[1]} {v:.2f}" for n, v in last.items() if n.startswith("reward/")
        )
        ev = sm.get("eval", {})
        sign = "≤" if sm.get("stop_when") == "below" else "≥"
        add(
            f"**Warm start, {what}:** {sm.get('steps', '?')} SFT steps; "
            f"{'stopped at' if sm.get('reached') else 'did NOT reach'} the target held-out "
            f"success {sign} {sm.get('target_success')}; held-out success "
            f"{last.get('success', math.nan):.3f} ({ev.get('prompts')} prompts × "
            f"{ev.get('samples')} samples at temperature {ev.get('temperature')}); per "
            f"constraint: {rates}."
        )
        add("")


def _method_table(add, stats: dict, opts: Options, thr: float) -> None:
    add(f"| method | seeds | start | steps to success ≥ {thr:g} | reached | final | AUC |")
    add("|---|---|---|---|---|---|---|")
    for m in opts.methods:
        if m not in stats:
            continue
        st = list(stats[m].values())
        reached = sum(not math.isnan(x["steps_to_threshold"]) for x in st)
        cells = [
            fmt(*mean_ci([x["start"] for x in st])[:2]),
            fmt(*mean_ci([censored_steps(x) for x in st])[:2], digits=1),
            f"{reached}/{len(st)}",
            fmt(*mean_ci([x["final"] for x in st])[:2]),
            fmt(*mean_ci([x["auc"] for x in st])[:2]),
        ]
        add(f"| {m} | {len(st)} | " + " | ".join(cells) + " |")
    add("")


def _paired_section(add, r: KResult, stats: dict, opts: Options, by_k: dict, auc_gain: dict
                    ) -> None:  # fmt: skip
    """Each method − GDPO, paired by seed, and what the numbers say; fills ``by_k`` and
    ``auc_gain`` for the trend across K."""
    add(f"Paired differences against {BASELINE} (same seed: same prompts, same first batch):")
    add("")
    add("| method | Δ AUC | Δ final | Δ steps to threshold | seeds with higher AUC |")
    add("|---|---|---|---|---|")
    base = stats[BASELINE]
    diffs = by_k.setdefault(r.k, {})
    for m in sync_methods(opts.methods):
        if m == BASELINE or m not in stats:
            continue

        d_auc = _paired(stats[m], base, lambda x: x["auc"])
        if not d_auc:
            continue
        d_fin = _paired(stats[m], base, lambda x: x["final"])
        d_stp = _paired(stats[m], base, censored_steps)
        diffs[m] = tuple(mean_ci(d.values()) for d in (d_auc, d_fin, d_stp))
        if m == "mrtpo":
            auc_gain[r.k] = list(d_auc.values())
        wins = sum(d > 0 for d in d_auc.values())
        add(
            f"| {m} | {fmt(*diffs[m][0][:2])} | {fmt(*diffs[m][1][:2])} | "
            f"{fmt(*diffs[m][2][:2], digits=1)} | {wins}/{len(d_auc)} |"
        )
    add("")
    add("What the numbers say:")
    add("")
    if "mrtpo" in diffs:
        add("- " + verdict(*diffs["mrtpo"][0][:2], "MRTPO − GDPO, AUC"))
        add("- " + verdict(*diffs["mrtpo"][1][:2], "MRTPO − GDPO, final success"))
    if "mrtpo_shuffle" in diffs and "mrtpo" in diffs:
        add("- " + verdict(*diffs["mrtpo_shuffle"][0][:2], "MRTPO-shuffle − GDPO, AUC"))
    if "mrtpo_joint" in diffs:
        add("- " + verdict(*diffs["mrtpo_joint"][0][:2], "MRTPO-joint − GDPO, AUC"))
    if "grpo" in diffs:
        add("- " + verdict(*diffs["grpo"][0][:2], "GRPO − GDPO, AUC"))
    for line in interpret(diffs):
        add("- " + line)
    add("")


def _relevance_section(add, r: KResult) -> None:
    add("### Where the relevance lands")
    add("")
    add(
        "For each response–constraint pair, the share of that constraint's relevance "
        "(sum of q over the response) on the tokens its checker reads — the first word; the "
        "last word; every occurrence of an included or avoided word (pairs where the word "
        "occurs); for the word count, the end-of-sequence token, whose position sets the "
        "count — against those tokens' share of the response. Enrichment = relevance share "
        "/ token share (1 = no better than spreading evenly); *argmax* = how often the "
        "single most relevant token is one of them."
    )
    add("")
    for label, rel in (
        ("warm-start policy, every pair replayed (direct replay)", r.relevance_sft),
        ("during MRTPO training (relevance dumps of the mrtpo runs)", r.relevance_rl),
    ):
        if not rel:
            continue
        add(f"*{label}:*")
        add("")
        add("| constraint | pairs | token share | relevance share | enrichment | argmax on them |")
        add("|---|---|---|---|---|---|")
        for kind, v in sorted(rel.items()):
            add(
                f"| {kind} | {v['pairs']} | {v['tok_share']:.3f} | {v['q_share']:.3f} | "
                f"{v['enrichment']:.2f}× | {v['argmax_hit']:.2f} |"
            )
        add("")
    if r.picture:
        add(
            f"One response, each token shaded by each reward's relevance "
            f"([hover version](figures/relevance_k{r.k}.html)):"
        )
        add("")
        add(f"![relevance, K={r.k}](figures/relevance_k{r.k}.png)")
        add("")


def _caveats_and_reproduce(add, opts: Options) -> None:
    add("## Caveats")
    add("")
    add(
        "- Scale: a ~100k-parameter model trained from scratch on a synthetic task, not a "
        "pretrained LLM; effect sizes here say nothing about the paper's numbers, only whether "
        "the mechanism pushes in the claimed direction."
    )
    add(
        "- Success is measured on each step's own training samples (B prompts × G samples), "
        "not on held-out prompts; the per-seed curves are noisy and the tables average them."
    )
    add(
        "- The warm start is engineered for headroom: references that break constraints on "
        "purpose make a policy that *can* follow each constraint but often does not, which is "
        "the regime where placing each reward's credit on the right tokens can matter."
    )
    add("")
    add("## Reproduce")
    add("")
    add("```")
    add("make replicate                 # this report (quick mode)")
    add("make replicate ARGS=--full     # K = 2, 4, 8")
    add("python scripts/replicate.py --report-only --logdir <logs/replicate/...>")
    add("```")
    add("")
    add(
        "Raw runs (metrics.csv per run, relevance dumps, the SFT checkpoints) are under the log "
        f"folder (`{os.path.relpath(opts.logdir, ROOT)}` for this report)."
    )
    add("")


#: RL starts (first 3 steps, mean over all runs of a K) further apart than this make the
#: comparison across K unequal: the design asks for the same start at every K.
START_SPREAD = 0.1


def _flag_starts(claim: claims_mod.Claim, results: list[KResult], tab) -> None:
    """Say, in claim 1's line, when the warm starts broke the design's same-start condition:
    a clean pass that missed its target, or RL starts that differ across K."""
    notes = []
    for r in results:
        sm = r.sft.get(SFT_PHASES[0]) or {}
        if not sm or sm.get("reached", True):
            continue
        last = sm["history"][-1] if sm.get("history") else {}
        notes.append(
            f"At K = {r.k} the first warm-start pass never reached its target (held-out "
            f"success {last.get('success', math.nan):.2f} against ≥ {sm.get('target_success')} "
            f"after {sm.get('steps', '?')} steps): there the warm start meets all constraints "
            "less often than at the other K before the second pass, even where RL starts at "
            "the same success rate"
        )
    starts = {}
    for r in results:
        runs = [x["start"] for by_s in tab.get(r.k, {}).values() for x in by_s.values()]
        if runs:
            starts[r.k] = sum(runs) / len(runs)
    if len(starts) > 1 and max(starts.values()) - min(starts.values()) > START_SPREAD:
        notes.append(
            "RL starts differ across K ("
            + ", ".join(f"K = {k}: {v:.2f}" for k, v in sorted(starts.items()))
            + "): the trend in K is confounded with the starting success rate"
        )
    if notes:
        claim.why = " ".join([claim.why, *(n + "." for n in notes)]).strip()


def _claim_lines(add, found: list[claims_mod.Claim]) -> None:
    add("## The claims, one line each")
    add("")
    add(
        "Each verdict follows the rule stated under *Design*: **reproduced** when the 95% "
        "interval lies wholly on the claimed side, **not reproduced** when wholly on the "
        "other side, **inconclusive** otherwise. [brackets] are 95% t intervals; n counts "
        "(K, seed) pairs or runs."
    )
    add("")
    for c in found:
        add(c.line())
    add("")


def _rules(add, thr: float) -> None:
    add(
        "- claims and their rules (each statistic pools the paired differences of every "
        "(K, seed); t intervals at 95%): "
        "(1) the slope, in K, of each seed's MRTPO − GDPO Δ AUC (least squares over all "
        "points) is positive; the slope of Δ steps to success ≥ "
        f"{thr:g} is reported beside it (claimed negative); "
        f"(2) the few-token reward `{FEW_TOKEN}`'s compliance after {COMPLIANCE_STEP} RL steps "
        f"(its trailing {SMOOTH}-step mean at step {COMPLIANCE_STEP}) is higher under MRTPO "
        "than under GDPO; "
        "(3) MRTPO − joint and joint − GDPO, Δ AUC, are both positive; "
        "(4) MRTPO at β = 0.5 beats GDPO in AUC (the curve over β = 0.25 / 0.5 / 0.75 and each "
        "β against 0.5 are reported); "
        "(5) the share of candidate pairs replayed falls from the first "
        f"{claims_mod.REPLAY_WINDOW} to the last {claims_mod.REPLAY_WINDOW} steps of MRTPO runs "
        "(overall share reported); "
        "(6) in MRTPO runs, the share of a response's tokens that hold 80% of a reward's "
        "Jensen–Shannon distance (`train/replay/top80_token_share/<reward>`, mean over steps "
        f"and rewards per run) is at most {CONCENTRATION[1]:g}, the top of the paper's "
        f"{CONCENTRATION[0]:g}–{CONCENTRATION[1]:g}: reproduced when the whole interval is at "
        "or below it, not reproduced when it is wholly above"
    )


def _teacher_section(add, results: list[KResult], tab) -> None:
    """OPSD learns only what its teacher knows: the warm start's check beside OPSD's gap."""
    rows = [r for r in results if r.teacher]
    if not rows:
        return
    add("## OPSD's teacher")
    add("")
    add(
        "OPSD's teacher is the warm start reading the reference as an earlier answer before "
        "the question again; the student only gains where that teacher knows more than it "
        f"does. Greedy answers to {int(rows[0].teacher.get('prompts', 0))} held-out prompts "
        "from each K's warm start, after the plain prompt and after the teacher's context, "
        "beside OPSD's paired Δ AUC against GDPO:"
    )
    add("")
    add("| K | success, plain prompt | success, teacher's context | reference repeated exactly "
        "| OPSD − GDPO Δ AUC |")  # fmt: skip
    add("|---|---|---|---|---|")
    for r in rows:
        t = r.teacher
        d = claims_mod.paired({r.k: tab.get(r.k, {})}, "opsd", BASELINE, "auc")
        gap = claims_mod.ci_text(mean_ci(d.values())) if d else "–"
        add(f"| {r.k} | {t['success_plain']:.2f} | {t['success_teacher']:.2f} | "
            f"{t['copy_teacher']:.2f} | {gap} |")  # fmt: skip
    add("")


def _starts(add, results: list[KResult], tab) -> None:
    add("## Starting points per K")
    add("")
    add(
        "The design asks for the same starting success at every K. Held-out success where "
        "each warm-start pass stopped, and the success of RL's first 3 steps (training "
        "samples, every run of every method from that warm start):"
    )
    add("")
    add(f"| K | pass 1 (clean) steps | pass 1 held-out success | pass 2 (noisy) steps | "
        f"pass 2 held-out success | RL start, all runs | `{FEW_TOKEN}` at RL start |")  # fmt: skip
    add("|---|---|---|---|---|---|---|")
    for r in results:
        cells = [str(r.k)]
        for phase in SFT_PHASES:
            sm = r.sft.get(phase) or {}
            last = sm["history"][-1] if sm.get("history") else {}
            cells.append(
                f"{sm.get('steps', '–')}{'' if sm.get('reached', True) else ' (target NOT reached)'}"
            )
            cells.append(f"{last.get('success', math.nan):.3f}")
        allruns = [x for by_s in tab.get(r.k, {}).values() for x in by_s.values()]
        cells.append(fmt(*mean_ci([x["start"] for x in allruns])[:2]))
        cells.append(fmt(*mean_ci([x["compliance_start"] for x in allruns])[:2]))
        add("| " + " | ".join(cells) + " |")
    add("")


def _claim_details(add, found, tab, opts: Options, results: list[KResult]) -> None:
    figs = opts.docs / "figures"
    by_n = {c.number: c for c in found}
    _claim1_section(add, by_n, tab, opts, figs)
    _claim2_section(add, by_n, tab, opts)
    _claims34_section(add, tab, opts)
    _teacher_section(add, results, tab)
    _claim5_section(add, by_n, tab, results, figs)
    _claim6_section(add, tab)
    _determinism(add, opts)


def _claim1_section(add, by_n, tab, opts: Options, figs: Path) -> None:
    # 1. gain vs K, every method against GDPO
    gains = {}
    for m in sync_methods(opts.methods):
        if m == BASELINE:
            continue
        d = claims_mod.per_k(claims_mod.paired(tab, m, BASELINE, "auc"))
        gains[m] = {k: (iv.mean, iv.half) for k, iv in d.items()}
    if any(gains.values()):
        plot_gain_vs_k(gains, figs / "gain_vs_k.png")
        add("## Claim 1: gain over GDPO against K")
        add("")
        add("| K | MRTPO − GDPO Δ AUC | MRTPO − GDPO Δ steps to threshold |")
        add("|---|---|---|")
        c1 = by_n[1].details
        for k, iv in c1.get("auc", {}).items():
            st = c1.get("steps", {}).get(k, Interval(math.nan, math.nan, 0))
            add(f"| {k} | {claims_mod.ci_text(iv)} | {claims_mod.ci_text(st, 1)} |")
        add("")
        add("![gain vs K](figures/gain_vs_k.png)")
        add("")


def _claim2_section(add, by_n, tab, opts: Options) -> None:
    # 2. the few-token reward
    c2 = by_n[2].details
    if c2.get("levels"):
        add(f"## Claim 2: the few-token reward `{FEW_TOKEN}`")
        add("")
        add(f"Compliance = share of samples meeting `{FEW_TOKEN}`; at start = first 3 RL steps; "
            f"after {COMPLIANCE_STEP} = mean of steps {COMPLIANCE_STEP - SMOOTH + 1}–"
            f"{COMPLIANCE_STEP}; Δ = paired difference against GDPO.")  # fmt: skip
        add("")
        add("| K | method | at start | after "
            f"{COMPLIANCE_STEP} steps | Δ vs gdpo after {COMPLIANCE_STEP} |")  # fmt: skip
        add("|---|---|---|---|---|")
        for k in sorted(tab):
            for m in sync_methods(opts.methods):
                if m not in tab[k]:
                    continue
                xs = list(tab[k][m].values())
                d = mean_ci(claims_mod.paired({k: tab[k]}, m, BASELINE, "compliance").values())
                add(f"| {k} | {m} | {fmt(*mean_ci(x['compliance_start'] for x in xs)[:2])} | "
                    f"{fmt(*mean_ci(x['compliance'] for x in xs)[:2])} | "
                    f"{'–' if m == BASELINE else claims_mod.ci_text(d)} |")  # fmt: skip
        add("")


def _claims34_section(add, tab, opts: Options) -> None:
    # 3 and 4: ablations and beta per K
    rows = [("MRTPO − joint", "mrtpo", "mrtpo_joint"), ("joint − GDPO", "mrtpo_joint", "gdpo"),
            ("MRTPO − shuffle", "mrtpo", "mrtpo_shuffle")]  # fmt: skip
    rows += [(f"β = {b:g} − GDPO", m, "gdpo") for b, m in claims_mod.BETAS.items()]
    rows += [(f"β = {b:g} − β = 0.5", m, "mrtpo") for b, m in claims_mod.BETAS.items() if b != 0.5]
    for m, label in (("cort", "CoRT"), ("opsd", "OPSD")):
        if m in opts.methods:
            rows += [(f"{label} − GDPO", m, "gdpo"), (f"MRTPO − {label}", "mrtpo", m)]
    ks = sorted(tab)
    lines = []
    for label, a, b in rows:
        d = claims_mod.paired(tab, a, b, "auc")
        if not d:
            continue
        pk = claims_mod.per_k(d)
        cells = [claims_mod.ci_text(pk[k]) if k in pk else "–" for k in ks]
        lines.append(
            f"| {label} | " + " | ".join(cells) + f" | {claims_mod.ci_text(mean_ci(d.values()))} |"
        )
    if lines:
        add("## Claims 3 and 4: ablations and the β curve (paired Δ AUC)")
        add("")
        add("| comparison | " + " | ".join(f"K = {k}" for k in ks) + " | pooled |")
        add("|---|" + "---|" * (len(ks) + 1))
        for line in lines:
            add(line)
        add("")


def _claim5_section(add, by_n, tab, results: list[KResult], figs: Path) -> None:
    # 5. replayed share
    shares = {r.k: [c.get("replay/share", []) for c in r.curves.get("mrtpo", [])] for r in results}
    shares = {k: v for k, v in shares.items() if any(v)}
    c5 = by_n[5].details
    if shares:
        plot_replay_share(shares, figs / "replay_share.png")
        add("## Claim 5: what replay costs over training")
        add("")
        add("| K | replayed, first steps | replayed, last steps | replayed, all steps | "
            "replay's share of step time |")  # fmt: skip
        add("|---|---|---|---|---|")
        for k in sorted(tab):
            xs = list(tab[k].get("mrtpo", {}).values())
            cells = [fmt(*mean_ci(x.get(key, math.nan) for x in xs)[:2])
                     for key in ("replay_early", "replay_late", "replay_overall", "time_replay")]  # fmt: skip
            add(f"| {k} | " + " | ".join(cells) + " |")
        add("")
        if c5:
            add(f"Pooled: first − last {claims_mod.ci_text(c5['drop'])}; overall "
                f"{claims_mod.level_text(c5['overall'])}.")  # fmt: skip
            add("")
        add("![replayed share per step](figures/replay_share.png)")
        add("")


def _claim6_section(add, tab) -> None:
    ks = sorted(tab)
    # 6. concentration per reward and K
    names = sorted({n for by_m in tab.values() for x in by_m.get("mrtpo", {}).values()
                    for n in x if n.startswith("top80/")})  # fmt: skip
    if names:
        add("## Claim 6: how concentrated each reward's relevance is")
        add("")
        add("Share of a response's tokens holding 80% of the reward's Jensen–Shannon distance "
            "(mean over the steps of each MRTPO run, then over seeds); spreading it evenly "
            "would need about 80%.")  # fmt: skip
        add("")
        add("| reward | " + " | ".join(f"K = {k}" for k in ks) + " |")
        add("|---|" + "---|" * len(ks))
        for n in names:
            cells = []
            for k in ks:
                xs = [x.get(n, math.nan) for x in tab[k].get("mrtpo", {}).values()]
                cells.append(fmt(*mean_ci(xs)[:2]))
            add(f"| {n.removeprefix('top80/')} | " + " | ".join(cells) + " |")
        add("")


def sync_methods(methods: list[str]) -> list[str]:
    """The method specs run under ``sync``: the ones the claims compare."""
    return [m for m in methods if schedule_of(m) == "sync"]


def _schedule_design(add, opts: Options) -> None:
    variants = [m for m in opts.methods if schedule_of(m) != "sync"]
    if not variants:
        return
    overrides = sorted({o for m in variants for o in parse_method(m)[1]
                        if not o.startswith("method.")})  # fmt: skip
    ks = [k for k in opts.k_values if any(runs_at(m, k, opts.k_values) for m in variants)]
    add(
        f"- schedules (issue 39): {', '.join(variants)} run again at K = "
        f"{', '.join(map(str, ks))} with the seeds, warm start and settings of their "
        f"sync runs, plus `{' '.join(overrides)}`; each is compared with its sync runs by "
        "seed. Rule: a quantity (each method's AUC, MRTPO − GDPO Δ AUC) is **within the "
        "sync interval** when its mean under the schedule lies inside the 95% t interval of "
        "the sync runs over seeds, and **differs** otherwise (the numbers are given); the "
        "paired difference schedule − sync and its interval are reported beside it either way"
    )


def schedule_verdict(sync: Interval, other: Interval, diff: Interval, schedule: str,
                     signed: bool = False) -> str:  # fmt: skip
    """The rule of the schedule comparison (``_schedule_design``): ``other`` (the mean under
    ``schedule``) inside ``sync``'s 95% interval, or not; ``diff``: their paired difference."""
    v = "{:+.3f}" if signed else "{:.3f}"
    if math.isnan(sync.mean) or math.isnan(other.mean):
        return "no data"
    paired = f"paired {schedule} − sync {claims_mod.ci_text(diff)}"
    if math.isnan(sync.half):
        return f"no sync interval (n = {sync.n}): {paired}"
    where = f"sync's [{v.format(sync.lo)}, {v.format(sync.hi)}]"
    if sync.lo <= other.mean <= sync.hi:
        out = (
            f"within the sync interval: {schedule} {v.format(other.mean)} inside {where}; {paired}"
        )
        if diff.sign:
            out += (
                " (the paired interval excludes zero: a shift smaller than the spread over "
                "seeds, which pairing resolves)"
            )
        return out
    side = "above" if other.mean > sync.hi else "below"
    return f"differs: {schedule} {v.format(other.mean)}, {side} {where}; {paired}"


def _range(values: list[float]) -> str:
    v = [x for x in values if math.isfinite(x)]
    if not v:
        return "–"
    lo, hi = min(v), max(v)
    return f"{lo:g}" if lo == hi else f"{lo:g}–{hi:g}"


def _schedule_section(add, tab, runs, opts: Options) -> None:
    """Issue 39: is learning hurt when a batch is sampled by the weights of the step before?
    Per schedule and K: GDPO's and MRTPO's AUC under it against their sync runs, and MRTPO −
    GDPO Δ AUC under each schedule, all paired by seed (``claims.paired``, ``mean_ci``)."""
    variants = [m for m in opts.methods if schedule_of(m) != "sync"]
    for schedule in dict.fromkeys(schedule_of(m) for m in variants):
        ours = [m for m in variants if schedule_of(m) == schedule]
        ks = [k for k in sorted(tab) if any(tab[k].get(m) for m in ours)]
        if not ks:
            continue
        add(f"## Learning under {schedule} (issue 39)")
        add("")
        add(
            f"Under `{schedule}` batch t + 1 is sampled by step t's weights (the HF engine's "
            "private copy of the policy, in a worker thread) while the trainer updates on "
            "batch t; the stale samples are corrected in the loss as decoupled PPO does "
            "(docs/method.md, *Stale samples*). Same seeds, warm start and settings as the "
            f"sync runs: every {schedule} − sync difference is paired by seed. *Within the "
            "sync interval*: the mean under the schedule lies inside the sync runs' 95% "
            "interval (the rule under *Design*)."
        )
        add("")
        add(f"| K | quantity | sync | {schedule} | {schedule} − sync, paired |")
        add("|---|---|---|---|---|")
        lines = []
        for k in ks:
            lines += _schedule_rows(add, tab, k, ours, schedule)
        add("")
        for line in lines:
            add("- " + line)
        add("")
        _staleness(add, runs, ks, ours)


def _schedule_rows(add, tab, k: int, ours: list[str], schedule: str) -> list[str]:
    """One K's rows of a schedule's table (each variant's AUC against its sync runs, and MRTPO −
    GDPO under both); returns their verdict lines."""
    lines: list[str] = []
    t = {k: tab[k]}
    pairs = [(m, v) for v in ours if (m := sync_spec(v)) in tab[k] and v in tab[k]]
    for m, v in pairs:
        sync_iv = mean_ci(x["auc"] for x in tab[k][m].values())
        off_iv = mean_ci(x["auc"] for x in tab[k][v].values())
        d = mean_ci(claims_mod.paired(t, v, m, "auc").values())
        what = f"{m} AUC"
        add(f"| {k} | {what} | {fmt(*sync_iv[:2])} | {fmt(*off_iv[:2])} | "
            f"{claims_mod.ci_text(d)} |")  # fmt: skip
        lines.append(f"K = {k}, {what}: " + schedule_verdict(sync_iv, off_iv, d, schedule))
    by = dict(pairs)
    if claims_mod.MRTPO in by and BASELINE in by:
        gap_sync = claims_mod.paired(t, claims_mod.MRTPO, BASELINE, "auc")
        gap_off = claims_mod.paired(t, by[claims_mod.MRTPO], by[BASELINE], "auc")
        sync_iv, off_iv = mean_ci(gap_sync.values()), mean_ci(gap_off.values())
        d = mean_ci(paired_differences(gap_off, gap_sync).values())
        what = "MRTPO − GDPO Δ AUC"
        add(f"| {k} | {what} | {claims_mod.ci_text(sync_iv)} | "
            f"{claims_mod.ci_text(off_iv)} | {claims_mod.ci_text(d)} |")  # fmt: skip
        lines.append(f"K = {k}, {what}: " + schedule_verdict(sync_iv, off_iv, d, schedule, True))
    return lines


def _staleness(add, runs, ks: list[int], ours: list[str]) -> None:
    stale = []
    for k in ks:
        for v in ours:
            series = [c["staleness/max"] for c in runs.get(k, {}).get(v, {}).values()
                      if c.get("staleness/max")]  # fmt: skip
            if series:
                stale.append(
                    f"{v} at K = {k}: {_range([c[0] for c in series])} at the first step, "
                    f"{_range([x for c in series for x in c[1:]])} at the later steps "
                    f"({len(series)} run{'s' if len(series) > 1 else ''})"
                )
    add(
        f"Staleness (`{STALENESS_COL}`, updates between the weights that sampled a batch "
        "and the trainer's): " + ("; ".join(stale) if stale else "not logged by these runs") + "."
    )
    add("")


def _determinism(add, opts: Options) -> None:
    path = opts.logdir / "determinism.json" if opts.logdir else None
    add("## Determinism")
    add("")
    if path is None or not path.exists():
        add("No rerun was made for this report (`determinism.json` absent).")
        add("")
        return
    d = json.loads(path.read_text())
    what = f"K = {d['k']}, {d['method']}, seed {d['seed']}"
    if d["max_abs_diff"] == 0:
        add(f"One configuration ({what}) was run a second time: all {d['values']} logged "
            f"values over {d['steps']} steps (timing columns aside) are identical.")  # fmt: skip
    else:
        add(f"One configuration ({what}) was run a second time: over {d['steps']} steps and "
            f"{d['values']} logged values (timing columns aside) the largest difference is "
            f"{d['max_abs_diff']:.3g} (`{d['column']}`); success differs by at most "
            f"{d['success_max_abs_diff']:.3g}.")  # fmt: skip
    add("")


def _across_k(add, by_k, auc_gain: dict[int, list[float]], opts: Options) -> None:
    add("## Across K: does the gain grow with the number of rewards?")
    add("")
    cols = [m for m in sync_methods(opts.methods) if m != BASELINE]
    add("| K | " + " | ".join(f"{m} − gdpo, Δ AUC" for m in cols) + " |")
    add("|---|" + "---|" * len(cols))
    for k, d in sorted(by_k.items()):
        add(f"| {k} | " + " | ".join(fmt(*d[m][0][:2]) if m in d else "–" for m in cols) + " |")
    add("")
    gains = [(k, d["mrtpo"][0]) for k, d in sorted(by_k.items()) if "mrtpo" in d]
    if len(gains) > 1:
        means = [g[0] for _, g in gains]
        rising = all(b > a for a, b in itertools.pairwise(means))
        overlap = any(
            abs(a[0] - b[0]) < (a[1] + b[1])
            for (_, a), (_, b) in itertools.pairwise(gains)
            if not (math.isnan(a[1]) or math.isnan(b[1]))
        )
        add(
            "- MRTPO's mean gain over GDPO "
            + ("rises with K" if rising else "does not rise steadily with K")
            + (
                ", but neighbouring intervals overlap: the trend is not resolved at this "
                "number of seeds."
                if overlap
                else ", and neighbouring intervals do not overlap."
            )
        )
        tr = trend(auc_gain)
        what = (
            f"- Trend in K (least-squares slope of each seed's MRTPO − GDPO Δ AUC against K, "
            f"{tr.n} points)"
        )
        if math.isnan(tr.half):
            add(f"{what}: {tr.slope:+.4f} per added reward (too few points for an interval)")
        else:
            word = {
                1: "the gain grows with K (interval excludes zero)",
                -1: "the gain shrinks with K (interval excludes zero)",
                0: "no trend these seeds can resolve",
            }[tr.interval.sign]
            add(
                f"{what}: {tr.slope:+.4f} per added reward "
                f"[{tr.interval.lo:+.4f}, {tr.interval.hi:+.4f}] — {word}"
            )
        add("")


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def default_logdir() -> Path:
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return ROOT / "logs" / "replicate" / stamp


@quieted()  # muted while it runs, restored after (it also runs inside tests)
def main(opts: Options) -> int:
    """Run (or, with ``report_only``, re-read) a replication and write its report."""
    from rich.console import Console

    console = Console()
    if opts.logdir is None:
        if opts.report_only:
            raise ValueError("report_only needs the log folder of a replication (--logdir)")
        opts.logdir = default_logdir()
    opts.logdir = Path(opts.logdir).resolve()
    opts.docs = Path(opts.docs)
    t0 = time.perf_counter()
    wall_file = opts.logdir / "wall_s.json"
    run_file = opts.logdir / "run.json"
    if opts.report_only:
        if not run_file.exists():
            console.print(f"[red]{run_file} not found: is --logdir a replicate run folder?")
            return 1
        saved = json.loads(run_file.read_text())
        if opts.threshold is not None:  # asked for explicitly: a different reading of the runs
            saved.pop("threshold", None)
        opts.commit = None  # older run folders did not record it
        for key, value in saved.items():
            setattr(opts, key, value)
        if opts.threshold is None:
            opts.threshold = DEFAULT_THRESHOLD
    else:
        opts.logdir.mkdir(parents=True, exist_ok=True)
        if opts.threshold is None:
            opts.threshold = DEFAULT_THRESHOLD
        if opts.commit is None:
            opts.commit = source_commit()
        run_file.write_text(json.dumps({k: getattr(opts, k) for k in _RUN_KEYS}, indent=2))
        console.rule(
            f"[bold]Toy replication: K={opts.k_values}, {opts.seeds} seeds, "
            f"{len(opts.methods)} methods → {opts.logdir}"
        )
        if not run_warm_starts(opts, console, opts.workers):
            return 1
        run_all(rl_jobs(opts), opts.workers, opts.threads, console, "RL runs")
        if opts.determinism:
            determinism_check(opts, console)
    results = analyse(opts, console)
    settings = describe(opts)
    if not opts.report_only:  # training and analysis; a resumed run adds to the earlier time
        prev = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else 0.0
        wall_file.write_text(json.dumps({"wall_s": prev + time.perf_counter() - t0}))
    wall = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else math.nan
    out = write_report(results, opts, settings, wall, opts.docs / "replication.md")
    console.print(f"[bold green]report:[/bold green] {out}  (wall time {wall / 60:.1f} min)")
    return 0
