"""The command line of ``src/eval.py``: its job, which ends a bad value, missing data or a
model that cannot load with one line.

This is an entry point's module: library code never imports it. The evaluation itself is
``mrtpo.evaluate.job.run``, the training run behind a checkpoint ``mrtpo.run.trained_run``; the
resolvers eval's configs use are registered by ``mrtpo.run.config`` (the run folder's name and
``.hydra`` folder) and ``mrtpo.run.cli`` (the groups its ``--help`` lists).
"""

from __future__ import annotations

from omegaconf import DictConfig

from mrtpo.run.cli import run_job


def main_job(cfg: DictConfig) -> dict[str, float]:
    """``src/eval.py``'s job: a bad setting, missing data or a model that cannot load ends it
    with the message alone (``mrtpo.run.cli.run_job``; the traceback goes to the run's log file)."""
    from mrtpo.evaluate.job import run

    return run_job(run, cfg)
