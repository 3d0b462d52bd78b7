"""Every use of Lightning's private API in the project, in one place.

Written for the Lightning version in ``WRITTEN_FOR``; ``tests/unit/test_lightning_compat.py``
fails on another version until these are checked against it (and the constant raised).

- An RL step may run several optimizer updates (PPO epochs, mini-batches), but
  ``trainer.global_step`` must count RL steps (``trainer.max_steps``, checkpoint intervals
  and the metrics' step column are in RL steps). Lightning's manual optimization counts
  every ``optimizer.step()``; the hooks that count it are private.
- A skipped (non-finite) step counts without an optimizer update: the same hooks.
- The step's metrics go to the loggers in one call, where Lightning writes what ``self.log``
  collected (``self.log`` of ~50 keys a step cost more than the rest of the logging); the
  rows Lightning would write (``trainer.log_every_n_steps``) are decided by its private
  logger connector.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

WRITTEN_FOR = "2.6"


def step_without_counting(optimizer) -> None:
    """``optimizer.step()`` through Lightning's wrapper (precision, strategy) without
    advancing ``global_step``."""
    before, after = optimizer._on_before_step, optimizer._on_after_step
    optimizer._on_before_step = optimizer._on_after_step = lambda: None
    try:
        optimizer.step()
    finally:
        optimizer._on_before_step, optimizer._on_after_step = before, after


def count_step(optimizer) -> None:
    """Advance ``global_step`` by one without an optimizer update."""
    optimizer._on_before_step()
    optimizer._on_after_step()


def log_now(trainer, metrics: Mapping[str, torch.Tensor]) -> None:
    """``metrics`` to every logger, on the rows ``trainer.log_every_n_steps`` selects, with
    the step number and ``epoch`` Lightning's own logging would give them."""
    connector = trainer._logger_connector
    if metrics and (connector.should_update_logs or trainer.fast_dev_run):
        connector.log_metrics(dict(metrics))
