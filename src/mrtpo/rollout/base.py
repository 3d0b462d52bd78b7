"""The rollout-engine interface: ``generate`` and ``sync_weights``, plus three optional hooks.

Engines take prompts as token ids (the chat template is applied once, by the trainer) and
return the sampled token ids, so that replay and the loss score exactly the tokens that
were sampled — never a re-tokenization of decoded text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SamplingConfig:
    """``rollout.sampling``: how responses are sampled."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    greedy: bool = False

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, allowed: str) -> None:
            if not ok:
                raise ValueError(
                    f"rollout.sampling.{key}={getattr(self, key)!r} is not allowed: {allowed}"
                )

        need(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            "max_new_tokens",
            "an integer >= 1",
        )
        need(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0,
            "temperature",
            ">= 0",
        )
        need(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")


@dataclass
class Generation:
    token_ids: list[int]  # sampled response tokens, including the EOS token if it was sampled
    finished: bool  # True when generation stopped at EOS (False: hit max_new_tokens)


class RolloutEngine(ABC):
    """Base class of generation engines: what the rollout callback and evaluation call.

    ``generate`` and ``sync_weights`` are required. ``bind`` (called once, before the first
    generation, with the policy, tokenizer and EOS ids), ``wake_up`` (before generating or
    syncing) and ``sleep`` (after generating, to give memory back to training) default to
    doing nothing; a colocated engine such as vLLM uses them.
    """

    def bind(self, model: torch.nn.Module, tokenizer, eos_ids: Sequence[int]) -> None:  # noqa: B027
        """Called once before the first generation."""

    def wake_up(self) -> None:  # noqa: B027
        """Called before generating or syncing weights."""

    def sleep(self) -> None:  # noqa: B027
        """Called after generating, before the training part of the step."""

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        """Sample ``n`` responses per prompt. Output is prompt-major: prompt i's samples are
        at ``i*n .. i*n+n-1``."""

    @abstractmethod
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine generate with ``model``'s current parameters."""
