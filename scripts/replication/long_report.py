"""The long toy's predictions, their verdicts, the diagnostics and ``docs/replication_long.md``.

Every prediction is one statistic with a 95% interval and a verdict by the toy replication's
rules (``replication.claims``: reproduced when the interval lies wholly on the predicted side,
not reproduced when wholly on the other, inconclusive otherwise). Cells are (K, free length)
pairs; a paired difference is one (cell, seed), and cells are pooled the way the toy
replication pools K: each cell has its own warm start, so its differences are independent.

``main`` is the long toy's entry point (``scripts/replicate.py --long``): it runs the cells
(``replication.long``), then writes the report.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mrtpo.evaluate.analysis.runs import source_commit
from mrtpo.evaluate.analysis.stats import (
    SMOOTH,
    Interval,
    mean_ci,
    mean_finite,
    steps_to_threshold,
    trend,
)
from mrtpo.run.config import compose
from replication import claims as C
from replication.harness import ROOT
from replication.jobs import quieted, run_folder
from replication.long import (
    ABLATIONS,
    DRAWN,
    DRAWN_RANGE,
    FREE,
    FULL_CELLS,
    FULL_SEEDS,
    FULL_STEPS,
    LONG_FREE,
    METHODS,
    QUICK_CELLS,
    QUICK_SEEDS,
    QUICK_STEPS,
    SFT_PHASES,
    TOY,
    TOY_READER_STEPS,
    CellRuns,
    LongOptions,
    cell_dir,
    cell_jobs,
    read_cells,
    run_cells,
    sft_waves,
    token_budget,
    warm_start,
)
from replication.plots import plot_long_curves, plot_relevance_wrapped
from replication.recheck import recheck
from replication.recheck import summary as recheck_summary
from replication.relevance import checker_tokens, relevance_stats

FEW_TOKEN = "mark"
#: Prediction 2: steps until ``mark``'s compliance (trailing 5-step mean) reaches this.
MARK_THRESHOLD = 0.5
#: Compliance "after N steps" reported beside it (the paper: 97% MRTPO, 2% GDPO after 10).
COMPLIANCE_STEP = 10
#: Prediction 3: the paper's 80%-of-the-distance token share.
CONCENTRATION = (0.13, 0.29)

#: The full-mode report this one replaces (docs/replication_long.md written at 0c4c162): the
#: commit of its runs, its cells and its verdicts. A full-mode report says where its verdicts
#: differ from these and whether the cells both share give the old verdict again.
PREVIOUS_REPORT: dict[str, Any] = {
    "runs": "f10d785",
    "cells": ((4, 0), (4, 20), (4, 60), (2, 60)),
    "verdicts": {
        1: C.REPRODUCED, 2: C.REPRODUCED, 3: C.INCONCLUSIVE, 4: C.REPRODUCED, 5: C.INCONCLUSIVE,
    },
}  # fmt: skip

#: The predictions as stated before any run (the issue's five), each with its rule.
PREDICTIONS = (
    "**P1** MRTPO − GDPO grows with the length of the free part: at K = 4 (without a K = 4 "
    "cell, as in the quick mode, at the smallest K run), the least-squares "
    "slope, in the free part's length, of each seed's paired MRTPO − GDPO Δ AUC (success) is "
    "positive; the slope of Δ steps to success ≥ the threshold is reported beside it "
    "(predicted negative).",
    f"**P2** The few-token reward `{FEW_TOKEN}` reaches compliance ≥ {MARK_THRESHOLD:g} "
    f"(trailing {SMOOTH}-step mean) sooner under MRTPO: at the longest free part ({LONG_FREE} "
    "words, every K run), the paired MRTPO − GDPO difference in those steps is negative (a run "
    "that never reaches it counts its number of steps, a lower bound). Compliance after "
    f"{COMPLIANCE_STEP} steps is reported beside it.",
    f"**P3** Relevance concentrates: in MRTPO runs at the longest free part, the share of a "
    f"response's tokens holding 80% of a reward's Jensen–Shannon distance (mean over steps and "
    f"rewards per run) is at most {CONCENTRATION[1]:g}, the top of the paper's "
    f"{CONCENTRATION[0]:g}–{CONCENTRATION[1]:g}: reproduced when the whole interval is at or "
    "below it, not reproduced when wholly above.",
    "**P4** The shuffle ablation loses the gain, the joint ablation keeps part of it: at the "
    "longest free part, MRTPO − shuffle and joint − GDPO, paired Δ AUC, are both positive "
    "(reproduced when both are, not reproduced when either is wholly negative); shuffle − GDPO "
    "and MRTPO − joint are reported beside them.",
    "**P5** The gain grows with K at a fixed long free part: at the longest free part, the slope "
    "in K of each seed's MRTPO − GDPO Δ AUC is positive (needs two K or more: the full mode).",
)

#: How the design came about, in order, and what had been seen before each decision (the
#: report repeats it).
DESIGN_HISTORY: tuple[str, ...] = (
    "Before any run: the filler words are words the toy tokenizer already holds as single "
    "tokens (so `model=toy` and the existing toy are unchanged), none of them a task word or a "
    "word of the prompt; each marker is then 3 tokens (`<`, `think`, `>`).",
    "Before any run, from the toy replication's numbers only: its second pass moved `mark` "
    "about half-way from the clean policy's rate to its references' rate before the stop, so "
    "a stop on the other constraints' success would have left `mark` far above 5%. The second "
    "pass therefore stops on `mark` itself (held-out rate ≤ 0.05, references that never carry "
    "the asked mark) and the other constraints get their own reference rate (0.25, together).",
    "Before any RL run, after 56 steps of a clean pass at free part 60 from random weights "
    "(about 4 s a step on the shared machine, loss 2.56 and falling slowly): a longer free "
    "part's clean pass starts from the same K's free-part-0 clean policy instead; the quick "
    "mode runs 30 RL steps and the two ablations only at the longest free part, to fit its time.",
    "During the first quick run (commit 991d81b), before any RL run and with only SFT numbers "
    "seen: the clean pass at free part 0 reached held-out success 0.605 after 1550 steps "
    "(first 0.87, last 0.69, mark and count 1.00), and the passes at 20 and 60 words, started "
    "from it, would have run at least 300 steps before their first check (about 3.5 s a step "
    "at 60 words on the shared machine). Their checks now start at step 50 (toy_long_sft's "
    "min_steps). The run went on in the same folder: the free-part-0 clean pass is the one "
    "made at 991d81b, whose checks before step 300 would not have stopped it (its held-out "
    "success stayed below 0.6 until step 1550).",
    "During the second quick run (from scratch, commit 66aba4c), with only SFT numbers seen "
    "and no RL run: the clean passes took 1550 (free part 0), 625 (20) and 1075 (60) steps. "
    "The second pass at free part 0 stopped at step 240 (`mark` 0.049, the other constraints "
    "together 0.11), but at 20 words `mark` stayed at 0.18–0.22 from step 236 to 564, and at "
    "60 words it fell from 0.61 to 0.24 by step 204 and was levelling off there: 2/9 ≈ 0.22 is "
    "the rate of a policy that writes one of the marks without reading which one is asked, "
    "given references whose broken mark is missing or one of the other two. Those references "
    "now leave a broken mark out (`task.mark_break=none`), so the pass only has to unlearn "
    "writing a mark. The second passes were run again from the same clean passes (kept), and "
    "to shorten the quick mode its cells are now free parts 0 and 60 at K = 4; the full mode "
    "keeps 20 words. Time: the clean passes took 9.0 min (free part 0), then 17.1 min (60, "
    "beside 20's 8.0 min); the restarted run (second passes and RL, commit a31e255) 12.6 min, "
    "of which the 18 RL runs 9.2 min. From scratch the quick mode is therefore about 39 min "
    "here, not the 15 asked; with `--warm-from` an earlier run's warm starts, about 10.",
    "After that quick run's results had been seen (3 seeds; P3 reproduced at 0.099 "
    "[0.085, 0.112]; MRTPO − GDPO Δ AUC −0.012 [−0.066, +0.042] at free part 0 and +0.036 "
    "[−0.039, +0.112] at 60; MRTPO − shuffle +0.043 [−0.043, +0.129], joint − GDPO +0.020 "
    "[−0.025, +0.065]; Δ steps to `mark` ≥ 0.5 −3.7 [−13.7, +6.4]; everything else "
    "inconclusive), the same folder was extended with no change to code or presets: 8 seeds "
    "instead of 3 and the 20-word cell (its clean pass from the second run, its second pass "
    "new), still 30 RL steps, so that the predictions on the length axis are tested with "
    "three lengths and intervals from 8 seeds.",
    "After the 8-seed results had been seen (P1, P3 and P4 reproduced, P2 inconclusive, P5 "
    "untested with one K): K = 2 at 60 words was added in the same folder, again with no "
    "change to code or presets (its clean passes from random weights at free part 0, then at "
    "60 words; 8 seeds; GDPO, MRTPO and both ablations, since it is a longest-free-part cell), "
    "the cheapest second K for P5. K = 8 was not run: its clean pass took 4425 steps in the toy "
    "replication. The runs' commits: a31e255 (K = 4, free parts 0 and 60, seeds 0–2), 0b74b61 "
    "(seeds 3–7 and the 20-word cell), 8f27056 (K = 2); `src/` and `configs/` are the same at "
    "all three.",
    "After the K = 2 results had been seen: the quick mode moved to K = 2 at free parts 0 and "
    "60 (commit ce812d8), whose warm starts took about 2 min against about 26 for K = 4's. A "
    "run of it from scratch (`logs/replicate_long/2026-12-02_quick-k2`, report written "
    "elsewhere, so not this one) took 8.9 min; with 3 seeds it found P1 reproduced (MRTPO − "
    "GDPO Δ AUC +0.032 [+0.008, +0.055] at 60 words, −0.003 [−0.035, +0.029] at 0), P3 not "
    "reproduced (0.353 [0.349, 0.358]; the extended run's K = 2 cell at 60 words measured "
    "0.34–0.35 per reward too, against 0.09–0.13 at K = 4), P2, P4 and P5 inconclusive. The extended run above was the report "
    "in docs/ at that point.",
    "Before the full mode's own run, with no change to code or presets: its RL steps were set "
    "to 30, as in the extended run (the preset's 50 add two thirds to the RL runs' time), "
    "and K = 8 was dropped from its cells on an estimate of 2.5–3 h for the whole mode, made "
    "from timings taken while other work loaded the machine. The run of the other four cells "
    "(commit f10d785) then took 28.4 min from scratch here (one restart, after its workers "
    "were killed by mistake; finished jobs were kept, and the wall time adds both parts).",
    "Before any of that run's results were read, K = 8 at 60 words was put back in the full "
    "mode and the same folder extended with it at the same commit. Its free-part-0 clean pass "
    "(from K = 4's clean policy, lr 0.003) did not learn to read the constraints: after 4331 "
    "of its 5000 steps (13 min), held-out success had never passed 0.012 in 172 checks; from "
    "step 550 on the include and exclude constraints stayed at 0.38–0.68 (chance is 0.5), "
    "`first` at 0.08–0.42 and `last` at 0.07–0.21, while `count` and `mark` were at "
    "0.93–1.00 (held-out loss 0.48 at step 1050, 0.40 at 4200). A cell that starts RL unable to do "
    "the task says nothing about P5, so the pass was stopped, K = 8 left out of the full mode "
    "again, and the folder's record set back to the four cells (its jobs all done: nothing "
    "rerun). Why the toy replication's K = 8 pass learned (4425 steps) and this one does not "
    "is not known; the two prompts differ by the free-part instruction and the markers. This "
    "report is the four-cell full mode, all of it run at f10d785; P5 rests on K = 2 and 4.",
    "After this run's results had been read: the extended run's open question, a negative "
    "MRTPO − GDPO Δ AUC at 20 words (−0.024 [−0.038, −0.010]) from a cell whose second pass "
    "had left the other constraints at 0.04, does not come back with fresh warm starts: here "
    "that pass left them at 0.24 and the difference is +0.003 [−0.001, +0.007]. The earlier "
    "value is most likely that warm start's, not the length's.",
    "Issue 42, before any new RL run and before the regenerated runs were read: why K = 8's "
    "clean pass does not learn here was looked into with one-seed SFT runs, one process and one "
    "thread at a time (about 40 min of runs in all). The two K = 8 clean passes (the toy "
    "replication's and this one's at free part 0) were composed through the harnesses' own "
    "builders: lr, batch, teacher share, target, step limit, data, seed and model are the "
    "same; they differ in the format (the sentence 'Write <think> </think> first.', six marker "
    "tokens before the answer, and a first answer word that is the prompt's own token rather "
    "than the toy's no-space one), in the K = 4 policy they start from, and in two settings that "
    "only touch the held-out checks. Both K = 4 clean passes, rerun at the current code, give "
    "their recorded results exactly (625 steps, 0.613; 1725 steps, 0.605). Neither K = 4 "
    "policy reads K = 8 prompts (without training: toy 0.00 success with `first` 0.19; this "
    "one writes an unclosed marker and scores 0 on every constraint), and after 50 steps both "
    "K = 8 passes sit on the same plateau (`count`, `mark` ≈ 1, `first` ≈ 0.1, `last` ≈ 0.05, "
    "include/exclude near copying prompt words at random). Only the toy's leaves it: its "
    "`first` went 0.22 → 0.89 between steps 800 and 850 (1.00 at 1875), while this pass's "
    "stayed at 0.10–0.18 for 1100 steps (0.08–0.42 over the recorded 4331). The curriculum "
    "from K = 4 therefore gives only the format; the long format is what holds the pass back "
    "(it does at K = 4 too: 1725 steps against 625), though which part of it could not be "
    "isolated without a task change, and one seed per setting does not rule out chance. A "
    "warm start that learns: the toy-format K = 8 policy (1900 steps, success 0.04) moved to "
    "this format reads within 100 steps (`first` 0.97, exclude 0.73–0.74, include 0.57) and "
    "reached held-out success 0.25, 0.35, 0.43 and 0.47 at steps 450, 800, 1500 and 1850, "
    "still rising by about 0.05 per 500 steps, with `first`, `last`, `count` and `mark` at 1.00 "
    "and the include words (0.72–0.76) behind. It had not reached the 0.6 start of the other "
    "cells within the budget stated for it (about 16 min of that pass on one core), and the "
    "whole K = 8 cell (that warm start at about 25–30 min to free part 0, the 60-word and noisy "
    "passes, 16 RL runs) did not fit in the session that made this diagnosis, so K = 8 is "
    "again not a cell: P5 rests on K = 2 and 4, and the recipe above is the next step.",
    "Issue 42, before the full mode's run from scratch (no RL run of it and no pass of K = 8's "
    "new chain seen): K = 8 at 60 words is a cell of the full mode again, with the warm start "
    "the diagnosis found. Its free-part-0 clean pass starts from a toy-format K = 8 policy: "
    "toy_sft at K = 4 from random weights to its target, then toy_sft at K = 8 from that for "
    "a fixed 2000 steps (the diagnosis's 1900, rounded; not to its own 0.6 target, since what "
    "it misses by then, the include words, the long format's pass has to learn anyway), then "
    "the long format at free part 0 until held-out success ≥ 0.6. That pass's step limit, 5000 "
    "as every clean pass's, is the budget stated for this warm start. The 60-word clean pass, "
    "the second pass and the RL runs are every other cell's, both ablations included (a "
    "longest-free-part cell). Rule fixed now: if K = 8's passes do not reach the other cells' "
    "start (clean pass ≥ 0.6 at 60 words, `mark` ≤ 0.05 after the second), the report says "
    "so with the passes' numbers and P5 is read over K = 2 and 4 only. Otherwise P5 is the "
    "slope in K of each seed's paired MRTPO − GDPO Δ AUC over K = 2, 4, 8 at 60 words, its rule "
    "unchanged; P3 keeps its pooled verdict and reports the share per K beside it (K = 2 "
    "measured about 0.35 per reward against 0.09–0.13 at K = 4, so the pooled interval mixes "
    "levels). The harness now runs warm starts and RL runs in one pool of 2 workers, each job "
    "starting once the pass it starts from is done, the longest chain first; that changes when "
    "a job runs, not what it computes. `src/` and `configs/` are unchanged.",
    "After that run's results had been read, with no change to code, presets or runs (the "
    "report was written again from the same runs to add the section comparing it with the "
    "previous report, and this entry): K = 8's chain reached the other cells' start by the rule "
    "fixed above. Toy format K = 4 took 625 steps (0.613), K = 8 its 2000 (0.082, `first` "
    "1.00, include 0.64–0.69), free part 0 4050 steps in 17 min, 60 words 1550 (0.652), the "
    "second pass 76 (`mark` 0.039, the others 0.115). Both long-format clean passes stopped on "
    "their first check above 0.6 after hovering near 0.5 (mean of their last 20 checks 0.50 "
    "and 0.47; a check's noise is about ±0.06): the rule every cell stops by, but a start "
    "less far above 0.5 than the number says. The K = 2 and K = 4 cells gave the previous "
    "report's numbers to every printed digit (the same jobs at the same seeds), except that "
    "the 20-word cell's credit table counts fewer replayed pairs (125, 293, 55 against 141, 317, "
    "63); the previous run was restarted once after its workers were killed, which may have "
    "left a killed run's dumps beside its rerun's. Every verdict that changed therefore comes "
    "from the K = 8 cell (next section). At K = 8 MRTPO is not ahead of GDPO (Δ AUC −0.022 "
    "[−0.052, +0.008]) and the joint-profile ablation is ahead of MRTPO (MRTPO − joint −0.043 "
    "[−0.059, −0.027]), while the relevance still lands on `mark`'s decisive tokens as at "
    "K = 4 at 60 words (enrichment 5.2× against 5.3×); the cap binds harder (mean s 0.68 "
    "against 0.81) and the weights before the cap on the checkers' tokens are larger for most "
    "rewards (2.1–8.9 against 2.7–4.7). Why 8 per-reward profiles do worse than one joint "
    "profile here was not tested: one warm start per cell does not separate the method from "
    "this cell's start, so P5's verdict is about this toy, not a general finding.",
    "Issue 49, 2026-12-06, before any run of the credit experiment (`--long --credit`; no RL "
    "run with the per-token cap, the masked contexts or a drawn free-part length had been "
    "made or read), the decision rule, fixed now. Where: the cell K = 8 at 60 words, where "
    "the previous report found MRTPO − GDPO −0.022 and MRTPO − joint −0.043, 8 seeds, 30 RL "
    "steps, its warm starts reused (the fixed-length toy is unchanged). Arms: GDPO; joint "
    "(cap=token, context=delete); MRTPO at cap batch or token × context delete or mask, each "
    "run named with both (batch/delete is the previous report's MRTPO, so it and GDPO should "
    "repeat that report's AUC, 0.113 and 0.135, and the report says if they do not). "
    "Statistic: Δ AUC paired by seed; where a comparison averages two differences (over the "
    "two contexts), each seed's mean of them is one observation (n = 8); 95% t intervals. "
    "(1) Cap: token (the paper's wording, the revised spec, item 1's default) stays the default "
    "unless token − batch, averaged over the two contexts, lies wholly below 0; then the "
    "default goes back to batch and P5 runs at batch. Any token-cap run with "
    "`adv/sign_flip_share` above 0 is a defect to fix, not a result. (2) Context: mask becomes "
    "the default only if mask − delete at the cap chosen in (1) lies wholly above 0; wholly "
    "below or inconclusive keeps delete (the paper's construction), and mask's numbers are "
    "reported beside it. The interaction (mask − delete at token minus at batch) is reported, "
    "not used. (3) Each MRTPO arm − GDPO and − joint is reported as ahead (interval wholly "
    "above 0), behind (wholly below) or inconclusive; none of these changes a default, and an "
    "arm that is still behind is reported as such. (4) P5 again at the new defaults: GDPO, "
    "joint and MRTPO at the cap and context decided, K = 2, 4, 8 at 60 words, 8 seeds (K = 8's "
    "runs are the cell's arms where one exists); its rule is unchanged (the slope in K of each "
    "seed's MRTPO − GDPO Δ AUC: reproduced wholly above 0, not reproduced wholly below), with "
    "joint − GDPO's slope beside it. Inconclusive is reported with its interval and never read "
    "as a trend either way. (5) Fixed or drawn length: the arms and P5 keep the fixed 60-word "
    "free part, so the two fixes are tested on the cell whose result they answer, with no "
    "change of toy at the same time, and its warm starts are reused. The drawn range is a "
    "separate check (item 4): K = 8 with each prompt's free part drawn from 30–90 words "
    "(mean 60), its clean pass 300 steps from K = 8's 60-word clean policy (that policy "
    "already meets the success target, so a target stop would not teach the new lengths), then "
    "the usual second pass, then MRTPO at cap=token in both contexts, 4 seeds. It passes when "
    "the closing tag's share of the reallocated energy (`replay/energy_share/close`, per run "
    "the mean over its steps) lies wholly below 0.5 in the drawn cell, i.e. the tag no longer "
    "carries most of the energy; the fixed cell's share for the same arms is reported beside "
    "it (the audit measured 51–55% on `</` at K = 8 under delete). (6) Time, estimated from "
    "the previous report's timings (63.8 min for the full mode; `--dry-run` prints the plan): "
    "with the fixed cells' warm starts reused, phase 1 (48 arm runs, GDPO at K = 2 and 4, the "
    "drawn check's two passes and 8 runs) about 25 min and phase 2 (32 runs, 40 if mask is "
    "chosen) 7–9 min on 2 workers; from scratch about 73–76 min. What was cut to stay within "
    "about 90 min: the length axis (P1's cells at 0 and 20 words) and the shuffle ablation are "
    "not rerun (their verdicts stay the previous report's), P5 runs only at the new defaults, "
    "the joint arm only at cap=token (and in the decided context for P5), the drawn check has "
    "4 seeds and no GDPO arm, and RL stays at 30 steps.",
)


# ---------------------------------------------------------------------------------------------
# Per-run numbers and the table of them
# ---------------------------------------------------------------------------------------------


def summarize(series: Mapping[str, list[float]], threshold: float) -> dict[str, float]:
    """The toy replication's run summary plus: steps until ``mark`` compliance reaches
    ``MARK_THRESHOLD`` (censored at the run's length), mean cap s and response length."""
    out = C.summarize(series, threshold, FEW_TOKEN, COMPLIANCE_STEP)
    mark = series.get(FEW_TOKEN)
    if mark:
        st = steps_to_threshold(mark, MARK_THRESHOLD)
        out["mark_steps"] = float(len(mark)) if math.isnan(st) else st
        out["mark_reached"] = float(not math.isnan(st))
    for key in ("cap_s", "length"):
        if series.get(key):
            out[key] = mean_finite(series[key])
    return out


def table(cells: list[CellRuns], threshold: float) -> C.Table:
    return {
        c.cell: {
            m: {s: summarize(x, threshold) for s, x in by_s.items()} for m, by_s in c.runs.items()
        }
        for c in cells
    }


def _where(tab: C.Table, pred) -> C.Table:
    return {cell: v for cell, v in tab.items() if pred(cell)}


def _by(diffs: Mapping[tuple, float], axis: int) -> dict[int, list[float]]:
    """Paired differences keyed by (cell, seed), grouped by the cell's K (0) or length (1)."""
    out: dict[int, list[float]] = {}
    for (cell, _), v in diffs.items():
        out.setdefault(cell[axis], []).append(v)
    return out


def _slope_claim(number: int, title: str, tab: C.Table, axis: int) -> C.Claim:
    """A trend claim: the slope of each seed's MRTPO − GDPO Δ AUC along the cells' K
    (``axis`` 0) or free length (1) is positive."""
    what, unit = ("K", "reward") if axis == 0 else ("free length", "free word")
    d_auc = C.paired(tab, "mrtpo", "gdpo", "auc")
    d_steps = C.paired(tab, "mrtpo", "gdpo", "steps_censored")
    if not d_auc:
        return C.Claim(number, title, C.INCONCLUSIVE, "not measured (needs mrtpo and gdpo runs)")
    groups = _by(d_auc, axis)
    per = "; ".join(f"{what} {x}: {C.ci_text(mean_ci(v))}" for x, v in sorted(groups.items()))
    if len(groups) < 2:
        return C.Claim(number, title, C.INCONCLUSIVE, f"MRTPO − GDPO Δ AUC {per}",
                       f"One {what} only: a trend needs the full mode.")  # fmt: skip
    tr, trs = trend(groups), trend(_by(d_steps, axis))
    stat = (
        f"slope of MRTPO − GDPO Δ AUC per added {unit} {C.ci_text(tr.interval, 5)} (Δ AUC at "
        f"{per}); slope of Δ steps to threshold {C.ci_text(trs.interval, 3)} per added {unit} "
        f"({C.claim_verdict(trs.interval, -1)} for fewer steps)"
    )
    return C.Claim(number, title, C.claim_verdict(tr.interval, +1), stat,
                   details={"groups": groups})  # fmt: skip


def predictions(tab: C.Table, methods: list[str]) -> list[C.Claim]:
    """The five predictions; "the longest free part" is the longest of the cells run (60 words
    in both modes), P1's K is 4 (or, without it, the first cell's)."""
    longest = max((c[1] for c in tab), default=LONG_FREE)
    k1 = 4 if any(c[0] == 4 for c in tab) else min(tab, default=(4, 0))[0]
    long = _where(tab, lambda c: c[1] == longest)
    title1 = "MRTPO − GDPO grows with the free part's length"
    return [
        _slope_claim(1, title1, _where(tab, lambda c: c[0] == k1), 1),
        _mark_claim(long, methods),
        _concentration_claim(long),
        _ablation_claim(long),
        _slope_claim(5, "The gain grows with K at the longest free part", long, 0),
    ]


def _mark_claim(long: C.Table, methods: list[str]) -> C.Claim:
    title = f"`{FEW_TOKEN}` reaches compliance ≥ {MARK_THRESHOLD:g} sooner under MRTPO"
    d = C.paired(long, "mrtpo", "gdpo", "mark_steps")
    if not d:
        return C.Claim(2, title, C.INCONCLUSIVE, "not measured (needs mrtpo and gdpo runs)")
    iv = mean_ci(d.values())
    level = {m: mean_ci(C.values(long, m, "compliance").values()) for m in methods}
    start = {m: mean_ci(C.values(long, m, "compliance_start").values()) for m in methods}
    reached = {m: C.values(long, m, "mark_reached") for m in methods}
    stat = (
        f"Δ steps MRTPO − GDPO {C.ci_text(iv, 1)}; reached by "
        + ", ".join(f"{m} {int(sum(v.values()))}/{len(v)}" for m, v in reached.items() if v)
        + f"; compliance at the start → after {COMPLIANCE_STEP} steps: "
        + ", ".join(
            f"{m} {start[m].mean:.2f} → {level[m].mean:.2f}"
            for m in methods
            if not math.isnan(level[m].mean)
        )
        + " (paper, tool calling: 0.97 MRTPO, 0.02 GDPO after 10 steps)"
    )
    return C.Claim(2, title, C.claim_verdict(iv, -1), stat, details={"diff": iv})


def _concentration_claim(long: C.Table) -> C.Claim:
    title = "Relevance concentrates: 80% of a reward's distance on ≤ 29% of the tokens"
    v = C.values(long, "mrtpo", "top80")
    if not v:
        return C.Claim(3, title, C.INCONCLUSIVE, "not measured (no top-80% shares)")
    iv = mean_ci(v.values())
    names = sorted({n for by_m in long.values() for x in by_m.get("mrtpo", {}).values()
                    for n in x if n.startswith("top80/")})  # fmt: skip
    per = {n.removeprefix("top80/"): mean_ci(C.values(long, "mrtpo", n).values()) for n in names}
    per_k = {k: mean_ci(C.values(_where(long, lambda c, k=k: c[0] == k), "mrtpo", "top80")
                        .values()) for k in sorted({c[0] for c in long})}  # fmt: skip
    stat = (
        f"share of tokens holding 80% of a reward's distance, mean over rewards "
        f"{C.level_text(iv)}; per reward " + ", ".join(f"{n} {x.mean:.2f}" for n, x in per.items())
    )
    if len(per_k) > 1:
        stat += "; per K " + ", ".join(f"K {k}: {C.level_text(x)}" for k, x in per_k.items())
    return C.Claim(3, title, C.below_verdict(iv, CONCENTRATION[1]), stat)


def _ablation_claim(long: C.Table) -> C.Claim:
    title = "Shuffling the weights loses the gain; one joint profile keeps part of it"
    a = C.paired(long, "mrtpo", "mrtpo_shuffle", "auc")
    b = C.paired(long, "mrtpo_joint", "gdpo", "auc")
    if not a or not b:
        return C.Claim(4, title, C.INCONCLUSIVE, "not measured (needs all four methods)")
    ia, ib = mean_ci(a.values()), mean_ci(b.values())
    sh = mean_ci(C.paired(long, "mrtpo_shuffle", "gdpo", "auc").values())
    mj = mean_ci(C.paired(long, "mrtpo", "mrtpo_joint", "auc").values())
    va, vb = C.claim_verdict(ia, +1), C.claim_verdict(ib, +1)
    stat = (
        f"Δ AUC MRTPO − shuffle {C.ci_text(ia)} ({va}); joint − GDPO {C.ci_text(ib)} ({vb}); "
        f"beside them shuffle − GDPO {C.ci_text(sh)}, MRTPO − joint {C.ci_text(mj)}"
    )
    return C.Claim(4, title, C.all_of([va, vb]), stat)


# ---------------------------------------------------------------------------------------------
# Diagnostics: does the credit reach the tokens that decide each reward?
# ---------------------------------------------------------------------------------------------


def free_end(tokens: list[str]) -> int:
    """Number of leading tokens that make up the free part (through ``</think>``); 0 if none."""
    text = ""
    for i, t in enumerate(tokens):
        text += t
        if "</think>" in text:
            return i + 1
    return 0


def credit_stats(cell: CellRuns, task, tokenizer, cap_s: float) -> dict[str, dict[str, float]]:
    """Per reward, over MRTPO's relevance dumps: its relevance share in the free part against
    the free part's token share; the mean weight w (before the cap) on the tokens its checker
    reads; and the share of the reward's credit those tokens get after the cap
    (``1 + s(w - 1)``, s = the run's mean cap) against GDPO's (their token share)."""
    by_id = {e.id: e for split in ("train", "val") for e in task.examples(split)}
    acc: dict[str, dict[str, list[float]]] = {}
    for rec in cell.relevance:
        ex = by_id.get(rec["id"])
        if ex is None:
            continue
        checked = checker_tokens(rec, ex, task, tokenizer)
        n_free, n = free_end(rec["tokens"]), len(rec["tokens"])
        for name, q in rec["q"].items():
            toks, w = checked.get(name, []), rec["w"].get(name, [])
            if not toks or sum(q) <= 0 or len(w) != n:
                continue
            a = acc.setdefault(name, {k: [] for k in ("free_q", "free_t", "w", "mrtpo", "gdpo")})
            a["free_q"].append(sum(q[:n_free]) / sum(q))
            a["free_t"].append(n_free / n)
            a["w"].append(sum(w[t] for t in toks) / len(toks))
            capped = [1 + cap_s * (x - 1) for x in w]
            a["mrtpo"].append(sum(capped[t] for t in toks) / sum(capped))
            a["gdpo"].append(len(toks) / n)
    return {name: {k: sum(v) / len(v) for k, v in a.items()} | {"pairs": len(a["w"])}
            for name, a in acc.items()}  # fmt: skip


def diagnostics(cells: list[CellRuns], tab: C.Table, opts: LongOptions) -> dict[Any, dict]:
    """Per cell: the relevance statistics of the toy replication (share on the checker's
    tokens) and ``credit_stats``, from MRTPO's dumps, with the task and tokenizer of the cell."""
    from hydra.utils import instantiate
    from transformers import AutoTokenizer

    out = {}
    for c in cells:
        if not c.relevance:
            continue
        k, free = c.cell
        cfg = compose("train.yaml", ["experiment=toy_long", f"task.num_constraints={k}",
                                     f"task.free_tokens={free}"])  # fmt: skip
        task = instantiate(cfg.task)
        tok = AutoTokenizer.from_pretrained(str(warm_start(opts.logdir, c.cell)))
        cap = mean_ci(C.values({c.cell: tab[c.cell]}, "mrtpo", "cap_s").values()).mean
        cap = 1.0 if math.isnan(cap) else cap
        out[c.cell] = {
            "relevance": relevance_stats(c.relevance, task, tok),
            "credit": credit_stats(c, task, tok, cap),
            "cap_s": cap,
        }
    return out


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def fmt(iv: Interval | tuple, digits: int = 3) -> str:
    m, h = iv[0], iv[1]
    if m is None or math.isnan(m):
        return "–"
    return f"{m:.{digits}f}" if math.isnan(h) else f"{m:.{digits}f} ± {h:.{digits}f}"


def label(cell) -> str:
    if cell[1] == DRAWN:
        return f"K = {cell[0]}, free {DRAWN_RANGE[0]}–{DRAWN_RANGE[1]} (drawn)"
    return f"K = {cell[0]}, free {cell[1]}"


def _provenance(opts: LongOptions) -> str:
    now = source_commit()
    if opts.commit is None:
        return f"runs' commit not recorded; report written at commit `{now}`"
    if opts.commit == now:
        return f"runs and report from commit `{now}`"
    return f"runs from commit `{opts.commit}`, report written at commit `{now}`"


def _recipe(add, opts: LongOptions) -> None:
    """The design's warm-start, RL and statistics bullets, from the presets."""
    cfg = compose("train.yaml", ["experiment=toy_long"])
    noisy = compose("train.yaml", ["experiment=toy_long_sft_noisy"])
    clean = compose("train.yaml", ["experiment=toy_long_sft"])
    add(f"- warm start per cell, in two passes as in the toy replication: (1) clean references, "
        f"lr {clean.stage.sft.lr}, until held-out success ≥ {clean.stage.sft.target_success} "
        f"(checks every {clean.stage.sft.eval_every} steps from step {clean.stage.sft.min_steps}"
        f"), from random weights at free part 0 and from the same K's free-part-0 clean policy "
        f"for a longer free part, except K = 8's free-part-0 pass, which starts from a policy "
        f"that reads 8 constraints in the toy replication's format (toy_sft at K = 4 from random "
        f"weights to its target, then at K = 8 for {TOY_READER_STEPS} steps: the design history "
        f"says why); (2) references that "
        f"never carry the asked mark (task.mark_success = {noisy.task.mark_success:g}; a broken "
        f"mark is {'left out' if noisy.task.get('mark_break') == 'none' else 'missing or another one'}"
        f", task.mark_break = {noisy.task.get('mark_break', 'none_or_other')}) and whose "
        f"other constraints are all met with probability {noisy.task.reference_success:g} (each "
        f"broken independently, so at every K), lr {noisy.stage.sft.lr}, until the held-out "
        f"`{noisy.stage.sft.target_metric}` is ≤ {noisy.stage.sft.target_success} (checks every "
        f"{noisy.stage.sft.eval_every} steps from step {noisy.stage.sft.min_steps} on "
        f"{noisy.stage.sft.eval_prompts} prompts × {noisy.stage.sft.eval_samples} samples): "
        "`mark` starts RL rare, the others near their references' rate (measured below)")  # fmt: skip
    add(f"- RL: {cfg.rl.prompts_per_step} prompts × {cfg.rl.group_size} samples a step, "
        f"temperature {cfg.rollout.sampling.temperature}, lr {cfg.optim.lr}, mini-batch "
        f"{cfg.rl.mini_batch_size}, token-mean loss, no KL; MRTPO β = {cfg.method.beta} "
        f"(warm-up {cfg.method.beta_warmup_steps} steps); every method of a seed samples the "
        "same prompts with the same sampling seed, and every comparison is a paired difference "
        "by seed")  # fmt: skip
    add(f"- statistics: mean and 95% t interval over (cell, seed) pairs; *AUC* = mean success "
        f"over the run's steps; steps to threshold = first step where the trailing {SMOOTH}-step "
        f"mean reaches it (success ≥ {opts.threshold:g}; `mark` ≥ {MARK_THRESHOLD:g}), a run "
        "that never does counting its number of steps")  # fmt: skip


def _design(add, opts: LongOptions, wall_s: float) -> None:
    cfg = compose("train.yaml", ["experiment=toy_long"])
    steps = opts.steps or int(cfg.trainer.max_steps)
    add("## Design and predictions (fixed before any run)")
    add("")
    mode = f"**{'full' if opts.full else 'quick'}**"
    cells0, seeds0 = (FULL_CELLS, FULL_SEEDS) if opts.full else (QUICK_CELLS, QUICK_SEEDS)
    if [tuple(c) for c in opts.cells] != list(cells0) or opts.seeds != seeds0:
        mode += " (its RL steps and methods, with the cells and seeds given here)"
    add(f"- mode: {mode}; cells (K, free words): "
        f"{', '.join(f'({k}, {f})' for k, f in opts.cells)}; seeds: {opts.seeds}; methods: "
        f"{', '.join(opts.methods)} (+ {', '.join(opts.ablations)} at the longest free part); "
        f"{steps} RL steps")  # fmt: skip
    add(f"- modes: quick = cells {', '.join(map(str, QUICK_CELLS))}, {QUICK_SEEDS} seeds, "
        f"{QUICK_STEPS} RL steps; full = cells {', '.join(map(str, FULL_CELLS))}, "
        f"{FULL_SEEDS} seeds, {FULL_STEPS} RL steps; both run "
        f"{', '.join(METHODS)} in every cell and {', '.join(ABLATIONS)} also at the longest "
        "free part")  # fmt: skip
    add("- response: `<think> w1 … wn </think> answer`, n filler words (16 words that are "
        "neither task words nor words of the prompt, one token each; each marker is 3 tokens); "
        "the prompt adds the sentence 'Write <think> </think> first.'. The checkers read only "
        "the answer, what follows the first `</think>`; a response that does not open with "
        "`<think>` or never closes it has no answer and scores 0 on every constraint (with that "
        "reason). Free lengths " + ", ".join(map(str, FREE)) + " words; max new tokens = 12 + 6 + "
        "n + n/2 (" + ", ".join(f"{f}: {token_budget(f)}" for f in FREE) + ")")  # fmt: skip
    _recipe(add, opts)
    if opts.warm_from:
        src = Path(opts.warm_from)
        made = (
            json.loads((src / "run.json").read_text()).get("commit")
            if (src / "run.json").exists()
            else None
        )
        add(f"- warm starts: **reused** from the run folder `{src}` (`--warm-from`), made at "
            f"commit `{made}` with the same SFT options; the wall time below is this run's RL "
            "only")  # fmt: skip
    add("- predictions and their rules (verdicts: **reproduced** when the interval lies wholly "
        "on the predicted side, **not reproduced** when wholly on the other, **inconclusive** "
        "otherwise):")  # fmt: skip
    for p in PREDICTIONS:
        add(f"  - {p}")
    add("- how the design came about, in order (what had been seen before each decision):")
    for line in DESIGN_HISTORY:
        add(f"  - {line}")
    add(f"- wall time: **{wall_s / 60:.1f} min** on {os.cpu_count()} CPU cores ({opts.workers} "
        f"worker processes, {opts.threads} thread each; {platform.machine()})")  # fmt: skip
    add("")


def _steps(summary: dict) -> str:
    note = "" if summary.get("reached", True) else " (target not reached)"
    return f"{summary.get('steps', '–')}{note}"


def _chain(add, opts: LongOptions) -> None:
    """The clean passes run only as another cell's start (K = 8's chain)."""
    from mrtpo.lightning.sft import read_summary

    rows = []
    for wave in sft_waves(list(opts.cells)):
        for cell, phase in wave:
            policy = cell_dir(opts.logdir, cell) / phase / "policy"
            if cell in opts.cells or not policy.is_dir():
                continue
            h = read_summary(policy)
            last = (h.get("history") or [{}])[-1]
            fmt_ = "toy format" if cell[1] == TOY else f"free {cell[1]}"
            rows.append(f"K = {cell[0]}, {fmt_}: {_steps(h)} steps, held-out success "
                        f"{last.get('success', math.nan):.3f}")  # fmt: skip
    if rows:
        add("Clean passes run only as another cell's start, in order: " + "; ".join(rows) + ".")
        add("")


def _starts(add, cells: list[CellRuns], tab: C.Table) -> None:
    add("## Starting points per cell")
    add("")
    add("Held-out numbers where each warm-start pass stopped (128 prompts × 4 samples for the "
        "second), and RL's first 3 steps (training samples, every run of the cell). *Others* = "
        "every constraint but `mark` met.")  # fmt: skip
    add("")
    add("| cell | pass 1 steps | pass 1 success | pass 2 steps | pass 2 others | pass 2 `mark` "
        "| RL start: success | `mark` | response tokens |")  # fmt: skip
    add("|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        h = {ph: (c.sft.get(ph) or {}) for ph in SFT_PHASES}
        last = {ph: (h[ph].get("history") or [{}])[-1] for ph in SFT_PHASES}
        runs = [x for by_s in tab.get(c.cell, {}).values() for x in by_s.values()]

        cells_ = [
            label(c.cell), _steps(h["sft"]), f"{last['sft'].get('success', math.nan):.3f}",
            _steps(h["sft_noisy"]), f"{last['sft_noisy'].get('success_others', math.nan):.3f}",
            f"{last['sft_noisy'].get('reward/mark', math.nan):.3f}",
            fmt(mean_ci(x["start"] for x in runs)),
            fmt(mean_ci(x["compliance_start"] for x in runs)),
            fmt(mean_ci(x.get("length", math.nan) for x in runs), 1),
        ]  # fmt: skip
        add("| " + " | ".join(cells_) + " |")
    add("")


def _results(add, cells: list[CellRuns], tab: C.Table, opts: LongOptions) -> None:
    add("## Results per cell")
    add("")
    add(f"| cell | method | seeds | AUC | final | steps to success ≥ {opts.threshold:g} | "
        f"`mark` after {COMPLIANCE_STEP} | steps to `mark` ≥ {MARK_THRESHOLD:g} |")  # fmt: skip
    add("|---|---|---|---|---|---|---|---|")
    for c in cells:
        for m in [*opts.methods, *opts.ablations]:
            xs = list(tab.get(c.cell, {}).get(m, {}).values())
            if not xs:
                continue
            row = [fmt(mean_ci(x[key] for x in xs), d) for key, d in
                   (("auc", 3), ("final", 3), ("steps_censored", 1), ("compliance", 3),
                    ("mark_steps", 1))]  # fmt: skip
            add(f"| {label(c.cell)} | {m} | {len(xs)} | " + " | ".join(row) + " |")
    add("")
    add("Paired differences (same seed: same prompts, same first batch):")
    add("")
    add("| cell | comparison | Δ AUC | Δ steps to success | Δ steps to `mark` |")
    add("|---|---|---|---|---|")
    pairs = [("mrtpo", "gdpo"), ("mrtpo_shuffle", "gdpo"), ("mrtpo_joint", "gdpo"),
             ("mrtpo", "mrtpo_shuffle"), ("mrtpo", "mrtpo_joint")]  # fmt: skip
    for c in cells:
        one = {c.cell: tab.get(c.cell, {})}
        for a, b in pairs:
            d = [C.paired(one, a, b, key) for key in ("auc", "steps_censored", "mark_steps")]
            if not d[0]:
                continue
            ivs = [C.ci_text(mean_ci(x.values()), dg) for x, dg in zip(d, (3, 1, 1), strict=True)]
            add(f"| {label(c.cell)} | {a} − {b} | " + " | ".join(ivs) + " |")
    add("")


def _diagnostics(add, diag: dict, tab: C.Table) -> None:
    add("## Where the credit goes (MRTPO runs)")
    add("")
    add("Per cell and reward, over the responses MRTPO's runs dumped (every 5 steps, 8 a step): "
        "*on checker* = share of the reward's relevance q on the tokens its checker reads, "
        "against those tokens' share of the response; *in free part* = share of q inside "
        "`<think> … </think>`, against its token share; *w on checker* = mean weight on those "
        "tokens before the cap (1 = GDPO's); *credit on checker* = their share of the reward's "
        "token credit after the cap s (1 + s(w − 1)), against GDPO's (their token share). "
        "*cap s* = mean of the batch cap over MRTPO's steps; *top-80%* = share of tokens holding "
        "80% of the distance.")  # fmt: skip
    add("")
    add("| cell | reward | pairs | on checker (tokens) | in free part (tokens) | w on checker "
        "| credit on checker, MRTPO vs GDPO | cap s | top-80% |")  # fmt: skip
    add("|---|---|---|---|---|---|---|---|---|")
    for cell, d in sorted(diag.items()):
        for name, v in sorted(d["credit"].items()):
            kind = name.rsplit("_", 1)[0] if name[-1].isdigit() else name
            rel = d["relevance"].get(kind, {})
            top = mean_ci(C.values({cell: tab[cell]}, "mrtpo", f"top80/{name}").values())
            add(f"| {label(cell)} | {name} | {v['pairs']} | {rel.get('q_share', math.nan):.2f} "
                f"({rel.get('tok_share', math.nan):.2f}) | {v['free_q']:.2f} ({v['free_t']:.2f})"
                f" | {v['w']:.2f} | {v['mrtpo']:.3f} vs {v['gdpo']:.3f} | {d['cap_s']:.2f} | "
                f"{fmt(top, 2)} |")  # fmt: skip
    add("")


def _reading(add, diag: dict) -> None:
    """The diagnostics in words, by fixed rules: for each cell, does `mark`'s relevance sit on
    the tokens its checker reads (enrichment = relevance share / token share), does the cap
    bind (s < 1), and how much more credit MRTPO gives those tokens than GDPO does."""
    if not diag:
        return
    add("What the diagnostics say, cell by cell (for `mark`, the few-token reward; *enrichment* "
        "= its relevance share on the checker's tokens / their token share):")  # fmt: skip
    add("")
    for cell, d in sorted(diag.items()):
        rel, cr = d["relevance"].get(FEW_TOKEN), d["credit"].get(FEW_TOKEN)
        if not rel or not cr:
            add(f"- {label(cell)}: no replayed `{FEW_TOKEN}` pair in the dumps.")
            continue
        enr = rel["enrichment"]
        where = ("on the decisive tokens" if enr >= 2 else
                 "only weakly on them" if enr > 1 else "no more on them than elsewhere")  # fmt: skip
        cap = d["cap_s"]
        ratio = cr["mrtpo"] / cr["gdpo"] if cr["gdpo"] > 0 else math.nan
        add(f"- {label(cell)}: relevance {where} (enrichment {enr:.1f}×, {rel['q_share']:.0%} of "
            f"it on {rel['tok_share']:.0%} of the tokens; {cr['free_q']:.0%} of it in the free "
            f"part, which is {cr['free_t']:.0%} of the tokens); the cap "
            + (f"binds (mean s = {cap:.2f}: the reallocation is scaled to {cap:.0%})"
               if cap < 0.99 else "does not bind (s = 1)")
            + f"; the checker's tokens get {ratio:.1f}× GDPO's share of `{FEW_TOKEN}`'s credit "
            f"({cr['mrtpo']:.1%} against {cr['gdpo']:.1%}; mean weight before the cap "
            f"{cr['w']:.2f}).")  # fmt: skip
    add("")


def _figures(add, cells: list[CellRuns], figs: Path) -> None:
    panels = {label(c.cell): {m: list(by_s.values()) for m, by_s in c.runs.items()}
              for c in cells if c.runs}  # fmt: skip
    if panels:
        plot_long_curves(panels, figs / "long_curves.png")
        add("![learning curves per cell: success and `mark`](figures/long_curves.png)")
        add("")
    longest = [c for c in cells if c.cell[1] == max(x.cell[1] for x in cells) and c.relevance]
    recs = [r for c in longest for r in c.relevance if "mark" in r["q"]]
    if recs:
        rec = max(recs, key=lambda r: (len(r["q"]), -r.get("step", 0), len(r["tokens"])))
        plot_relevance_wrapped(rec, figs / "long_relevance.png", figs / "long_relevance.html")
        add(f"One long response of an MRTPO run (step {rec.get('step')}, seed "
            f"{rec.get('seed')}), each token shaded by each replayed reward's relevance q, "
            "scaled by that reward's largest q ([hover version with q and w]"
            "(figures/long_relevance.html)):")  # fmt: skip
        add("")
        add("![relevance of one long response](figures/long_relevance.png)")
        add("")


def _against_previous(add, tab: C.Table, found: list[C.Claim], methods: list[str]) -> None:
    """Each verdict that differs from ``PREVIOUS_REPORT``'s, and why: the same prediction
    recomputed from this run over the previous report's cells only. If that gives the old
    verdict, the change comes from the cells added since; if not, from the runs themselves."""
    prev = PREVIOUS_REPORT
    changed = [c for c in found if prev["verdicts"].get(c.number) not in (None, c.verdict)]
    add("## Against the previous report")
    add("")
    old_cells = [tuple(c) for c in prev["cells"]]
    added = [c for c in tab if c not in old_cells]
    head = (f"The full-mode report this one replaces had its runs at commit `{prev['runs']}` "
            f"over cells {', '.join(map(str, old_cells))}")  # fmt: skip
    head += f"; this one adds {', '.join(map(str, added))}." if added else "."
    if not changed:
        add(head + " Every verdict is the same.")
        add("")
        return
    add(head + " Verdicts that changed, each with the prediction recomputed from this run over "
        "the previous report's cells only:")  # fmt: skip
    add("")
    again = {c.number: c for c in predictions(_where(tab, lambda c: c in old_cells), methods)}
    for c in changed:
        old, sub = prev["verdicts"][c.number], again[c.number]
        why = ("the previous verdict again, so the change comes from the cells added since"
               if sub.verdict == old else
               f"not the previous verdict ({old}), so the change is in the runs themselves")  # fmt: skip
        add(f"- P{c.number}: {old} → **{c.verdict}**. Over the previous cells only: "
            f"**{sub.verdict}** ({sub.statistic}): {why}.")  # fmt: skip
    add("")


def write_report(cells: list[CellRuns], opts: LongOptions, wall_s: float, out: Path) -> Path:
    tab = table(cells, opts.threshold)
    found = predictions(tab, [*opts.methods, *opts.ablations])
    lines: list[str] = []
    add = lines.append
    add("# The long toy: credit assignment with a free part and a rare few-token reward")
    add("")
    add(f"_Generated by `scripts/replicate.py --long{' --full' if opts.full else ''}` on "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, {_provenance(opts)}; do "
        "not edit by hand._")  # fmt: skip
    add("")
    lines += recheck_summary(opts.logdir, opts.commit)
    add("The toy replication ([replication.md](replication.md)) finds MRTPO within noise of "
        "GDPO, but its responses are 4–9 tokens long: there is little to place credit on. Here "
        "every response opens with a free part the checkers never read, as the paper's "
        "`<think>` blocks, and the few-token reward `mark` (the closing mark) starts rare, as "
        "the paper's format reward did. The free part's length is the design axis.")  # fmt: skip
    add("")
    _design(add, opts, wall_s)
    add("## Verdicts, one line per prediction")
    add("")
    add("[brackets]: 95% t intervals; n counts (cell, seed) pairs.")
    add("")
    for c in found:
        add(c.line())
    add("")
    if opts.full:
        _against_previous(add, tab, found, [*opts.methods, *opts.ablations])
    _starts(add, cells, tab)
    _chain(add, opts)
    _figures(add, cells, opts.docs / "figures")
    _results(add, cells, tab, opts)
    diag = diagnostics(cells, tab, opts)
    _diagnostics(add, diag, tab)
    _reading(add, diag)
    add("## Reproduce")
    add("")
    add("```")
    add("make replicate ARGS=--long            # quick mode")
    add(f"make replicate ARGS='--long --full'   # cells (K, free words) "
        f"{', '.join(map(str, FULL_CELLS))}; {FULL_SEEDS} seeds")  # fmt: skip
    add("make replicate ARGS='--long --warm-from logs/replicate_long/<run>'  # RL only")
    add("python scripts/replicate.py --long --report-only --logdir <logs/replicate_long/...>")
    add("```")
    add("")
    add(f"Raw runs are under `{os.path.relpath(opts.logdir, opts.docs.parent)}` for this report.")
    add("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def _restore(opts: LongOptions, run_file: Path) -> None:
    saved = json.loads(run_file.read_text())
    for key, value in saved.items():
        setattr(opts, key, [tuple(c) for c in value] if key == "cells" else value)


#: The options a run records in run.json (``--report-only`` restores them).
_RUN_KEYS = ("cells", "seeds", "methods", "ablations", "steps", "threshold", "sft_max_steps", "sft_seed",
             "workers", "threads", "override", "sft_override", "full", "commit",
             "warm_from")  # fmt: skip


@quieted()  # muted while it runs, restored after (it also runs inside tests)
def main(opts: LongOptions) -> int:
    """Run (or, with ``report_only``, re-read) the long toy and write its report."""
    from rich.console import Console

    console = Console()
    default = ROOT / "logs" / "replicate_long" / time.strftime("%Y-%m-%d_%H-%M-%S")
    opts.logdir = run_folder(opts.logdir, opts.report_only, default, "a run")
    run_file, wall_file = opts.logdir / "run.json", opts.logdir / "wall_s.json"
    t0 = time.perf_counter()
    if opts.report_only:
        if not run_file.exists():
            console.print(f"[red]{run_file} not found: is --logdir a long-toy run folder?")
            return 1
        _restore(opts, run_file)
        if opts.recheck:
            sft, rl = cell_jobs(opts)
            recheck([*sft, *rl], opts.logdir, opts.workers, opts.threads, console)
    else:
        opts.logdir.mkdir(parents=True, exist_ok=True)
        opts.commit = opts.commit or source_commit()
        saved = {k: getattr(opts, k) for k in _RUN_KEYS}
        saved["warm_from"] = None if opts.warm_from is None else str(Path(opts.warm_from).resolve())
        run_file.write_text(json.dumps(saved, indent=2))
        console.rule(f"[bold]Long toy: cells {opts.cells}, {opts.seeds} seeds → {opts.logdir}")
        if not run_cells(opts, console):
            return 1
        prev = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else 0.0
        wall_file.write_text(json.dumps({"wall_s": prev + time.perf_counter() - t0}))
    wall = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else float("nan")
    out = write_report(read_cells(opts), opts, wall, opts.docs / "replication_long.md")
    console.print(f"[bold green]report:[/bold green] {out}  (wall time {wall / 60:.1f} min)")
    return 0
