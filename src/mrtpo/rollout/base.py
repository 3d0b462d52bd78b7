"""The rollout-engine protocol: ``generate`` and ``sync_weights``, nothing else.

Engines take prompts as token ids (the chat template is applied once, by the trainer) and
return the sampled token ids, so that replay and the loss score exactly the tokens that
were sampled — never a re-tokenization of decoded text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    greedy: bool = False


@dataclass
class Generation:
    token_ids: list[int]  # sampled response tokens, including the EOS token if it was sampled
    finished: bool  # True when generation stopped at EOS (False: hit max_new_tokens)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        """Sample ``n`` responses per prompt. Output is prompt-major: prompt i's samples are
        at ``i*n .. i*n+n-1``."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine generate with ``model``'s current parameters."""
        ...
