"""Resume in place: a resumed run continues its run folder's ``metrics.csv`` from the restored
step, without duplicates (``RunCSVLogger``; docs/reliability.md), and every checkpoint keeps the
run's settings (so ``+resume`` can refuse changes) and the metric names logged so far.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L

from mrtpo.run.loggers import KeepingWriter, RunCSVLogger
from mrtpo.run.resume import SETTINGS_KEY

log = logging.getLogger(__name__)

#: Where a checkpoint keeps the metric names the run has logged so far: a resumed run writes
#: NaN for those a step does not log, as the uninterrupted run does (``AbsentAsNaN``).
LOGGED_KEY = "mrtpo_logged_metrics"


def _logged(pl_module):
    """The module's ``AbsentAsNaN`` record of the metrics logged so far, if it has one."""
    return getattr(getattr(pl_module, "step", None), "absent_as_nan", None)


class ResumeMetrics(L.Callback):
    """Starts a resumed run's ``metrics.csv`` at the restored step; saves ``settings``, the
    run's settings record, into each checkpoint (None: nothing saved)."""

    def __init__(self, settings: str | None = None) -> None:
        self.settings = settings

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.settings is not None:
            checkpoint[SETTINGS_KEY] = self.settings
        logged = _logged(pl_module)
        if logged is not None:
            checkpoint[LOGGED_KEY] = sorted(logged.seen)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        logged = _logged(pl_module)
        if logged is not None:
            logged.seen |= set(checkpoint.get(LOGGED_KEY) or ())

    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        # The first step the resumed run logs: the restored global step (an RL step counts
        # one optimizer step, skipped steps included; see PolicyModule).
        start = int(trainer.global_step) if trainer.ckpt_path is not None else 0
        for lg in trainer.loggers:
            writer = lg.experiment if isinstance(lg, RunCSVLogger) else None
            if not isinstance(writer, KeepingWriter) or writer.start_step is not None:
                continue
            writer.start_step = start
            writer.save()  # rows logged before training started, if any
            log.info(
                "resume: %s continues at step %d; its rows of earlier steps are kept and "
                "those of steps >= %d (logged after the checkpoint) are replaced as the "
                "steps run again",
                Path(writer.metrics_file_path),
                start,
                start,
            )
