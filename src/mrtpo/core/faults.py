"""Fault bookkeeping of the RL step: what was contained, and when to stop (the rules:
docs/reliability.md). Counts are summed over ranks so every rank decides alike, and saved in
checkpoints. Signals: ``mrtpo.run.signals``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (importing them here would load torch before Hydra parses the command)
    from mrtpo.distributed import Ranks
    from mrtpo.tasks.base import Example, Score

log = logging.getLogger(__name__)


class NonFiniteLogitsError(FloatingPointError):
    """The policy's logits hold NaN or infinity where a token is to be drawn. Finite parameters
    can still overflow them (``optim.lr=1e10``), unseen by the post-update check; the engine
    stops rather than sample (``torch.multinomial`` would fail naming no setting), and since
    every later step samples from the same weights, the run stops instead of skipping."""

    def __init__(self, where: str = "while sampling responses") -> None:
        super().__init__(
            f"the policy's logits are not finite (NaN or infinity) {where}: its weights have "
            "diverged, most often from too high a learning rate. Lower optim.lr and start "
            "again (or from an earlier checkpoint)"
        )


class FaultTracker:
    """Counters and the stop rules; ``state``/``load`` round-trip through checkpoints."""

    COUNTERS = ("scoring_errors_total", "score_many_fallbacks", "replay_oom_retries")

    def __init__(self, max_nonfinite_steps: int, max_consecutive_score_failures: int) -> None:
        self.max_nonfinite_steps = int(max_nonfinite_steps)
        self.max_score_failures = int(max_consecutive_score_failures)
        self.nonfinite_steps = 0
        self.score_failure_streak = 0
        self.counters: dict[str, float] = dict.fromkeys(self.COUNTERS, 0.0)
        self.step_scoring_errors = 0.0  # this step's, global over ranks
        self._warned_unusable = False

    def count(self, name: str, n: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + n

    def check_scoring(
        self, scores: Sequence[Score], examples: Sequence[Example], step: int, ranks: Ranks
    ) -> None:
        """Log and count this step's scoring errors; stop after too many all-failed steps."""
        errors = [(s, e.id) for s, e in zip(scores, examples, strict=True) if s.error]
        for s, eid in errors[:3]:
            log.warning("reward function failed on example %s at step %d: %s", eid, step, s.error)
        if len(errors) > 3:
            log.warning("... and %d more scoring errors at this step", len(errors) - 3)
        usable = sum(any(v is not None for v in s.rewards.values()) for s in scores)
        n_err, n_all, n_usable = ranks.sum(len(errors), len(scores), usable)
        self.step_scoring_errors = n_err
        self.count("scoring_errors_total", n_err)
        if n_usable == 0 and n_all > 0 and not self._warned_unusable:
            self._warned_unusable = True
            log.warning(
                "step %d has no usable reward at all (every reward of every response is None, "
                "NaN or an error): its advantages are 0. Check the task's reward functions",
                step,
            )
        if n_err > 0 and n_err == n_all:
            self.score_failure_streak += 1
            if self.score_failure_streak >= self.max_score_failures:
                last = errors[0][0].error if errors else "on another rank"
                raise RuntimeError(
                    f"scoring failed on every response for {self.score_failure_streak} steps in a "
                    f"row (last error: {last}); fix the task's reward function or raise "
                    "rl.max_consecutive_score_failures"
                )
        else:
            self.score_failure_streak = 0

    def nonfinite(self, what: str, step: int, example_ids: Sequence[str] = ()) -> None:
        """Count a skipped step; raise once ``rl.max_nonfinite_steps`` is reached."""
        self.nonfinite_steps += 1
        ids = f"; examples {list(example_ids)}" if example_ids else ""
        log.warning(
            f"non-finite {what} at step {step}: update skipped ({self.nonfinite_steps} so far; "
            f"limit rl.max_nonfinite_steps={self.max_nonfinite_steps}){ids}"
        )
        if self.nonfinite_steps >= self.max_nonfinite_steps:
            raise RuntimeError(
                f"{self.nonfinite_steps} steps had non-finite values (last: {what}); stopping. "
                "Check the task's rewards, lower optim.lr, or raise rl.max_nonfinite_steps"
            )

    def state(self) -> dict:
        return {
            "nonfinite_steps": self.nonfinite_steps,
            "score_failure_streak": self.score_failure_streak,
            "faults": dict(self.counters),
        }

    def load(self, state: dict) -> None:
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.score_failure_streak = int(state.get("score_failure_streak", 0))
        self.counters.update({k: float(v) for k, v in state.get("faults", {}).items()})
