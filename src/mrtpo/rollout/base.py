"""The rollout-engine interface: ``generate`` and ``sync_weights``, plus three optional hooks.

Engines take prompts as token ids (the chat template is applied once, by the trainer) and
return the sampled token ids, so that replay and the loss score exactly the tokens that
were sampled — never a re-tokenization of decoded text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from mrtpo.core.sampling import SamplingConfig


@dataclass
class Generation:
    token_ids: list[int]  # sampled response tokens, including the EOS token if it was sampled
    finished: bool  # True when generation stopped at EOS (False: hit max_new_tokens)
    # the engine's log-prob of each sampled token under the distribution it sampled from
    # (softmax(z / temperature)); None when the engine does not report it
    logprobs: list[float] | None = None
    # the version of the weights that sampled it (an engine that counts its weight pushes
    # says which one, the oldest when a push came in mid-response); None: not tracked
    weight_version: int | None = None


class RolloutEngine(ABC):
    """Base class of generation engines: what the rollout callback and evaluation call.
    ``generate`` and ``sync_weights`` are required; the hooks ``bind``, ``wake_up``, ``sleep``
    (give memory back to training) and ``close`` default to doing nothing."""

    #: ``generate`` fills ``Generation.logprobs``; an engine that cannot says False, and
    #: ``rl.tis_cap`` (which needs them) is then refused before anything loads.
    reports_logprobs: ClassVar[bool] = True
    #: the engine holds its own copy of the weights and may generate in another thread
    #: while the trainer updates (rollout.schedule=one_step_off / async need it)
    generates_apart: bool = False
    #: the constructor only stores and checks its settings (no model, process or memory): the
    #: run's validation and ``--check`` build one from the config to run those checks early
    checks_settings_when_built: ClassVar[bool] = False

    def bind(self, model: torch.nn.Module, tokenizer, eos_ids: Sequence[int]) -> None:  # noqa: B027
        """Called once before the first generation."""

    def wake_up(self) -> None:  # noqa: B027
        """Called before generating or syncing weights."""

    def sleep(self) -> None:  # noqa: B027
        """Called after generating, before the training part of the step."""

    def close(self) -> None:  # noqa: B027
        """Release what the engine holds outside this process (a server it started); safe
        to call more than once."""

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        """Sample ``n`` responses per prompt, prompt-major (prompt i's samples at
        ``i*n .. i*n+n-1``), with what ``sampling`` says only (no checkpoint defaults). Fill
        ``Generation.logprobs`` where possible: the trainer compares them with its own
        (``train/rollout/logp_gap``) and ``rl.tis_cap`` corrects with them."""

    @abstractmethod
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine generate with ``model``'s current parameters."""
