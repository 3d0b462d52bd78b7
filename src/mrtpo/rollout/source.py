"""Where a step's rollout comes from: an engine, the sampling settings and the seed rule.

``RolloutSource.sample`` is the step's phase 1 (``mrtpo.step``): G responses for each of B
prompts, drawn with a seed that depends only on (run seed, step, rank, salt), so a resumed
run samples what the original would have. The Lightning rollout callback hands its result
to the step; a plain loop calls it directly. No Lightning here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from mrtpo.batch import RolloutBatch
from mrtpo.rollout.base import RolloutEngine, SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.tasks.base import Example


class RolloutSource:
    """Samples rollouts from ``engine`` (training: G samples; validation: one greedy)."""

    def __init__(
        self,
        engine: RolloutEngine,
        sampling: SamplingConfig,
        group_size: int,
        val_sampling: SamplingConfig,
    ) -> None:
        self.engine, self.sampling, self.group_size = engine, sampling, group_size
        self.val_sampling = val_sampling
        self.tokenizer = None
        self.eos_ids: list[int] = []
        self.seconds = 0.0  # the last training rollout's

    def bind(self, policy, tokenizer, eos_ids: list[int]) -> None:
        self.tokenizer, self.eos_ids = tokenizer, list(eos_ids)
        self.engine.bind(policy, tokenizer, self.eos_ids)

    @staticmethod
    def seed(run_seed: int, iteration: int, rank: int, salt: int = 0) -> int:
        """Depends on (seed, step, rank, salt) only: a resumed run samples what the original
        would. Salt 0 is training; validation batch ``i`` uses ``1 + i``."""
        return (run_seed * 1_000_003 + iteration * 101 + salt) * 31 + rank

    def sample(self, examples: Sequence[Example], seed: int) -> RolloutBatch:
        """G responses for each example (the engine woken for it and put to sleep after)."""
        t0 = time.perf_counter()
        self.engine.wake_up()
        roll = build_rollout(
            self.engine,
            self.tokenizer,
            list(examples),
            self.group_size,
            self.sampling,
            seed,
            self.eos_ids,
        )
        self.engine.sleep()
        self.seconds = time.perf_counter() - t0
        return roll

    def sample_validation(self, examples: Sequence[Example], seed: int) -> RolloutBatch:
        """One greedy response for each example."""
        return build_rollout(
            self.engine, self.tokenizer, list(examples), 1, self.val_sampling, seed, self.eos_ids
        )

    def push_weights(self, policy) -> None:
        """The policy's current weights into the engine (a no-op for engines that share them)."""
        self.engine.wake_up()
        self.engine.sync_weights(policy)
