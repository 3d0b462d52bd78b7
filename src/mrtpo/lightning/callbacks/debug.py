"""Debug dumps of what each rank computed, for checking distributed runs against one process.

Enable on the command line (it is in no default callback set):

    python src/train.py trainer=ddp +callbacks.batch_dump._target_=mrtpo.lightning.callbacks.debug.BatchDump

Each rank writes ``<run folder>/<dirname>/step<NNNNNN>_rank<R>.pt`` (rewards, groups, masks,
relevance, advantages); the ranks' files concatenated, group ids offset per rank (they are
local), give the global batch for one process to recompute the advantages.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


class BatchDump(L.Callback):
    """Writes each rank's scored batch (tensors only, small) to the run folder."""

    def __init__(self, dirname: str = "debug", every: int = 1) -> None:
        self.dirname, self.every = dirname, every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scored = pl_module.last  # None when the step was skipped
        step = pl_module.iteration - 1
        if scored is None or self.every <= 0 or step % self.every != 0:
            return
        roll = scored.rollout
        out = Path(trainer.default_root_dir) / self.dirname
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "step": step,
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "ids": [e.id for e in roll.examples],
            "rewards": scored.rewards,
            "group": roll.group,
            "mask": roll.response_mask,
            "response_ids": roll.response_ids,
            "q": scored.q,
            "replayed": scored.replayed,
            "advantages": scored.advantages,
            "beta": scored.beta,
            "stats": dict(scored.stats),
        }
        torch.save(record, out / f"step{step:06d}_rank{trainer.global_rank}.pt")
