"""The command line of ``src/eval.py``, an entry point's module that library code never imports.

The evaluation is ``mrtpo.evaluate.job.run``; eval's config resolvers are registered by
``mrtpo.run.config`` and ``mrtpo.run.cli``.
"""

from __future__ import annotations

from omegaconf import DictConfig

from mrtpo.run.cli import run_job


def main_job(cfg: DictConfig) -> dict[str, float]:
    """``src/eval.py``'s job: a bad setting, missing data or a model that cannot load ends it
    with the message alone (``mrtpo.run.cli.run_job``; the traceback goes to the run's log file)."""
    from mrtpo.evaluate.job import run

    return run_job(run, cfg)
