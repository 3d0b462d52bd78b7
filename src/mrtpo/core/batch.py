"""Typed batches that flow through one training step. Shapes in comments.

N = B * G responses (B prompts, G samples each, prompt-major), K rewards, P prompt tokens
(left-padded), T response tokens (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mrtpo.core.sampling import SamplingConfig
from mrtpo.tasks.base import Example, Score


@dataclass
class PromptBatch:
    """What the DataModule yields; the rollout callback fills ``rollout``."""

    examples: list[Example]  # B examples
    index: int = 0  # position of this batch in the data stream (for resume checks)
    rollout: RolloutBatch | None = None
    rollout_info: dict[str, float] | None = None  # the rollout schedule's metrics, idem


@dataclass
class RolloutBatch:
    examples: list[Example]  # N, example of each response (each repeated G times)
    group: Tensor  # [N] long, prompt index within the batch
    prompt_ids: Tensor  # [N, P] long, left-padded sampling prompt P0
    prompt_mask: Tensor  # [N, P] bool
    response_ids: Tensor  # [N, T] long, right-padded sampled tokens
    response_mask: Tensor  # [N, T] bool, valid response tokens (EOS included)
    texts: list[str]  # N decoded responses (special tokens removed)
    finished: Tensor  # [N] bool, stopped at EOS
    # how the responses were sampled; every log-prob of them is taken under this distribution
    sampling: SamplingConfig | None = None
    engine_logp: Tensor | None = None  # [N, T] float32, the engine's log-probs (0 on pads)
    # [N] long: the trainer step whose weights sampled each response (the version the engine
    # held); None: sampled by the trainer's current weights (the sync schedule)
    versions: Tensor | None = None

    @property
    def n(self) -> int:
        return self.response_ids.shape[0]

    @property
    def temperature(self) -> float:
        """The temperature the trainer divides logits by (1 when nothing says otherwise)."""
        return 1.0 if self.sampling is None else self.sampling.logprob_temperature

    def select(self, idx: Tensor) -> RolloutBatch:
        """Sub-batch of responses ``idx`` (a 1-D long tensor)."""
        il = idx.tolist()
        return RolloutBatch(
            examples=[self.examples[i] for i in il],
            group=self.group[idx],
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            response_ids=self.response_ids[idx],
            response_mask=self.response_mask[idx],
            texts=[self.texts[i] for i in il],
            finished=self.finished[idx],
            sampling=self.sampling,
            engine_logp=None if self.engine_logp is None else self.engine_logp[idx],
            versions=None if self.versions is None else self.versions[idx],
        )


@dataclass(frozen=True)
class ScoredBatch:
    """Phase 2 of the step (``mrtpo.step``): the rollout and every response's rewards."""

    rollout: RolloutBatch
    scores: list[Score]  # N
    reward_names: tuple[str, ...]  # K
    rewards: Tensor  # [N, K] float32, NaN = does not apply

    @property
    def mask(self) -> Tensor:
        return self.rollout.response_mask


def rewards_tensor(scores: list[Score], names: tuple[str, ...]) -> Tensor:
    """[N, K] float32 from scores; ``None`` (and missing names) become NaN."""
    out = torch.full((len(scores), len(names)), float("nan"))
    for i, s in enumerate(scores):
        for k, name in enumerate(names):
            v = s.rewards.get(name)
            if v is not None:
                out[i, k] = float(v)
    return out
