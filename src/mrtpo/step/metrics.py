"""The metrics of one RL step (``train/...``), and their combination over ranks.

Each metric is declared once as a ``Stat`` (value, ``Reduce``, and a mean's weight on this
rank), in the style of verl's ``utils/metric``: where it is made, or in ``DECLARED`` by exact
key when measured elsewhere; an undeclared one is an error, never a guess from its name.
``AbsentAsNaN``: a missing metric is NaN (Lightning would repeat its stale value).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mrtpo.distributed import Ranks

if TYPE_CHECKING:
    from mrtpo.step.records import StepRecord


class Reduce(enum.Enum):
    """How one metric combines over ranks."""

    MEAN = "mean"  # a mean per rank: every rank counts once (weight 1)
    MEAN_BY_TOKENS = "mean_by_tokens"  # weighted by the valid tokens it averages
    MEAN_BY_RESPONSES = "mean_by_responses"  # weighted by the responses it averages
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    SAME = "same"  # already global, or equal on every rank: the first rank's
    POOLED_STD = "pooled_std"  # a population std about ``Stat.mean``, over ``weight`` values
    SHARE = "share"  # a share of the rank's total (``weight``); a rank lacking it holds 0


@dataclass(frozen=True)
class Stat:
    """One rank's value of a step metric and how it combines (``Reduce``). ``weight``: what a mean
    averages (1 for ``MEAN``), a pooled std's count or a ``SHARE``'s total; ``mean``: a
    ``POOLED_STD``'s mean; ``family``: the key prefix of one total's shares (``SHARE``)."""

    value: float
    reduce: Reduce = Reduce.MEAN
    weight: float = 1.0
    mean: float | None = None
    family: str = ""


#: The engine gap's metrics (``mrtpo.core.loss.EngineGap``), under ``rollout/`` (or
#: ``rollout/stale/`` for a batch sampled by older weights).
_GAP = {
    "logp_gap/mean": Reduce.MEAN_BY_TOKENS,
    "logp_gap/max": Reduce.MAX,
    "seq_ratio/mean": Reduce.MEAN_BY_RESPONSES,
    "seq_ratio/min": Reduce.MIN,
    "seq_ratio/max": Reduce.MAX,
    "tis_weight/mean": Reduce.MEAN_BY_TOKENS,
    "tis_capped_frac": Reduce.MEAN_BY_TOKENS,
}
#: Metrics measured outside this module, by exact key.
DECLARED: dict[str, Reduce] = {
    "loss": Reduce.MEAN,  # the updater's mean over its updates
    "lr": Reduce.MEAN,
    **{f"rollout/{k}": r for k, r in _GAP.items()},
    **{f"rollout/stale/{k}": r for k, r in _GAP.items()},
    "rollout/staleness/mean": Reduce.MEAN_BY_RESPONSES,  # RLStep.staleness
    "rollout/staleness/max": Reduce.MAX,
    # the rollout schedule's counters (RolloutSource.metrics), weighted as they always were
    "rollout/dropped": Reduce.MEAN_BY_TOKENS,
    "rollout/generate_s": Reduce.MEAN_BY_TOKENS,
    "rollout/push_s": Reduce.MEAN_BY_TOKENS,
    # replay's (Replayer._metrics, NoiseFloor.metrics); top80_token_share/<reward> in assemble
    "replay/share": Reduce.MEAN,
    "replay/forwards": Reduce.SUM,
    "replay/tokens": Reduce.SUM,
    "replay/noise_floor": Reduce.MEAN,
    "replay/noise_floor/max": Reduce.MAX,
}
#: The advantages' own statistics (a method may report them too, ``_adv_stats``).
_ADV = {
    "adv/mean": Reduce.MEAN_BY_TOKENS,
    "adv/abs_mean": Reduce.MEAN_BY_TOKENS,
    "adv/std": Reduce.POOLED_STD,
    "adv/min": Reduce.MIN,
    "adv/max": Reduce.MAX,
}
STAGE_TIMES = ("rollout", "reward", "old_logp", "replay", "update", "step")
EXTRA_PREFIX = "extra/"


def declare(
    values: Mapping[str, float],
    reductions: Mapping[str, Reduce],
    *,
    default: Reduce | None = None,
    tokens: float = 1.0,
    responses: float = 1.0,
) -> dict[str, Stat]:
    """``values`` as Stats, each with its reduction from ``reductions`` (else ``default``)
    and the weight that reduction takes (``tokens``, ``responses``, else 1)."""
    out: dict[str, Stat] = {}
    for k, v in values.items():
        how = reductions.get(k, default)
        if how is None:
            raise ValueError(
                f"step metric {k!r} has no declared reduction: declare it in "
                "mrtpo.step.metrics.DECLARED (or produce it as a step_metrics.Stat)"
            )
        weight = {Reduce.MEAN_BY_TOKENS: tokens, Reduce.MEAN_BY_RESPONSES: responses}
        out[k] = Stat(v, how, weight.get(how, 1.0))
    return out


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
    diagnostics: Mapping[str, Stat] | None = None,
    rollout: Mapping[str, float] | None = None,
) -> dict[str, Stat]:
    """This rank's share of the step, each metric declared: ``update``, the updater's
    metrics; ``rollout``, the engine gap, staleness and schedule counters; ``replay``,
    replay's; ``diagnostics``, the credit diagnostics (``mrtpo.step.diagnostics``)."""
    mask = scored.rollout.response_mask
    per = {"tokens": float(mask.sum()), "responses": float(mask.shape[0])}
    out = _rewards(scored, success_check)
    out.update(_advantages(scored))
    tops = {f"replay/top80_token_share/{n}": Reduce.MEAN for n in scored.reward_names}
    out.update(declare(replay, {**DECLARED, **tops}))
    out.update(diagnostics or {})
    # the updater's per-token statistics are means over the tokens (its documented default)
    out.update(declare(update, DECLARED, default=Reduce.MEAN_BY_TOKENS, **per))
    out.update(declare(rollout or {}, DECLARED, **per))
    lengths = mask.sum(-1).float()
    out["response_len/mean"] = Stat(float(lengths.mean()))
    out["response_len/max"] = Stat(float(lengths.max()), Reduce.MAX)
    out["finished_frac"] = Stat(float(scored.rollout.finished.float().mean()))
    out["scoring_errors"] = Stat(float(scoring_errors), Reduce.SAME)  # already global
    # the method's scheduled values (MRTPO's beta): the same on every rank
    out.update(_same(schedule))
    out.update(_times(timings, float(lengths.sum())))
    out["iteration"] = Stat(float(iteration), Reduce.SAME)
    out.update(_same(faults))  # the fault counters are global
    out["nonfinite_skips"] = Stat(float(nonfinite_skips), Reduce.SAME)
    return out


def _same(values: Mapping[str, float]) -> dict[str, Stat]:
    return {k: Stat(float(v), Reduce.SAME) for k, v in values.items()}


def _advantages(scored: StepRecord) -> dict[str, Stat]:
    """The advantages' mean, mean magnitude, std, min and max over this rank's valid tokens,
    and the method's statistics (``adv/<key>``: means per rank unless named in ``_ADV``)."""
    a = scored.advantages[scored.rollout.response_mask]
    vals: dict[str, float] = {}
    if a.numel():
        vals = {
            "adv/mean": float(a.mean()),
            "adv/abs_mean": float(a.abs().mean()),
            "adv/std": float(a.std(unbiased=False)) if a.numel() > 1 else 0.0,
            "adv/min": float(a.min()),
            "adv/max": float(a.max()),
        }
    vals.update({f"adv/{k}": float(v) for k, v in scored.stats.items()})
    out = declare(vals, _ADV, default=Reduce.MEAN, tokens=float(a.numel()))
    if "adv/std" in out:  # pooled over ranks from each rank's count and mean
        out["adv/std"] = replace(out["adv/std"], weight=float(a.numel()), mean=vals.get("adv/mean"))
    return out


def _rewards(scored: StepRecord, success_check: str | None) -> dict[str, Stat]:
    """Each reward's mean over the responses it applies to, the summed reward, the success
    rate, and the rewards' extras."""
    r = scored.rewards
    out: dict[str, Stat] = {}
    for k, name in enumerate(scored.reward_names):
        col = r[:, k]
        col = col[~col.isnan()]
        if col.numel():
            by = Reduce.MEAN_BY_RESPONSES
            out[f"reward/{name}/mean"] = Stat(float(col.mean()), by, float(col.numel()))
    out["reward/total/mean"] = Stat(float(r.nan_to_num(0.0).sum(-1).mean()))
    if success_check:
        succ = [s.checks.get(success_check) for s in scored.scores]
        succ = [float(x) for x in succ if x is not None]
        if succ:
            out["success"] = Stat(sum(succ) / len(succ), Reduce.MEAN_BY_RESPONSES, float(len(succ)))
    out.update(_extras(scored))
    return out


def _extras(scored: StepRecord) -> dict[str, Stat]:
    """``extra/<reward>/<name>``: each ``Score.extras`` value's mean over the responses with it."""
    values: dict[str, list[float]] = {}
    for s in scored.scores:
        for reward, extras in (getattr(s, "extras", None) or {}).items():
            for name, value in extras.items():
                values.setdefault(f"{EXTRA_PREFIX}{reward}/{name}", []).append(float(value))
    by = Reduce.MEAN_BY_RESPONSES
    return {k: Stat(sum(v) / len(v), by, float(len(v))) for k, v in values.items()}


def _times(timings: Mapping[str, float], tokens: float) -> dict[str, Stat]:
    """Each stage's seconds and replay's share of the step (the slowest rank's), and the
    sampled tokens per second (summed over ranks)."""
    out = {f"time/{k}": Stat(float(timings[k]), Reduce.MAX) for k in STAGE_TIMES if k in timings}
    step_t = float(timings.get("step", 0.0))
    if step_t > 0:
        share = float(timings.get("replay", 0.0)) / step_t
        out["time/replay_share"] = Stat(share, Reduce.MAX)
        out["tokens_per_s"] = Stat(tokens / step_t, Reduce.SUM)
    return out


def combine(stats: Mapping[str, Stat], ranks: Ranks) -> dict[str, float]:
    """Every rank's step metrics combined into the global batch's as declared (identity in one
    process). A key some rank lacks is combined over those that have it, except a ``SHARE``,
    which that rank holds 0 of, at its family's total."""
    for k, s in stats.items():
        if not isinstance(s, Stat):
            raise ValueError(
                f"step metric {k!r} has no declared reduction: give it as "
                "mrtpo.step.metrics.Stat(value, Reduce.<how>)"
            )
    if ranks.group is None:
        return {k: s.value for k, s in stats.items()}
    return merge(ranks.gather(dict(stats)))


def merge(parts: list[Mapping[str, Stat]]) -> dict[str, float]:
    """Every rank's declared metrics (``parts``, one mapping a rank) combined, keys sorted."""
    keys = sorted(set().union(*parts))
    return {k: _reduce(k, parts) for k in keys}


_PLAIN = {Reduce.SUM: sum, Reduce.MIN: min, Reduce.MAX: max, Reduce.SAME: lambda xs: xs[0]}


def _reduce(key: str, parts: list[Mapping[str, Stat]]) -> float:
    """One metric over every rank's ``Stat`` of it, as the ranks declared it."""
    have = [p[key] for p in parts if key in p]
    how = have[0].reduce
    if any(s.reduce is not how for s in have):
        raise ValueError(f"step metric {key!r} is declared differently on different ranks")
    xs = [s.value for s in have]
    if how is Reduce.SHARE:
        return _weighted_mean([_share(p, key, have[0].family) for p in parts])
    if how in _PLAIN:
        return float(_PLAIN[how](xs))
    if how is Reduce.POOLED_STD:
        return _pooled_std(have)
    return _weighted_mean([(s.value, s.weight) for s in have])


def _share(part: Mapping[str, Stat], key: str, family: str) -> tuple[float, float]:
    """(value, weight) of one rank's share ``key``: (0, its total) where it lacks the key."""
    if key in part:
        return part[key].value, part[key].weight
    total = next((s.weight for s in part.values() if s.family == family), 0.0)
    return 0.0, total


def _weighted_mean(vals: Iterable[tuple[float, float]]) -> float:
    """The mean of (value, weight) pairs; the first value when no weight is positive."""
    vals = list(vals)
    total = sum(w for _, w in vals)
    return float(sum(v * w for v, w in vals) / total) if total > 0 else float(vals[0][0])


def _pooled_std(have: list[Stat]) -> float:
    """The standard deviation over every rank's values, from each rank's count, mean and
    (population) standard deviation; the weighted mean of the stds where none has a mean."""
    stats = [(s.weight, s.mean, s.value) for s in have if s.mean is not None]
    if not stats:
        return _weighted_mean([(s.value, s.weight) for s in have])
    n = sum(w for w, _, _ in stats)
    if n <= 0:
        return float(stats[0][2])
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
