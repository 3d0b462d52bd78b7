"""Every use of Lightning's private API in the project, in one place.

Written for Lightning ``WRITTEN_FOR``; ``tests/unit/test_lightning_compat.py`` fails on another
version until these are checked against it.
- ``global_step`` must count RL steps, not the several updates of one (PPO epochs,
  mini-batches), and a skipped step counts without an update: the counting hooks are private.
"""

from __future__ import annotations

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
