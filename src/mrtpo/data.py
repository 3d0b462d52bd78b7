"""DataModule: streams a task's prompts, B per training step, reproducibly and resumably.

The training stream is an endless sequence of seeded permutations of the train split.
Batch ``i`` of the stream depends only on (seed, i), so a run resumed from a checkpoint taken
after step ``n`` continues with batch ``n`` exactly as an uninterrupted run would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from mrtpo.batch import PromptBatch
from mrtpo.tasks.base import Example, Task

log = logging.getLogger(__name__)


class PromptStream(IterableDataset):
    """Endless batches of ``batch_size`` examples, starting at batch ``start``."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int, start: int = 0):
        self.examples, self.batch_size, self.seed, self.start = examples, batch_size, seed, start

    def batch_at(self, i: int) -> PromptBatch:
        n = len(self.examples)
        items = []
        for pos in range(i * self.batch_size, (i + 1) * self.batch_size):
            epoch, off = divmod(pos, n)
            perm = self._perm(epoch)
            items.append(self.examples[int(perm[off])])
        return PromptBatch(examples=items, index=i)

    def _perm(self, epoch: int) -> torch.Tensor:
        cache = getattr(self, "_cache", None)
        if cache is None or cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cache = (epoch, torch.randperm(len(self.examples), generator=g))
        return self._cache[1]

    def __iter__(self) -> Iterator[PromptBatch]:
        i = self.start
        while True:
            yield self.batch_at(i)
            i += 1


class EvalPrompts(torch.utils.data.Dataset):
    def __init__(self, examples: Sequence[Example], batch_size: int):
        self.examples, self.batch_size = examples, batch_size

    def __len__(self) -> int:
        return (len(self.examples) + self.batch_size - 1) // self.batch_size

    def __getitem__(self, i: int) -> PromptBatch:
        return PromptBatch(
            examples=list(self.examples[i * self.batch_size : (i + 1) * self.batch_size]), index=i
        )


def _identity(x):
    return x[0] if isinstance(x, list) and len(x) == 1 else x


class PromptDataModule(L.LightningDataModule):
    def __init__(
        self,
        task: Task,
        prompts_per_step: int = 4,
        seed: int = 0,
        max_prompt_tokens: int | None = 4096,
        val_prompts: int = 0,
        val_batch_size: int = 8,
        tokenizer=None,
    ) -> None:
        super().__init__()
        self.task = task
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.max_prompt_tokens = max_prompt_tokens
        self.val_prompts = val_prompts
        self.val_batch_size = val_batch_size
        self.tokenizer = tokenizer
        self.start_batch = 0  # set by load_state_dict on resume
        self.train_examples: list[Example] | None = None
        self.val_examples: list[Example] = []

    # -- data ---------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_examples is not None:
            return
        train = list(self.task.examples("train"))
        n_loaded = len(train)
        train = self._filter_length(train, "train")
        if not train:
            raise ValueError(
                f"task '{self.task.name}': the train split is empty "
                f"({n_loaded} loaded, {n_loaded - len(train)} dropped by "
                f"data.max_prompt_tokens={self.max_prompt_tokens}); check the task's data paths "
                "and filters"
            )
        self.train_examples = train
        if self.val_prompts > 0:
            val = self._filter_length(list(self.task.examples("val")), "val")
            self.val_examples = val[: self.val_prompts]
        log.info("data: %d train prompts, %d val prompts", len(train), len(self.val_examples))

    def _filter_length(self, examples: list[Example], split: str) -> list[Example]:
        if self.tokenizer is None or not self.max_prompt_tokens:
            return examples
        kept = [e for e in examples if self.prompt_length(e) <= self.max_prompt_tokens]
        if len(kept) < len(examples):
            log.warning(
                "data: dropped %d of %d %s prompts longer than data.max_prompt_tokens=%d",
                len(examples) - len(kept),
                len(examples),
                split,
                self.max_prompt_tokens,
            )
        return kept

    def prompt_length(self, example: Example) -> int:
        from mrtpo.rollout.build import chat_ids

        return len(chat_ids(self.tokenizer, example.messages))

    def train_dataloader(self) -> DataLoader:
        stream = PromptStream(
            self.train_examples, self.prompts_per_step, self.seed, self.start_batch
        )
        return DataLoader(stream, batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_examples:
            return []
        return DataLoader(
            EvalPrompts(self.val_examples, self.val_batch_size), batch_size=None, num_workers=0
        )

    # -- resume ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        module = self.trainer.lightning_module if self.trainer is not None else None
        done = int(getattr(module, "iteration", 0)) if module is not None else 0
        return {"next_batch": done, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            log.warning(
                "resuming with seed=%s, but the checkpoint used %s", self.seed, state["seed"]
            )
        self.start_batch = int(state.get("next_batch", 0))
