"""The paper's claims, each as one statistic with a 95% interval and a verdict by a fixed rule.

Input: every run's per-step series (``runs.run_series``), as ``{K: {method: {seed: series}}}``.
Each run is summarized once (``summarize``); a claim compares methods on the same seed
(paired differences) and pools the pairs over K, each (K, seed) being one observation: the
runs of different K start from different warm starts, so their differences are independent.

The verdict words and rules are ``claim_verdict`` / ``all_of`` / ``below_verdict`` below:
*reproduced* when the interval lies wholly on the claimed side, *not reproduced* when wholly
on the other side, *inconclusive* otherwise. Nothing here looks at which way a result went
before choosing what to compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mrtpo.evaluate.analysis.stats import (
    Interval,
    censored_steps,
    early_minus_late,
    mean_ci,
    mean_finite,
    run_stats,
    trend,
    value_at,
)

#: Words of a claim's verdict.
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"


def claim_verdict(iv: Interval, direction: int = 1) -> str:
    """A claim that a quantity is positive (``direction=1``) or negative (``-1``): reproduced
    when its 95% interval lies wholly on the claimed side of zero, not reproduced when wholly
    on the other side, inconclusive when it contains zero or there is no interval."""
    if direction not in (1, -1):
        raise ValueError(f"direction must be 1 or -1, got {direction}")
    s = iv.sign * direction
    return REPRODUCED if s > 0 else NOT_REPRODUCED if s < 0 else INCONCLUSIVE


def all_of(verdicts: Iterable[str]) -> str:
    """A claim made of parts (``a > b > c``): reproduced when every part is, not reproduced
    when any part is contradicted, inconclusive otherwise."""
    v = list(verdicts)
    if not v:
        return INCONCLUSIVE
    if any(x == NOT_REPRODUCED for x in v):
        return NOT_REPRODUCED
    return REPRODUCED if all(x == REPRODUCED for x in v) else INCONCLUSIVE


def below_verdict(iv: Interval, bound: float) -> str:
    """A claim that a quantity is at most ``bound``: reproduced when the whole interval is
    at or below it, not reproduced when the whole interval is above, else inconclusive."""
    if math.isnan(iv.mean) or math.isnan(iv.half):
        return INCONCLUSIVE
    return REPRODUCED if iv.hi <= bound else NOT_REPRODUCED if iv.lo > bound else INCONCLUSIVE


BASELINE = "gdpo"
MRTPO = "mrtpo"
JOINT = "mrtpo_joint"
BETAS = {0.25: "mrtpo@beta=0.25", 0.5: "mrtpo", 0.75: "mrtpo@beta=0.75"}
#: Steps averaged at each end of a run for the replayed share's fall (claim 5).
REPLAY_WINDOW = 5

Runs = Mapping[int, Mapping[str, Mapping[int, Mapping[str, Sequence[float]]]]]
Table = dict[int, dict[str, dict[int, dict[str, float]]]]


def summarize(
    series: Mapping[str, Sequence[float]], threshold: float, few_token: str, at_step: int
) -> dict[str, float]:
    """One run's numbers: ``run_stats`` of its success curve, the few-token reward's
    compliance at ``at_step`` (trailing 5-step mean) and at the start (first 3 steps), the
    replayed share (first and last ``REPLAY_WINDOW`` steps, their difference, all steps),
    replay's share of the step time, and the share of tokens holding 80% of each reward's
    relevance (mean over steps; ``top80`` = the mean over rewards)."""
    out = dict(run_stats(series["success"], threshold))
    out["steps_censored"] = censored_steps(out)
    ft = series.get(few_token)
    out["compliance"] = value_at(ft, at_step) if ft else math.nan
    out["compliance_start"] = mean_finite(ft[:3]) if ft else math.nan
    share = series.get("replay/share")
    if share and not math.isnan(mean_finite(share)):
        out["replay_overall"] = mean_finite(share)
        out["replay_early"] = mean_finite(share[:REPLAY_WINDOW])
        out["replay_late"] = mean_finite(share[-REPLAY_WINDOW:])
        out["replay_drop"] = early_minus_late(share, REPLAY_WINDOW)
    t = series.get("time/replay_share")
    if t:
        out["time_replay"] = mean_finite(t)
    tops = []
    for name, vals in series.items():
        if name.startswith("replay/top80/"):
            v = mean_finite(vals)
            out["top80/" + name.removeprefix("replay/top80/")] = v
            tops.append(v)
    if tops:
        out["top80"] = mean_finite(tops)
    return out


def table(runs: Runs, threshold: float, few_token: str, at_step: int) -> Table:
    return {
        k: {
            m: {s: summarize(c, threshold, few_token, at_step) for s, c in seeds.items()}
            for m, seeds in by_m.items()
        }
        for k, by_m in runs.items()
    }


def paired(tab: Table, a: str, b: str, key: str) -> dict[tuple[int, int], float]:
    """``a``'s ``key`` minus ``b``'s, per (K, seed) both ran (finite values only)."""
    out = {}
    for k, by_m in sorted(tab.items()):
        ra, rb = by_m.get(a, {}), by_m.get(b, {})
        for s in sorted(ra.keys() & rb.keys()):
            d = ra[s].get(key, math.nan) - rb[s].get(key, math.nan)
            if math.isfinite(d):
                out[(k, s)] = d
    return out


def per_k(diffs: Mapping[tuple[int, int], float]) -> dict[int, Interval]:
    ks = sorted({k for k, _ in diffs})
    return {k: mean_ci(v for (kk, _), v in diffs.items() if kk == k) for k in ks}


def values(tab: Table, method: str, key: str) -> dict[tuple[int, int], float]:
    out = {}
    for k, by_m in sorted(tab.items()):
        for s, x in sorted(by_m.get(method, {}).items()):
            v = x.get(key, math.nan)
            if math.isfinite(v):
                out[(k, s)] = v
    return out


def ci_text(iv: Interval, digits: int = 3) -> str:
    if math.isnan(iv.mean):
        return "no data"
    if math.isnan(iv.half):
        return f"{iv.mean:+.{digits}f} (n = {iv.n}, no interval)"
    return f"{iv.mean:+.{digits}f} [{iv.lo:+.{digits}f}, {iv.hi:+.{digits}f}] (n = {iv.n})"


def level_text(iv: Interval, digits: int = 3) -> str:
    """An interval of a level (not a difference): no sign."""
    if math.isnan(iv.mean):
        return "no data"
    if math.isnan(iv.half):
        return f"{iv.mean:.{digits}f} (n = {iv.n}, no interval)"
    return f"{iv.mean:.{digits}f} [{iv.lo:.{digits}f}, {iv.hi:.{digits}f}] (n = {iv.n})"


@dataclass
class Claim:
    number: int
    title: str  # the paper's claim, in a few words
    verdict: str  # reproduced / not reproduced / inconclusive
    statistic: str  # what was measured, with its interval
    why: str = ""  # when the toy cannot show it, or other context for the verdict
    details: dict[str, Any] = field(default_factory=dict)  # numbers for tables and plots

    def line(self) -> str:
        out = f"{self.number}. **{self.title}** — **{self.verdict}**: {self.statistic}"
        return out + (f". {self.why}" if self.why else "")


def _missing(number: int, title: str, what: str) -> Claim:
    return Claim(number, title, INCONCLUSIVE, f"not measured ({what})")


def claim_gain_grows(tab: Table) -> Claim:
    """1. MRTPO − GDPO per K (AUC; steps to threshold) and the slope of the per-seed paired
    differences against K; the claim: the AUC gain grows with K (positive slope)."""
    title = "The gain over GDPO grows with the number of rewards K"
    d_auc = paired(tab, MRTPO, BASELINE, "auc")
    d_steps = paired(tab, MRTPO, BASELINE, "steps_censored")
    if not d_auc:
        return _missing(1, title, "needs mrtpo and gdpo runs")
    by_k = {
        k: [v for (kk, _), v in d_auc.items() if kk == k] for k in sorted({k for k, _ in d_auc})
    }
    steps_k = {
        k: [v for (kk, _), v in d_steps.items() if kk == k] for k in sorted({k for k, _ in d_steps})
    }
    details = {"auc": per_k(d_auc), "steps": per_k(d_steps), "auc_points": by_k}
    gains = "; ".join(f"K = {k}: {ci_text(iv)}" for k, iv in details["auc"].items())
    if len(by_k) < 2:
        return Claim(
            1, title, INCONCLUSIVE,
            f"MRTPO − GDPO Δ AUC {gains}; Δ steps to threshold "
            + "; ".join(f"K = {k}: {ci_text(iv, 1)}" for k, iv in details["steps"].items()),
            "One K only (quick mode): a trend in K needs the full mode (K = 2, 4, 8).",
            details,
        )  # fmt: skip
    tr, trs = trend(by_k), trend(steps_k)
    details.update(trend_auc=tr, trend_steps=trs)
    v_auc = claim_verdict(tr.interval, +1)
    stat = (
        f"slope of MRTPO − GDPO Δ AUC in K {ci_text(tr.interval, 4)} per added reward "
        f"(per K: {gains}); slope of Δ steps to threshold {ci_text(trs.interval, 2)} per "
        f"added reward ({claim_verdict(trs.interval, -1)} for fewer steps with more rewards)"
    )
    return Claim(1, title, v_auc, stat, details=details)


def claim_few_token(tab: Table, methods: Sequence[str], few_token: str, at_step: int) -> Claim:
    """2. The few-token reward's compliance at step ``at_step`` per method; the claim: MRTPO's
    exceeds GDPO's (paired, pooled over K)."""
    title = f"A reward a few tokens decide (`{few_token}`) learns faster under MRTPO"
    d = paired(tab, MRTPO, BASELINE, "compliance")
    if not d:
        return _missing(2, title, f"no `{few_token}` reward in the runs, or no mrtpo/gdpo pair")
    levels = {m: mean_ci(values(tab, m, "compliance").values()) for m in methods}
    starts = {m: mean_ci(values(tab, m, "compliance_start").values()) for m in methods}
    iv = mean_ci(d.values())
    stat = (
        f"compliance after {at_step} steps, MRTPO − GDPO {ci_text(iv)}; per method "
        + ", ".join(f"{m} {lv.mean:.2f}" for m, lv in levels.items() if not math.isnan(lv.mean))
        + " (paper: 0.97 MRTPO, 0.02 GDPO, 0.04 GRPO after 10 steps)"
    )
    why = ""
    s = [v.mean for v in starts.values() if not math.isnan(v.mean)]
    if s and min(s) > 0.5:
        why = (
            f"The toy's warm start already meets `{few_token}` in {min(s):.0%}–{max(s):.0%} of "
            "samples, unlike the paper's 2–4%: there is less to learn than in tool calling."
        )
    return Claim(2, title, claim_verdict(iv, +1), stat, why,
                 {"levels": levels, "starts": starts, "diff": iv, "per_k": per_k(d)})  # fmt: skip


def claim_ablation_order(tab: Table) -> Claim:
    """3. MRTPO > joint > GDPO in AUC: both paired differences (pooled over K) positive."""
    title = "Ablation order MRTPO > joint profile > GDPO"
    a = paired(tab, MRTPO, JOINT, "auc")
    b = paired(tab, JOINT, BASELINE, "auc")
    if not a or not b:
        return _missing(3, title, "needs mrtpo, mrtpo_joint and gdpo runs")
    ia, ib = mean_ci(a.values()), mean_ci(b.values())
    va, vb = claim_verdict(ia, +1), claim_verdict(ib, +1)
    stat = f"Δ AUC MRTPO − joint {ci_text(ia)} ({va}); joint − GDPO {ci_text(ib)} ({vb})"
    return Claim(3, title, all_of([va, vb]), stat,
                 details={"mrtpo-joint": per_k(a), "joint-gdpo": per_k(b)})  # fmt: skip


def claim_beta(tab: Table) -> Claim:
    """4. β = 0.5 is a reasonable default: its gain over GDPO is positive; the curve over
    β ∈ {0.25, 0.5, 0.75} and each other β against 0.5 are reported alongside."""
    title = "β = 0.5 is a reasonable default (0.25 / 0.75 better on some tasks)"
    curve = {b: mean_ci(paired(tab, m, BASELINE, "auc").values()) for b, m in BETAS.items()}
    if math.isnan(curve[0.5].mean):
        return _missing(4, title, "needs mrtpo and gdpo runs")
    vs_half = {
        b: mean_ci(paired(tab, m, BETAS[0.5], "auc").values()) for b, m in BETAS.items() if b != 0.5
    }
    parts = [f"β = {b:g}: {ci_text(iv)}" for b, iv in curve.items() if not math.isnan(iv.mean)]
    stat = "Δ AUC vs GDPO " + "; ".join(parts)
    others = [f"β = {b:g} − β = 0.5: {ci_text(iv)}" for b, iv in vs_half.items()
              if not math.isnan(iv.mean)]  # fmt: skip
    if others:
        stat += " (" + "; ".join(others) + ")"
    why = "" if others else "Only β = 0.5 ran (the β curve is in the full mode)."
    return Claim(4, title, claim_verdict(curve[0.5], +1), stat, why,
                 {"curve": curve, "vs_half": vs_half})  # fmt: skip


def claim_replay_share(tab: Table) -> Claim:
    """5. Replay is cheap because groups with varying rewards become rare: the share of pairs
    replayed falls from the first to the last steps of MRTPO runs (pooled over K)."""
    title = "The replayed share falls over training (paper: 61% → ~10% of groups; 12–21% overall)"
    drop = values(tab, MRTPO, "replay_drop")
    if not drop:
        return _missing(5, title, "no replay metrics in the mrtpo runs")
    iv = mean_ci(drop.values())
    early = mean_ci(values(tab, MRTPO, "replay_early").values())
    late = mean_ci(values(tab, MRTPO, "replay_late").values())
    overall = mean_ci(values(tab, MRTPO, "replay_overall").values())
    time_share = mean_ci(values(tab, MRTPO, "time_replay").values())
    stat = (
        f"first {REPLAY_WINDOW} steps minus last {REPLAY_WINDOW}, share of candidate pairs "
        f"replayed: {ci_text(iv)} (from {early.mean:.0%} to {late.mean:.0%}); overall "
        f"{level_text(overall)} of pairs; replay took {time_share.mean:.0%} of the step time"
    )
    return Claim(5, title, claim_verdict(iv, +1), stat,
                 details={"drop": iv, "early": early, "late": late, "overall": overall,
                          "time": time_share})  # fmt: skip


def claim_concentration(tab: Table, bound: float) -> Claim:
    """6. 80% of a reward's distance falls on few tokens: the per-run mean (over rewards and
    steps) share of tokens holding 80% of the relevance is at most ``bound``."""
    title = "Relevance concentrates: 80% of a reward's distance on 13–29% of the tokens"
    v = values(tab, MRTPO, "top80")
    if not v:
        return _missing(6, title, "no top-80% token shares in the mrtpo runs")
    iv = mean_ci(v.values())
    names = sorted({n for by_m in tab.values() for x in by_m.get(MRTPO, {}).values()
                    for n in x if n.startswith("top80/")})  # fmt: skip
    per_reward = {n.removeprefix("top80/"): mean_ci(values(tab, MRTPO, n).values()) for n in names}
    stat = (
        f"share of a response's tokens holding 80% of a reward's Jensen–Shannon distance, "
        f"mean over rewards {level_text(iv)} (≤ {bound:g} claimed); per reward "
        + ", ".join(f"{n} {x.mean:.2f}" for n, x in per_reward.items())
    )
    why = (
        "Toy responses are 4–9 tokens long, so one token is already 11–25% of a response: "
        "this share cannot fall as low as on long responses."
    )
    return Claim(6, title, below_verdict(iv, bound), stat, why,
                 {"overall": iv, "per_reward": per_reward})  # fmt: skip


def evaluate(
    tab: Table, methods: Sequence[str], few_token: str, at_step: int, bound: float
) -> list[Claim]:
    return [
        claim_gain_grows(tab),
        claim_few_token(tab, methods, few_token, at_step),
        claim_ablation_order(tab),
        claim_beta(tab),
        claim_replay_share(tab),
        claim_concentration(tab, bound),
    ]
