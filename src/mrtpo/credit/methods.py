"""The advantage-method interface: one signature from a scored batch to token advantages.

Every method — GRPO, GDPO, SAW variants, MRTPO and its ablations — takes a ``CreditInputs``
and returns token advantages ``[N, T]``. The trainer never branches on a method's name: it
asks the method which relevance it needs (``relevance``) and which response–reward pairs
to replay (``replay_pairs``), and hands over whatever replay produced.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor


@dataclass
class CreditInputs:
    rewards: Tensor  # [N, K] float; NaN = reward does not apply to that response
    group: Tensor  # [N] long; responses with the same id were sampled from the same prompt
    mask: Tensor  # [N, T] bool; valid response tokens (EOS included when sampled)
    step: int = 0  # training iteration (0-based), for schedules
    q: Tensor | None = None  # [N, K, T] relevance (per_reward) or [N, 1, T] (joint); None if none
    replayed: Tensor | None = None  # [N, K] / [N, 1] bool; pairs whose q was computed
    process_group: Any = None  # torch.distributed group for global batch statistics
    generator: torch.Generator | None = None  # randomness of the shuffle ablation


@dataclass
class CreditOutput:
    advantages: Tensor  # [N, T] token advantages, 0 on pads
    stats: dict[str, float] = field(default_factory=dict)  # logged under train/adv/...


class AdvantageMethod(ABC):
    """Base class. Subclasses implement ``__call__``; relevance methods set ``relevance``."""

    #: None (no replay), "per_reward" (q [N, K, T]) or "joint" (q [N, 1, T]).
    relevance: ClassVar[str | None] = None

    def setup(self, reward_names: tuple[str, ...], rewards_vary_per_prompt: bool) -> None:
        """Validate the method against a task's reward set (raise a clear config error)."""
        self.reward_names = reward_names

    def replay_pairs(self, rewards: Tensor, group: Tensor, has_block: Tensor) -> Tensor:
        """bool ``[N, K]`` (or ``[N, 1]`` for joint): which pairs replay must score."""
        raise NotImplementedError(f"{type(self).__name__} does not use relevance")

    def beta(self, step: int) -> float:
        """Share of the advantage that follows relevance at ``step`` (0 for uniform methods)."""
        return 0.0

    @abstractmethod
    def __call__(self, inputs: CreditInputs) -> CreditOutput: ...
