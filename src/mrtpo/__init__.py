"""MRTPO: multi-reward RL with reward-specific token credit.

``from mrtpo import Trainer, Config`` is TRL's ``GRPOTrainer`` / ``GRPOConfig`` shape
(``mrtpo.trainer``); ``mrtpo.api`` runs the command line's jobs from override strings.
Both are imported on first use, so ``import mrtpo`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Config", "Trainer"]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "Config"):
        from mrtpo import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'mrtpo' has no attribute {name!r}")
