"""Where a step's rollout comes from: an engine, the sampling settings, the seed rule and the
schedule that decides when each batch is generated (docs/rollout.md, "Schedules": ``sync``,
``one_step_off``, ``async``, and how a resumed run takes the batches a checkpoint kept).

``RolloutSource.take`` is the step's phase 1 (``mrtpo.step``): G responses for each of B
prompts, drawn with a seed that depends only on (run seed, step, rank, salt), so a resumed
run samples what the original would have. Each batch carries the version of the weights that
sampled it (``RolloutBatch.versions``), which the loss corrects for (docs/method.md, "Stale
samples"). No Lightning here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mrtpo.core.batch import RolloutBatch
from mrtpo.core.chat import prompt_ids
from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig
from mrtpo.rollout.build import assemble, build_rollout
from mrtpo.tasks.base import Example

log = logging.getLogger(__name__)

SCHEDULES = ("sync", "one_step_off", "async")

#: what a schedule needs to know about a future batch: (its examples, its seed)
Lookahead = Callable[[int], tuple[Sequence[Example], int]]


#: The most weight versions an ``async`` sample may lag behind (``rollout.max_staleness``):
#: async keeps that many batches generated ahead, each from weights older than the last.
#: Past a few versions the stale-sample correction has little left to correct with.
MAX_STALENESS = 16


def check_schedule(
    schedule: str, max_staleness: Any, engine: Any = None, apart: bool | None = None
) -> None:
    """The one rule of ``rollout.schedule``, ``rollout.max_staleness`` and the engine they
    need (``generates_apart``, ``reports_logprobs``), raising ValueError naming the key: the
    run checks the config before anything loads (``engine`` a class, ``apart`` from its
    settings), ``RolloutSource`` the bound engine."""
    whole = isinstance(max_staleness, int) and not isinstance(max_staleness, bool)
    if not (whole and max_staleness <= MAX_STALENESS):
        raise ValueError(
            f"rollout.max_staleness={max_staleness!r} is not allowed: an integer from 1 to "
            f"{MAX_STALENESS} (how many weight versions a sample may lag behind the trainer; "
            "async keeps that many batches generated ahead)"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"rollout.schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    if schedule == "async" and max_staleness < 1:
        raise ValueError(
            f"rollout.max_staleness={max_staleness}: async needs 1 or more (the number of "
            "weight versions a sample may lag behind the trainer); use schedule=sync for 0"
        )
    if schedule == "sync" or engine is None:
        return
    name = engine.__name__ if isinstance(engine, type) else type(engine).__name__
    if not (getattr(engine, "generates_apart", False) if apart is None else apart):
        raise ValueError(
            f"rollout.schedule={schedule} generates while the trainer updates, and {name} "
            "samples from the trainer's own weights or process: use rollout=vllm_server, or "
            "rollout=hf with rollout.engine.own_copy=true, or rollout.schedule=sync"
        )
    if not getattr(engine, "reports_logprobs", True):
        raise ValueError(
            f"rollout.schedule={schedule} corrects the loss with the engine's sampling "
            f"log-probs, which {name} does not report; use rollout.schedule=sync"
        )


@dataclass
class _Ahead:
    """A batch generated (or being generated) ahead of its step."""

    index: int
    seed: int
    examples: list[Example]
    prompts: list[list[int]]
    future: Future  # -> (version, seconds, generations)


class RolloutSource:
    """Samples rollouts from ``engine`` (training: G samples; validation: one greedy)."""

    def __init__(
        self,
        engine: RolloutEngine,
        sampling: SamplingConfig,
        group_size: int,
        val_sampling: SamplingConfig,
        schedule: str = "sync",
        max_staleness: int = 1,
    ) -> None:
        check_schedule(schedule, max_staleness)
        self.engine, self.sampling, self.group_size = engine, sampling, group_size
        self.val_sampling = val_sampling
        self.schedule, self.max_staleness = schedule, int(max_staleness)
        self.tokenizer = None
        self.eos_ids: list[int] = []
        self.seconds = 0.0  # the last training rollout's wait (the whole generation under sync)
        self.generate_seconds = 0.0  # the last training rollout's own generation time
        self.version = 0  # the trainer step whose weights the engine holds
        self.dropped = 0  # samples generated again for exceeding max_staleness
        self.push_seconds = 0.0  # the last weight push's
        self.rank = 0  # this process's rank: the batches it keeps in a checkpoint are its own
        self._ahead: dict[int, _Ahead] = {}
        self._restored: dict[int, dict[str, Any]] = {}  # this rank's kept batches
        self._restored_ranks: dict[int, list[int]] = {}  # index -> ranks that kept one
        self._lock = threading.Lock()  # held by a generation and by a push
        self._pool: ThreadPoolExecutor | None = None

    @property
    def depth(self) -> int:
        """How many batches are generated ahead of the trainer."""
        return {"sync": 0, "one_step_off": 1}.get(self.schedule, self.max_staleness)

    def bind(self, policy, tokenizer, eos_ids: list[int]) -> None:
        self.tokenizer, self.eos_ids = tokenizer, list(eos_ids)
        self.engine.bind(policy, tokenizer, self.eos_ids)
        check_schedule(self.schedule, self.max_staleness, self.engine)

    @staticmethod
    def seed(run_seed: int, iteration: int, rank: int, salt: int = 0) -> int:
        """Depends on (seed, step, rank, salt) only: a resumed run samples what the original
        would. Salt 0 is training; validation batch ``i`` uses ``1 + i``."""
        return (run_seed * 1_000_003 + iteration * 101 + salt) * 31 + rank

    # -- training rollouts ---------------------------------------------------------------

    def sample(self, examples: Sequence[Example], seed: int) -> RolloutBatch:
        """G responses for each example, now (the engine woken for it and put to sleep
        after); the sync schedule's rollout."""
        t0 = time.perf_counter()
        prompts = [prompt_ids(self.tokenizer, e) for e in examples]
        roll = self._assemble(examples, prompts, self._generate(prompts, seed)[2])
        self.seconds = self.generate_seconds = time.perf_counter() - t0
        return roll

    def take(
        self, index: int, examples: Sequence[Example], seed: int, ahead: Lookahead | None = None
    ) -> RolloutBatch:
        """Batch ``index``'s rollout under the schedule: from the worker when it was
        generated ahead, else now; then the next batches go to the worker (``ahead(j)``
        gives batch j's examples and seed)."""
        if not self.depth:
            return self.sample(examples, seed)
        t0 = time.perf_counter()
        version, gen_s, gens, prompts = self._ready(index, examples, seed)
        if self.version - version > self.depth:  # only after a restore (depth: the bound)
            self.dropped += len(gens)
            version, gen_s, gens = self._generate(prompts, seed)
        for j in range(index + 1, index + 1 + self.depth):
            if ahead is not None and j not in self._ahead:
                self._submit(j, *ahead(j))
        self.seconds, self.generate_seconds = time.perf_counter() - t0, gen_s
        return self._assemble(examples, prompts, gens, version)

    def _assemble(self, examples, prompts, gens, version: int | None = None) -> RolloutBatch:
        """The batch of ``gens``; ``version`` None: sampled by the weights of this step."""
        args = (self.group_size, self.sampling, self.eos_ids, version)
        return assemble(self.tokenizer, list(examples), prompts, gens, *args)

    def _ready(self, index: int, examples: Sequence[Example], seed: int):
        """(version, seconds, generations, prompt ids) of batch ``index``."""
        stale = [j for j in self._ahead if j < index]
        for j in stale:  # batches that will never be asked for (a restart elsewhere)
            self._ahead.pop(j).future.cancel()
        got = self._ahead.pop(index, None)
        if got is not None:
            if got.seed != seed or [e.id for e in got.examples] != [e.id for e in examples]:
                raise RuntimeError(
                    f"the rollout generated ahead for batch {index} has other prompts or "
                    "another seed than the step's: the data stream and the lookahead disagree"
                )
            return (*got.future.result(), got.prompts)
        prompts = [prompt_ids(self.tokenizer, e) for e in examples]
        kept = self._kept(index, seed, examples)
        return (*(kept or self._generate(prompts, seed)), prompts)

    def _submit(self, index: int, examples: Sequence[Example], seed: int) -> None:
        """Batch ``index`` to the worker; its prompts are tokenized here, in this thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mrtpo-rollout")
        examples = list(examples)
        prompts = [prompt_ids(self.tokenizer, e) for e in examples]
        kept = self._kept(index, seed, examples)
        if kept is not None:
            future: Future = Future()
            future.set_result(kept)
        else:
            future = self._pool.submit(self._generate, prompts, seed)
        self._ahead[index] = _Ahead(index, seed, examples, prompts, future)

    def _kept(self, index: int, seed: int, examples: Sequence[Example]):
        """(version, seconds, generations) of batch ``index`` as a checkpoint kept it for
        this rank with this seed and these prompts, or None (the batch is generated)."""
        saved = self._restored.pop(index, None)
        others = self._restored_ranks.pop(index, [])
        if saved is None:
            why = (
                others and f"for rank {', '.join(map(str, others))} only, not for rank {self.rank}"
            )
        elif saved["seed"] != seed:
            why = f"on rank {self.rank} with another seed"
        elif (ids := saved.get("ids")) != [e.id for e in examples]:
            why = (
                "without its prompt ids (an older checkpoint)"
                if ids is None
                else f"on rank {self.rank} for other prompts than this rank draws now "
                f"({len(ids)} kept, {len(examples)} now: another number of processes?)"
            )
        else:
            gens = [Generation(**g) for g in saved["generations"]]
            return saved["version"], float(saved.get("seconds", 0.0)), gens
        if why:
            log.info("rollout: batch %d kept by the checkpoint was drawn %s: generating it again",
                     index, why)  # fmt: skip
        return None

    def _generate(self, prompts: list[list[int]], seed: int):
        """(version, seconds, generations): one batch, holding the engine."""
        with self._lock:
            t0 = time.perf_counter()
            version = self.version
            self.engine.wake_up()
            gens = self.engine.generate(prompts, self.group_size, self.sampling, seed)
            self.engine.sleep()
            return version, time.perf_counter() - t0, gens

    # -- weights ------------------------------------------------------------------------

    def push_weights(self, policy, version: int | None = None) -> None:
        """The policy's current weights into the engine (a no-op for engines that share
        them); ``version``: the trainer step they belong to. Under ``one_step_off`` the
        batches generated ahead are finished first: they belong to the weights before."""
        if self.schedule == "one_step_off":
            for got in self._ahead.values():
                got.future.result()
        t0 = time.perf_counter()
        with self._lock:
            self.engine.wake_up()
            self.engine.sync_weights(policy)
            if version is not None:
                self.version = int(version)
        self.push_seconds = time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """The schedule's counters for the step's metrics (``train/rollout/...``)."""
        if not self.depth:
            return {}
        return {
            "rollout/dropped": float(self.dropped),
            "rollout/generate_s": self.generate_seconds,
            "rollout/push_s": self.push_seconds,
        }

    # -- validation ------------------------------------------------------------------------

    def sample_validation(self, examples: Sequence[Example], seed: int) -> RolloutBatch:
        """One greedy response for each example (after any generation in flight)."""
        with self._lock:
            return build_rollout(
                self.engine,
                self.tokenizer,
                list(examples),
                1,
                self.val_sampling,
                seed,
                self.eos_ids,
            )

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The batches generated ahead, finished (a resumed run takes them as the original
        would have: under ``one_step_off`` they came from weights the checkpoint no longer
        holds). Plain lists and numbers: a weights-only checkpoint reads them."""
        ahead = []
        for got in sorted(self._ahead.values(), key=lambda a: a.index):
            version, seconds, gens = got.future.result()
            ahead.append(
                {
                    "index": got.index,
                    "rank": self.rank,
                    "ids": [e.id for e in got.examples],
                    "seed": got.seed,
                    "version": int(version),
                    "seconds": float(seconds),
                    "generations": [_plain(g) for g in gens],
                }
            )
        return {"schedule": self.schedule, "version": self.version, "ahead": ahead}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state_dict``'s batches of this rank (``self.rank``); a batch saved
        without a rank (an older, rank-0-only checkpoint) counts as rank 0's."""
        self.version = int(state.get("version", self.version))
        self._restored, self._restored_ranks = {}, {}
        for a in state.get("ahead", []):
            index, rank = int(a["index"]), int(a.get("rank", 0))
            if rank == self.rank:
                self._restored[index] = a
            else:
                self._restored_ranks.setdefault(index, []).append(rank)

    def close(self, wait: bool = True) -> None:
        """Stop the worker: queued batches are cancelled, one in flight finishes (``wait``:
        before this returns)."""
        for got in self._ahead.values():
            got.future.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None


def _plain(g: Generation) -> dict[str, Any]:
    return {
        "token_ids": [int(t) for t in g.token_ids],
        "finished": bool(g.finished),
        "logprobs": None if g.logprobs is None else [float(x) for x in g.logprobs],
        "weight_version": g.weight_version,
    }
