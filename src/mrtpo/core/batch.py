"""Typed batches that flow through one training step. Shapes in comments.

N = B * G responses (B prompts, G samples each, prompt-major), K rewards, P prompt tokens
(left-padded), T response tokens (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
        """The temperature the trainer divides logits by: the sampling one (1 for greedy or none)."""
        greedy = self.sampling is None or self.sampling.greedy
        return 1.0 if greedy else float(self.sampling.temperature)

    def select(self, idx: Tensor) -> RolloutBatch:
        """Sub-batch of responses ``idx`` (a 1-D long tensor)."""
        il = idx.tolist()

        def pick(value):  # per-response lists and tensors; ``sampling`` and Nones as they are
            if isinstance(value, list):
                return [value[i] for i in il]
            return value[idx] if isinstance(value, Tensor) else value

        return RolloutBatch(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})


@dataclass(frozen=True)
class ScoredBatch:
    """Phase 2 of the step (``mrtpo.step``): the rollout and every response's rewards."""

    rollout: RolloutBatch
    scores: list[Score]  # N
    reward_names: tuple[str, ...]  # K
    rewards: Tensor  # [N, K] float32, NaN = does not apply


def rewards_tensor(scores: list[Score], names: tuple[str, ...]) -> Tensor:
    """[N, K] float32 from scores; ``None`` (and missing names) become NaN."""
    out = torch.full((len(scores), len(names)), float("nan"))
    for i, s in enumerate(scores):
        for k, name in enumerate(names):
            v = s.rewards.get(name)
            if v is not None:
                out[i, k] = float(v)
    return out
