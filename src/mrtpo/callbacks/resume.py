"""Resume in place: a resumed run continues its run folder's ``metrics.csv``, without duplicates.

Lightning's CSV logger deletes an existing ``metrics.csv`` when it starts, so a run resumed
in its own folder (``+resume=<run folder>``) would lose the history before the crash; and a
run killed after its last checkpoint has logged steps that the resumed run computes again.
This callback reads the old file before the logger starts, and when training starts (after
the checkpoint is restored) writes back the rows of the steps before the restored step only.
Steps at or after it were lost with the crash and are logged again by the resumed run, so
every step appears once.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import lightning as L

log = logging.getLogger(__name__)


def _csv_loggers(trainer) -> list:
    return [lg for lg in trainer.loggers if type(lg).__name__ == "CSVLogger"]


def _step(row: dict[str, str]) -> int | None:
    try:
        return int(float(row.get("step", "")))
    except ValueError:
        return None


class ResumeMetrics(L.Callback):
    """Keeps a resumed run's earlier metric rows (steps before the checkpoint) in its CSV.

    ``loggers`` are read when the callback is built, i.e. before ``trainer.fit`` (Lightning
    creates the CSV writer, which deletes the file, before any callback hook runs).
    """

    def __init__(self, loggers: list | None = None, resuming: bool = False) -> None:
        self._old: dict[int, tuple[list[str], list[dict[str, str]]]] = {}
        self._raw: dict[int, bytes] = {}  # the files as they were, restored byte for byte
        self.kept = self.dropped = 0
        if not resuming:
            return
        for i, lg in enumerate(lg for lg in loggers or [] if type(lg).__name__ == "CSVLogger"):
            path = Path(lg.log_dir) / "metrics.csv"
            if path.is_file():
                self._raw[i] = path.read_bytes()
                with open(path, newline="") as f:
                    reader = csv.DictReader(f)
                    self._old[i] = (list(reader.fieldnames or []), list(reader))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A resume that fails before training starts (the checkpoint cannot be restored, the
        model does not match) must not cost the folder its metrics: Lightning's CSV logger has
        already removed ``metrics.csv`` when its writer was created, so write it back."""
        if not self._old or not trainer.is_global_zero:
            return
        for i, lg in enumerate(_csv_loggers(trainer)):
            if i not in self._old:
                continue
            self._old.pop(i)
            path = Path(lg.log_dir) / "metrics.csv"
            path.write_bytes(self._raw[i])
            rows = self._raw[i].count(b"\n") - 1
            log.warning("resume failed before training: %s restored (%d rows)", path, rows)

    def on_train_start(self, trainer, pl_module) -> None:
        if not self._old or trainer.ckpt_path is None or not trainer.is_global_zero:
            return
        # The first step the resumed run logs: the restored global step (an RL step counts
        # one optimizer step, skipped steps included; see PolicyModule).
        start = int(trainer.global_step)
        for i, lg in enumerate(_csv_loggers(trainer)):
            if i not in self._old:
                continue
            fields, rows = self._old.pop(i)
            keep = [r for r in rows if (s := _step(r)) is not None and s < start]
            self.kept += len(keep)
            self.dropped += len(rows) - len(keep)
            writer = lg.experiment
            path = Path(writer.metrics_file_path)
            pending = writer.metrics  # rows logged before training started (none for RL)
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields)
                w.writeheader()
                w.writerows(keep)
            writer.metrics_keys = list(fields)
            writer.metrics = pending
            log.info(
                "resume: %s keeps %d rows of steps < %d; %d rows of steps >= %d were logged "
                "after the checkpoint and are computed again",
                path,
                len(keep),
                start,
                len(rows) - len(keep),
                start,
            )
