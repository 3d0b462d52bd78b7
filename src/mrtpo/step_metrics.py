"""The metrics of one RL step (``train/...``), and their combination over ranks.

``assemble`` turns a step's record (``mrtpo.step.StepRecord``) into flat metrics plus the weight of each mean
(how many values it averages on this rank); ``combine`` merges every rank's into the global
batch's; ``AbsentAsNaN`` writes NaN for a metric that existed before but not at this step
(Lightning would otherwise repeat its stale last value).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from mrtpo.distributed import Ranks

if TYPE_CHECKING:
    from mrtpo.step.records import StepRecord

# Step metrics that add up over ranks (the others are averaged, or min/max-reduced).
SUM_METRICS = frozenset({"replay/forwards", "replay/tokens", "tokens_per_s"})
# Step metrics that are already global (reduced before logging, or equal on every rank).
GLOBAL_METRICS = frozenset({"iteration", "nonfinite_skips", "scoring_errors"})
STAGE_TIMES = ("rollout", "reward", "old_logp", "replay", "update", "step")
# The rewards' extra metrics (``Score.extras``): always means, whatever their names end in.
EXTRA_PREFIX = "extra/"
#: update metrics that are means over responses, not tokens (combined over ranks so)
PER_RESPONSE = ("rollout/seq_", "rollout/stale/seq_", "rollout/staleness/")
#: metrics that are shares of one total per rank (their weight): a rank lacking one has 0 of it
SHARE_PREFIXES = ("replay/energy_share/",)


def assemble(
    scored: StepRecord,
    update: Mapping[str, float],
    replay: Mapping[str, float],
    timings: Mapping[str, float],
    faults: Mapping[str, float],
    *,
    success_check: str | None,
    schedule: Mapping[str, float],
    iteration: int,
    nonfinite_skips: int,
    scoring_errors: float,
    diagnostics: tuple[Mapping[str, float], Mapping[str, float]] = ({}, {}),
) -> tuple[dict[str, float], dict[str, float]]:
    """(metrics, weights) of this rank's share of the step; ``diagnostics``: the credit
    diagnostics' (metrics, weights) (``mrtpo.step.diagnostics``)."""
    m, weights = _rewards(scored, success_check)
    mask = scored.rollout.response_mask
    a = scored.advantages[mask]
    if a.numel():
        m.update(
            {
                "adv/mean": float(a.mean()),
                "adv/abs_mean": float(a.abs().mean()),
                "adv/std": float(a.std(unbiased=False)) if a.numel() > 1 else 0.0,
                "adv/min": float(a.min()),
                "adv/max": float(a.max()),
            }
        )
    weights["adv/mean"] = weights["adv/abs_mean"] = float(a.numel())
    m.update({f"adv/{k}": float(v) for k, v in scored.stats.items()})
    m.update(replay)
    m.update(diagnostics[0])
    weights.update(diagnostics[1])
    m.update(update)
    # means over this rank's valid tokens (the engine gap, the update's per-token statistics)
    # or its responses (sequence ratios) are combined over ranks weighted by those counts
    tokens, rows = float(mask.sum()), float(mask.shape[0])
    for k in update:
        if k not in ("loss", "lr") and not k.endswith(("/min", "/max")):
            weights[k] = rows if k.startswith(PER_RESPONSE) else tokens
    weights["adv/std"] = weights["adv/mean"]
    lengths = mask.sum(-1).float()
    m["response_len/mean"] = float(lengths.mean())
    m["response_len/max"] = float(lengths.max())
    m["finished_frac"] = float(scored.rollout.finished.float().mean())
    m["scoring_errors"] = float(scoring_errors)
    # the method's scheduled values (MRTPO's beta): the same on every rank
    m.update({k: float(v) for k, v in schedule.items()})
    m.update(_times(timings, float(lengths.sum())))
    m["iteration"] = float(iteration)
    m.update({k: float(v) for k, v in faults.items()})
    m["nonfinite_skips"] = float(nonfinite_skips)
    return m, weights


def _rewards(
    scored: StepRecord, success_check: str | None
) -> tuple[dict[str, float], dict[str, float]]:
    """Each reward's mean over the responses it applies to, the summed reward, the success
    rate; with the counts they are means over (the weights of the rank reduction)."""
    r = scored.rewards
    m: dict[str, float] = {}
    weights: dict[str, float] = {}
    for k, name in enumerate(scored.reward_names):
        col = r[:, k]
        col = col[~col.isnan()]
        weights[f"reward/{name}/mean"] = float(col.numel())
        if col.numel():
            m[f"reward/{name}/mean"] = float(col.mean())
    m["reward/total/mean"] = float(r.nan_to_num(0.0).sum(-1).mean())
    if success_check:
        succ = [s.checks.get(success_check) for s in scored.scores]
        succ = [float(x) for x in succ if x is not None]
        weights["success"] = float(len(succ))
        if succ:
            m["success"] = sum(succ) / len(succ)
    _extras(scored, m, weights)
    return m, weights


def _extras(scored: StepRecord, m: dict[str, float], weights: dict[str, float]) -> None:
    """Each extra metric a reward reported (``Score.extras``): its mean over the responses
    that have it, ``extra/<reward>/<name>``, weighted by their count."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for s in scored.scores:
        for reward, extras in (getattr(s, "extras", None) or {}).items():
            for name, value in extras.items():
                key = f"{EXTRA_PREFIX}{reward}/{name}"
                sums[key] = sums.get(key, 0.0) + float(value)
                counts[key] = counts.get(key, 0) + 1
    for key, total in sums.items():
        m[key] = total / counts[key]
        weights[key] = float(counts[key])


def _times(timings: Mapping[str, float], tokens: float) -> dict[str, float]:
    """Each stage's seconds, replay's share of the step and the sampled tokens per second."""
    m = {f"time/{k}": float(timings[k]) for k in STAGE_TIMES if k in timings}
    step_t = float(timings.get("step", 0.0))
    if step_t > 0:
        m["time/replay_share"] = float(timings.get("replay", 0.0)) / step_t
        m["tokens_per_s"] = tokens / step_t
    return m


def combine(
    m: dict[str, float], weights: dict[str, float], ranks: Ranks, already_global=()
) -> dict[str, float]:
    """Every rank's step metrics combined into the global batch's (identity in one process).

    Means are weighted by each rank's count (``weights``, default 1); counts and throughput
    are summed; minima, maxima and stage times (the slowest rank) reduced accordingly. A key
    some rank lacks (a reward absent from its samples) is combined over the ranks that have
    it, so every rank ends with the same keys; except a share (``SHARE_PREFIXES``), which such
    a rank holds 0 of, at the weight of its other shares under the same prefix.
    """
    if ranks.group is None:
        return m
    parts = ranks.gather((m, weights))
    keys = sorted(set().union(*(p[0] for p in parts)))
    out: dict[str, float] = {}
    for k in keys:
        vals = [(p[0][k], p[1].get(k, 1.0)) for p in parts if k in p[0]]
        xs = [v for v, _ in vals]
        share = next((s for s in SHARE_PREFIXES if k.startswith(s)), None)
        if share is not None:  # whatever the segment's name ends in
            out[k] = _weighted_mean([_share(p, k, share) for p in parts])
        elif k.startswith(EXTRA_PREFIX):
            out[k] = _weighted_mean(vals)
        elif k in SUM_METRICS:
            out[k] = float(sum(xs))
        elif k.endswith("/min"):
            out[k] = float(min(xs))
        elif k.endswith("/max") or k.startswith("time/"):
            out[k] = float(max(xs))
        elif k in GLOBAL_METRICS or k in already_global:
            out[k] = float(xs[0])  # already global (or identical on every rank)
        elif k.endswith("/std") and k.removesuffix("/std") + "/mean" in keys:
            out[k] = _pooled_std(parts, k, k.removesuffix("/std") + "/mean")
        else:
            out[k] = _weighted_mean(vals)
    return out


def _share(part, key: str, prefix: str) -> tuple[float, float]:
    """(value, weight) of one rank's share ``key``: (0, its total) where it lacks the key."""
    m, weights = part
    if key in m:
        return m[key], weights.get(key, 1.0)
    total = next((weights.get(k, 0.0) for k in m if k.startswith(prefix)), 0.0)
    return 0.0, total


def _weighted_mean(vals: list[tuple[float, float]]) -> float:
    """The mean of (value, weight) pairs; the first value when no weight is positive."""
    total = sum(w for _, w in vals)
    return float(sum(v * w for v, w in vals) / total) if total > 0 else float(vals[0][0])


def _pooled_std(parts, std_key: str, mean_key: str) -> float:
    """The standard deviation over every rank's values, from each rank's count (the mean's
    weight), mean and (population) standard deviation."""
    stats = [
        (p[1].get(mean_key, 1.0), p[0][mean_key], p[0][std_key])
        for p in parts
        if std_key in p[0] and mean_key in p[0]
    ]
    n = sum(w for w, _, _ in stats)
    if n <= 0:
        return float(stats[0][2]) if stats else float("nan")
    mu = sum(w * m for w, m, _ in stats) / n
    var = sum(w * (sd * sd + (m - mu) ** 2) for w, m, sd in stats) / n
    return float(var**0.5)


class AbsentAsNaN:
    """Fills keys logged at an earlier step but missing now with NaN."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, m: dict[str, float]) -> dict[str, float]:
        for k in self.seen - m.keys():
            m[k] = float("nan")
        self.seen |= m.keys()
        return m
