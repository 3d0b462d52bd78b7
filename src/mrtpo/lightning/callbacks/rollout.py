"""The rollout callback: hands each step its rollout, pushes the weights after the update.

It holds no step logic: sampling (engine, settings, seed rule) is ``RolloutSource``'s
(``mrtpo.rollout.source``), the step is ``mrtpo.step.RLStep``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning as L

from mrtpo.core.batch import PromptBatch
from mrtpo.core.models import eos_token_ids
from mrtpo.distributed import Ranks
from mrtpo.rollout.base import RolloutEngine, SamplingConfig
from mrtpo.rollout.source import RolloutSource


class RolloutCallback(L.Callback):
    """Fills ``batch.rollout`` with G samples per prompt (greedy, 1 for validation); it
    carries ``sampling``, whose temperature the trainer's log-probs use."""

    def __init__(
        self,
        engine: RolloutEngine,
        sampling: Mapping | None = None,
        group_size: int = 4,
        val_max_new_tokens: int | None = None,
        schedule: str = "sync",
        max_staleness: int = 1,
    ) -> None:
        train = SamplingConfig(**dict(sampling or {}))
        # what the trainer's log-probs cannot reproduce (truncation, greedy) fails here
        train.check_for_training()
        val = SamplingConfig(max_new_tokens=val_max_new_tokens or train.max_new_tokens, greedy=True)
        self.source = RolloutSource(engine, train, group_size, val, schedule, max_staleness)
        self.resyncs = 0  # weight pushes after a checkpoint restore (on_train_start)
        self._stream = None  # the data stream, for the batches a schedule generates ahead
        self._owns_engine = True  # built with it: closed at the end of each fit (teardown)

    # the source's parts, as subclasses (benchmark harnesses) and tests read them
    @property
    def engine(self) -> RolloutEngine:
        return self.source.engine

    @engine.setter
    def engine(self, engine: RolloutEngine) -> None:
        self.source.engine = engine
        self._owns_engine = False  # handed in: whoever handed it in closes it

    @property
    def sampling(self) -> SamplingConfig:
        return self.source.sampling

    @property
    def group_size(self) -> int:
        return self.source.group_size

    @property
    def eos_ids(self) -> list[int]:
        return self.source.eos_ids

    def setup(self, trainer, pl_module, stage: str) -> None:
        eos = eos_token_ids(pl_module.tokenizer, pl_module.policy)
        self.source.bind(pl_module.policy, pl_module.tokenizer, eos)
        self.source.rank = trainer.global_rank  # before a checkpoint's state is restored

    def _seed(self, trainer, pl_module, salt: int) -> int:
        return RolloutSource.seed(pl_module.seed, pl_module.iteration, trainer.global_rank, salt)

    def on_train_start(self, trainer, pl_module) -> None:
        # After a checkpoint restore the policy holds the checkpoint's weights, while an engine
        # with its own copy (vLLM) still holds what it loaded at start-up: push them now, so
        # the first rollout of a resumed run samples from the restored policy.
        self.source.version = pl_module.iteration
        if trainer.ckpt_path is not None:
            self.source.push_weights(pl_module.policy, pl_module.iteration)
            self.resyncs += 1
        if self.source.depth:
            stream = getattr(trainer.datamodule, "train_stream", None)
            if stream is None:
                raise ValueError(
                    f"rollout.schedule={self.source.schedule} reads the prompts of the next "
                    "steps from the DataModule's train_stream(); train with PromptDataModule, "
                    "or use rollout.schedule=sync"
                )
            self._stream = stream()

    def on_train_batch_start(self, trainer, pl_module, batch: PromptBatch, batch_idx: int) -> None:
        step, index = pl_module.iteration, batch.index

        def ahead(j: int):
            seed = RolloutSource.seed(pl_module.seed, step + j - index, trainer.global_rank, 0)
            return self._stream.batch_at(j).examples, seed

        seed = self._seed(trainer, pl_module, 0)
        batch.rollout = self.source.take(index, batch.examples, seed, ahead)
        pl_module.timings["rollout"] = self.source.seconds
        batch.rollout_info = self.source.metrics()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.source.push_weights(pl_module.policy, pl_module.iteration)

    def on_train_end(self, trainer, pl_module) -> None:
        self.source.close()  # the worker; the engine closes at teardown

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.source.close(wait=False)
        self._close_engine()  # Lightning calls no teardown hook after an exception

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close_engine()

    def _close_engine(self) -> None:
        """Stop what the engine holds outside this process (a started server, its weight
        snapshots): a sweep of jobs in one process keeps none of them. Idempotent."""
        if self._owns_engine:
            self.engine.close()

    def state_dict(self) -> dict:
        """The source's state with every rank's batches generated ahead, gathered here:
        Lightning saves rank 0's state only but calls this on every rank."""
        if not self.source.depth:
            return {}
        state = self.source.state_dict()
        parts = Ranks().gather(state["ahead"])
        return state | {"ahead": [a for part in parts for a in part], "world_size": len(parts)}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            self.source.load_state_dict(state_dict)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        seed = self._seed(trainer, pl_module, 1 + batch_idx)
        batch.rollout = self.source.sample_validation(batch.examples, seed)
