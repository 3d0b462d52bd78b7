"""The frozen records one RL step passes from phase to phase (shapes as in ``mrtpo.core.batch``);
``StepRecord`` joins them for the metrics, the callbacks and tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from mrtpo.core.batch import RolloutBatch, ScoredBatch
from mrtpo.tasks.base import Score


@dataclass(frozen=True)
class Relevance:
    """Phase 3 (replay): per-token relevance of the replayed (response, reward) pairs."""

    q: Tensor | None = None  # [N, K, T] or [N, 1, T]; None when nothing was replayed
    replayed: Tensor | None = None  # [N, K] / [N, 1] bool
    #: replay's ``P_all`` log-probs [N, T], valid on ``logp_rows`` [N]: where P_all is the
    #: sampling prompt they are pi_old's and save that forward (``OldPolicy``)
    logp: Tensor | None = None
    logp_rows: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # logged as train/replay/<key>


@dataclass(frozen=True)
class OldPolicy:
    """Phase 4: what the updates compare against (a field is None when not needed)."""

    logp: Tensor | None = None  # [N, T] pi_old, when more than one update follows
    tis: Tensor | None = None  # [N, T] truncated importance weights (rl.tis_cap)
    ref_logp: Tensor | None = None  # [N, T] the KL reference's (rl.kl_coef > 0)
    extra: Any = None  # the method's own no-grad inputs (``score_inputs``)
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # the engine gap
    #: the engine gap (and TIS weights) come from the update's own forward, which is pi_old's
    #: when one update follows (``OldPolicyPass.gap_in_update``)
    gap_in_update: bool = False
    #: the cap of the importance weights min(pi_old / pi_engine, cap): rl.tis_cap, or for a
    #: batch sampled by older weights rl.stale_tis_cap; None: no weights
    tis_cap: float | None = None
    #: the batch was sampled by older weights than pi_old's (its gap metrics are logged as
    #: ``rollout/stale/...``: they hold the staleness, not only numerical mismatch)
    stale: bool = False


@dataclass(frozen=True)
class Advantages:
    """Phase 5: token advantages and the method's statistics (logged as train/adv/<key>)."""

    advantages: Tensor  # [N, T]
    stats: dict[str, float] = field(default_factory=dict)
    #: [N, T] the reallocated credit before any cap (``CreditOutput.realloc``); None: none
    realloc: Tensor | None = None
    #: the method's per-token weights from ``q`` (``CreditOutput.weights``); None: none
    weights: Tensor | None = None


@dataclass(frozen=True)
class Update:
    """Phase 6: the step's update metrics, and what the update measured on the way."""

    metrics: dict[str, float]
    tis: Tensor | None = None  # [N, T] TIS weights measured by the update's forward
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # the engine gap, idem


@dataclass(frozen=True)
class StepRecord:
    """Everything one step computed, made once at its end."""

    rollout: RolloutBatch
    scores: list[Score]
    reward_names: tuple[str, ...]
    rewards: Tensor  # [N, K]
    q: Tensor | None = None
    replayed: Tensor | None = None
    old_logp: Tensor | None = None
    tis_weights: Tensor | None = None
    ref_logp: Tensor | None = None
    advantages: Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)
    realloc: Tensor | None = None  # [N, T] the reallocated credit before any cap
    beta: float = 0.0  # the method's scheduled beta at this step (0 for a method without one)
    #: [N, K, T] (or [N, 1, T]) the method's per-token weights from ``q``, as its advantages
    #: used them (1 on every token for a method without its own); None: nothing replayed
    token_weights: Tensor | None = None

    @property
    def mask(self) -> Tensor:
        return self.rollout.response_mask

    @classmethod
    def of(
        cls,
        scored: ScoredBatch,
        rel: Relevance,
        old: OldPolicy,
        adv: Advantages,
        upd: Update,
        *,
        beta: float = 0.0,
        token_weights: Tensor | None = None,
    ) -> StepRecord:
        tis = upd.tis if upd.tis is not None else old.tis
        return cls(
            *(scored.rollout, scored.scores, scored.reward_names, scored.rewards),
            *(rel.q, rel.replayed, old.logp, tis, old.ref_logp),
            *(adv.advantages, adv.stats, adv.realloc, beta, token_weights),
        )


@dataclass(frozen=True)
class StepResult:
    """What ``RLStep.run`` returns: the global metrics to log (``train/`` prefixed), the
    progress-bar values, and the step's record (None when the update was skipped)."""

    metrics: dict[str, float]
    bar: dict[str, float] = field(default_factory=dict)
    record: StepRecord | None = None
    skipped: str | None = None  # what was not finite ("rewards", "advantages", "loss")
    times: dict[str, float] = field(default_factory=dict)  # seconds of each phase
