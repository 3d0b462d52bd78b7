"""The rollout callback: sample before each step, sync weights into the engine after it."""

from __future__ import annotations

import time
from collections.abc import Mapping

import lightning as L

from mrtpo.batch import PromptBatch
from mrtpo.models import eos_token_ids
from mrtpo.rollout.base import RolloutEngine, SamplingConfig
from mrtpo.rollout.build import build_rollout


class RolloutCallback(L.Callback):
    """Fills ``batch.rollout`` with G samples per prompt (greedy, 1 sample for validation).

    The rollout carries ``sampling`` (``RolloutBatch.sampling``): the trainer takes every
    log-prob of these samples at its temperature.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        sampling: Mapping | None = None,
        group_size: int = 4,
        val_max_new_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.sampling = SamplingConfig(**dict(sampling or {}))
        # what the trainer's log-probs cannot reproduce (truncation, greedy) fails here
        self.sampling.check_for_training()
        self.group_size = group_size
        self.val_sampling = SamplingConfig(
            max_new_tokens=val_max_new_tokens or self.sampling.max_new_tokens, greedy=True
        )
        self.eos_ids: list[int] = []
        self.resyncs = 0  # weight pushes after a checkpoint restore (on_train_start)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.eos_ids = eos_token_ids(pl_module.tokenizer, pl_module.policy)
        self.engine.bind(pl_module.policy, pl_module.tokenizer, self.eos_ids)

    def _seed(self, trainer, pl_module, salt: int) -> int:
        # Depends on (seed, step, rank) only: a resumed run samples what the original would.
        return (pl_module.seed * 1_000_003 + pl_module.iteration * 101 + salt) * 31 + (
            trainer.global_rank
        )

    def on_train_start(self, trainer, pl_module) -> None:
        # After a checkpoint restore the policy holds the checkpoint's weights, while an engine
        # with its own copy (vLLM) still holds what it loaded at start-up: push them now, so
        # the first rollout of a resumed run samples from the restored policy.
        if trainer.ckpt_path is not None:
            self.engine.wake_up()
            self.engine.sync_weights(pl_module.policy)
            self.resyncs += 1

    def on_train_batch_start(self, trainer, pl_module, batch: PromptBatch, batch_idx: int) -> None:
        t0 = time.perf_counter()
        self.engine.wake_up()
        batch.rollout = build_rollout(
            self.engine,
            pl_module.tokenizer,
            batch.examples,
            self.group_size,
            self.sampling,
            self._seed(trainer, pl_module, 0),
            self.eos_ids,
        )
        self.engine.sleep()
        pl_module.timings["rollout"] = time.perf_counter() - t0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.engine.wake_up()
        self.engine.sync_weights(pl_module.policy)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        batch.rollout = build_rollout(
            self.engine,
            pl_module.tokenizer,
            batch.examples,
            1,
            self.val_sampling,
            self._seed(trainer, pl_module, 1 + batch_idx),
            self.eos_ids,
        )
