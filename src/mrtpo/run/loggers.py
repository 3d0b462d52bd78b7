"""Checking that every configured logger can be built, before anything heavy is loaded.

Lightning tests a logger's package only at construction, after the policy loaded (minutes)
and the run folder exists; ``check_loggers`` tests the config alone and names the extra to
install. ``RunCSVLogger`` makes Lightning's CSV logger safe to resume in place: ``metrics.csv``
is only ever replaced atomically, never truncated, and never written through a planted link.
"""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import io
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from omegaconf import DictConfig, OmegaConf

from mrtpo.safe_files import check_folders, no_follow, refuse_unsafe, write_atomic

log = logging.getLogger(__name__)


#: What a logger class needs (by class name, so that ``lightning.pytorch.loggers.X`` and
#: ``pytorch_lightning.loggers.X`` are alike): one of its modules importable, at the pip
#: requirement's version (Lightning's own minimum), and this project's extra that installs it.
_NEEDS: dict[str, tuple[tuple[str, ...], str, str | None]] = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard", "tensorboard"),
    "WandbLogger": (("wandb",), "wandb>=0.12.10", "wandb"),
    "MLFlowLogger": (("mlflow",), "mlflow>=1.0.0", None),
    "CometLogger": (("comet_ml",), "comet-ml>=3.44.4", None),
    "NeptuneLogger": (("neptune",), "neptune>=1.0", None),
}


class LoggerPackageMissing(ImportError):
    """A configured logger cannot be built because its package is not installed."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or a broken module spec
        return False


def _version_ok(module: str, requirement: str) -> bool:
    """True unless the installed distribution is known to be too old for ``requirement``."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if module != req.name.replace("-", "_") or not req.specifier:
        return True
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return True  # importable without metadata (a source tree on the path): trust it
    return req.specifier.contains(version, prereleases=True)


def _problem(key: str, target: str) -> str | None:
    """Why the logger ``key`` (class ``target``) cannot be built; None when it can."""
    module_name, _, cls = target.rpartition(".")
    if cls not in _NEEDS:
        # A logger this table does not know: at least its own module must be importable.
        if module_name and not _importable(module_name):
            return (
                f"logger.{key}: its _target_ {target} cannot be imported (no module "
                f"{module_name!r}); install the package that provides it, or drop this logger"
            )
        return None
    modules, requirement, extra = _NEEDS[cls]
    found = [m for m in modules if _importable(m)]
    if found and any(_version_ok(m, requirement) for m in found):
        return None
    what = " or ".join(f"`{m}`" for m in modules)
    state = "is too old" if found else "is not installed"
    how = (
        f"pip install -e .[{extra}]  (or pip install '{requirement}')"
        if extra
        else f"pip install '{requirement}'"
    )
    return f"logger.{key} ({cls}) needs the {what} package ({requirement}), which {state}: {how}"


def _nodes(logger_cfg) -> list[tuple[str, Mapping]]:
    if logger_cfg is None or logger_cfg is False:
        return []
    if isinstance(logger_cfg, DictConfig):
        logger_cfg = OmegaConf.to_container(logger_cfg, resolve=False)
    if not isinstance(logger_cfg, Mapping):
        raise TypeError(
            f"logger must be a mapping of name -> logger config, got {type(logger_cfg).__name__}"
        )
    if "_target_" in logger_cfg:  # a single logger node rather than a group of them
        return [("_", logger_cfg)]
    return [(str(k), v) for k, v in logger_cfg.items() if v]


def check_loggers(logger_cfg) -> None:
    """Raise ``LoggerPackageMissing`` naming each logger whose package is missing (config only)."""
    targets = [(k, n.get("_target_")) for k, n in _nodes(logger_cfg) if isinstance(n, Mapping)]
    problems = [p for k, target in targets if target and (p := _problem(k, str(target)))]
    if problems:
        raise LoggerPackageMissing(
            "cannot start: "
            + "; ".join(problems)
            + ". Or choose another logger (logger=csv needs nothing extra)."
        )


def _step_of(row: dict[str, str]) -> int | None:
    try:
        return int(float(row.get("step", "")))
    except (TypeError, ValueError):
        return None


def _read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of ``path``; a last line cut short by a kill (no newline) is left out."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        log.warning("%s: its last line is incomplete (a killed writer?); left out", path)
        data = data[: data.rfind(b"\n") + 1]
    reader = csv.DictReader(io.StringIO(data.decode("utf-8"), newline=""))
    return list(reader.fieldnames or []), list(reader)


class KeepingWriter(ExperimentWriter):
    """Lightning's CSV writer, but ``metrics.csv`` is never removed or truncated in place
    (Lightning's deletes it and rewrites it for a new column: a kill in between loses every
    row). The first save atomically replaces it by its rows before ``start_step`` plus the
    new ones; later saves append, or rewrite atomically for a new column."""

    def __init__(self, log_dir: str, start_step: int | None = 0) -> None:
        super().__init__(log_dir)
        #: rows of steps at or after this are dropped from the old file; None: not known yet
        #: (a resume before its checkpoint is restored), so nothing is written until set
        self.start_step = start_step
        self._merged = False
        self.kept = self.dropped = 0

    def _check_log_dir_exists(self) -> None:  # Lightning's version deletes metrics.csv
        return

    def save(self) -> None:
        if not self.metrics or self.start_step is None:
            return
        path = Path(self.metrics_file_path)
        if "://" in str(self.metrics_file_path) and not str(path).startswith("file://"):
            return super().save()  # a remote store: Lightning's writer
        new_keys = self._record_new_keys()
        if not self._merged or new_keys or not path.is_file():
            refuse_unsafe(path)  # a link planted here: never read nor written through
            old_fields, old = _read_rows(path) if path.is_file() else ([], [])
            if not self._merged:
                keep = [r for r in old if (s := _step_of(r)) is not None and s < self.start_step]
                self.kept, self.dropped = len(keep), len(old) - len(keep)
                old = keep
            self.metrics_keys = sorted(set(self.metrics_keys) | set(old_fields))
            # one rename of a fsynced file: at every instant the old or the new table
            text = io.StringIO(newline="")
            w = csv.DictWriter(text, fieldnames=self.metrics_keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(old + self.metrics)
            write_atomic(path, text.getvalue())
            self._merged = True
        else:
            with open(path, "a", newline="", encoding="utf-8", opener=no_follow) as f:
                csv.DictWriter(f, fieldnames=self.metrics_keys).writerows(self.metrics)
                f.flush()
                os.fsync(f.fileno())
        self.metrics = []


class RunCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` writing through ``KeepingWriter``. ``resuming``: the restart
    step comes later (``callbacks.resume.ResumeMetrics``); the old file is kept until then."""

    def __init__(self, *args: Any, resuming: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resuming = resuming

    @property
    @rank_zero_experiment
    def experiment(self) -> KeepingWriter:
        if self._experiment is None:
            save_dir, log_dir = Path(self.save_dir or "."), Path(self.log_dir)
            if "://" not in str(self.save_dir) and log_dir.is_relative_to(save_dir):
                check_folders(log_dir, save_dir)  # csv/ planted as a link to a user's folder
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = KeepingWriter(self.log_dir, None if self.resuming else 0)
        return self._experiment


_LIGHTNING_CSV = ("lightning.pytorch.loggers.CSVLogger", "pytorch_lightning.loggers.CSVLogger")


def build_loggers(logger_cfg, resuming: bool) -> list:
    """The configured loggers; Lightning's own ``CSVLogger`` is built as ``RunCSVLogger``."""
    csv_logger = {"_target_": f"{__name__}.RunCSVLogger", "resuming": resuming}
    return [
        instantiate(node, **csv_logger)
        if str(node.get("_target_", "")) in _LIGHTNING_CSV
        else instantiate(node)
        for node in (logger_cfg or {}).values()
        if node
    ]
