"""DataModule: streams a task's prompts, B per training step, reproducibly and resumably.

The stream is endless seeded permutations of the train split, read by *position*. Step ``i``
takes ``B x world_size`` consecutive positions, rank ``r`` the ``r``-th slice of ``B``: whole
prompts per rank (all G samples on one rank), and a 2-rank run with B=2 sees a 1-rank run's
prompts with B=4. A step's prompts depend only on (seed, position), so a resumed run continues
where the uninterrupted one would be, also with another number of ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from mrtpo.core.batch import PromptBatch
from mrtpo.tasks.base import Example, Task

log = logging.getLogger(__name__)


def shard_of(trainer) -> tuple[int, int]:
    """(global rank, world size) of ``trainer``; (0, 1) outside a trainer."""
    if trainer is None:
        return 0, 1
    return int(trainer.global_rank), int(trainer.world_size)


class PromptStream(IterableDataset):
    """Endless batches of ``batch_size`` examples for one rank, from batch ``start`` (its
    stream position ``first_position``, by default ``start * B * world``; ``positions``)."""

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        seed: int,
        start: int = 0,
        *,
        rank: int = 0,
        world_size: int = 1,
        first_position: int | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size} processes")
        self.examples, self.batch_size, self.seed, self.start = examples, batch_size, seed, start
        self.rank, self.world_size = rank, world_size
        self.first_position = (
            start * batch_size * world_size if first_position is None else first_position
        )

    def positions(self, i: int) -> range:
        """Stream positions of batch ``i`` on this rank."""
        lo = (
            self.first_position + ((i - self.start) * self.world_size + self.rank) * self.batch_size
        )
        return range(lo, lo + self.batch_size)

    def batch_at(self, i: int) -> PromptBatch:
        n = len(self.examples)
        items = [self.examples[int(self._perm(p // n)[p % n])] for p in self.positions(i)]
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
        cache_dir=None,
    ) -> None:
        super().__init__()
        self.task, self.tokenizer, self.seed = task, tokenizer, seed
        self.prompts_per_step, self.max_prompt_tokens = prompts_per_step, max_prompt_tokens
        self.val_prompts, self.val_batch_size = val_prompts, val_batch_size
        # prompt token counts kept between jobs (mrtpo.lightning.prompt_cache); None: not kept
        self.cache_dir = cache_dir
        self.tokenized = 0  # prompts this module tokenized (the others came from the cache)
        self.start_batch = 0  # set by load_state_dict on resume
        self.start_position: int | None = None  # first unread stream position on resume
        self.train_examples: list[Example] | None = None
        self.val_examples: list[Example] = []

    # -- data ---------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_examples is not None:
            return
        self.train_examples = train = self._split("train")
        if self.val_prompts > 0:
            val = self._split("val", "; or set data.val_prompts=0")
            self.val_examples = val[: self.val_prompts]
        log.info("data: %d train prompts, %d val prompts", len(train), len(self.val_examples))

    def _split(self, split: str, hint: str = "") -> list[Example]:
        """The split's prompts within the length limit; empty: why (loader or filter)."""
        loaded = list(self.task.examples(split))
        kept = self._filter_length(loaded, split)
        if kept:
            return kept
        if not loaded:
            raise ValueError(
                f"task '{self.task.name}': the {split} split is empty: the task loaded no "
                f"examples (its data files, or its own filters, e.g. references that fail to "
                f"execute, removed them all); check the task.* data paths and options{hint}"
            )
        raise ValueError(
            f"task '{self.task.name}': the {split} split is empty after filtering: the task "
            f"loaded {len(loaded)} examples and the prompt-length filter removed all "
            f"{len(loaded)} (longer than data.max_prompt_tokens={self.max_prompt_tokens} "
            f"tokens); raise data.max_prompt_tokens{hint}"
        )

    def _filter_length(self, examples: list[Example], split: str) -> list[Example]:
        if self.tokenizer is None or not self.max_prompt_tokens:
            return examples
        lengths = self.prompt_lengths(examples, what=f"{split} prompts")
        kept = [e for e, n in zip(examples, lengths, strict=True) if n <= self.max_prompt_tokens]
        if len(kept) < len(examples):
            log.warning(
                "data: dropped %d of %d %s prompts longer than data.max_prompt_tokens=%d",
                len(examples) - len(kept),
                len(examples),
                split,
                self.max_prompt_tokens,
            )
        return kept

    def prompt_lengths(
        self, examples: list[Example], chunk: int = 1024, what: str = "prompts"
    ) -> list[int]:
        """Token counts of the sampling prompts, in batches (thousands of long SQL schemas take
        minutes one by one); an earlier job's counts come from the cache."""
        from mrtpo.lightning.prompt_cache import cached_lengths

        def count(messages: list) -> list[int]:
            texts = [
                self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                for m in messages
            ]
            return [
                len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            ]

        lengths, done = cached_lengths(
            [e.messages for e in examples], count, self.tokenizer, self.cache_dir, what, chunk
        )
        self.tokenized += done
        return lengths

    def train_stream(self) -> PromptStream:
        """This rank's stream (its own ``prompts_per_step`` prompts of every step)."""
        rank, world = shard_of(self.trainer)
        args = (self.train_examples, self.prompts_per_step, self.seed, self.start_batch)
        return PromptStream(*args, rank=rank, world_size=world, first_position=self.start_position)

    def train_dataloader(self) -> DataLoader:
        # An IterableDataset: Lightning adds no DistributedSampler; the stream shards itself.
        return DataLoader(self.train_stream(), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_examples:
            return []
        b, val = self.val_batch_size, self.val_examples
        batches = [
            PromptBatch(val[s : s + b], index=i) for i, s in enumerate(range(0, len(val), b))
        ]
        return DataLoader(batches, batch_size=None, num_workers=0)

    # -- resume ---------------------------------------------------------------------------
    def next_position(self, done: int) -> int:
        """First stream position not consumed after ``done`` steps (all ranks together)."""
        rank, _ = shard_of(self.trainer)
        return self.train_stream().positions(done).start - rank * self.prompts_per_step

    def state_dict(self) -> dict:
        module = self.trainer.lightning_module if self.trainer is not None else None
        done = int(getattr(module, "iteration", 0))  # 0 outside a trainer
        _, world = shard_of(self.trainer)
        return {
            "next_batch": done,
            "next_position": self.next_position(done),
            "seed": self.seed,
            "world_size": world,
            "prompts_per_step": self.prompts_per_step,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            log.warning(
                "resuming with seed=%s, but the checkpoint used %s", self.seed, state["seed"]
            )
        self.start_batch = int(state.get("next_batch", 0))
        self.start_position = state.get("next_position")
        _, world = shard_of(self.trainer)
        old = (state.get("world_size", world), state.get("prompts_per_step", self.prompts_per_step))
        if old != (world, self.prompts_per_step):
            log.warning(
                "resuming with %d process(es) x rl.prompts_per_step=%d prompts per step; the "
                "checkpoint was written by %d x %d. The data stream continues at prompt %s.",
                world,
                self.prompts_per_step,
                old[0],
                old[1],
                self.start_position,
            )
