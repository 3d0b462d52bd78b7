"""A run's folder as a new run starts in it and as a refused run leaves it.

A new run never writes into a folder that holds anything (``NewRunFolderCheck``, as Hydra
starts); a new run refused before it trained leaves no folder (``discard_refused_folder``); a
refused or idle resume's log is parked outside the run's folder (``park_refused_log``,
``drop_pending_log``). Resuming is ``mrtpo.run.resume``; one process per folder is
``mrtpo.run.lock``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mrtpo.run.cli import log_to_files
from mrtpo.run.lock import secondary_process
from mrtpo.run.resume import append_history, detach, pending_logs
from mrtpo.safe_files import NoFollowFileHandler

log = logging.getLogger(__name__)


def record_invocation(cfg: DictConfig) -> None:
    """Append a new run's overrides to ``.hydra/history.yaml`` (launching process only)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        subdir, output_dir = hc.output_subdir, hc.runtime.output_dir
    except Exception:  # composed outside a Hydra run (tests, library use): nothing to record
        return
    if not subdir or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    folder = Path(output_dir) / str(subdir)
    if not folder.is_dir():
        return
    append_history(folder, {"overrides": list(hc.overrides.task)})


def _only_info(log_file: Path) -> bool:
    """Whether every line of a log written with the project's format is an INFO line."""
    try:
        lines = log_file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return False
    return all("][INFO] - " in line for line in lines if line.strip())


def drop_pending_log() -> None:
    """After a resume that did nothing: close its pending log (``mrtpo.run.config.job_log``) and
    remove it if it holds no warning or error (a start-up note such as the thread count is
    not worth a file), with its folder if that is then empty."""
    for h, name in pending_logs():
        detach(h)
        if name.is_file() and _only_info(name):
            name.unlink()
            with contextlib.suppress(OSError):  # kept while another resume is pending
                name.parent.rmdir()


def run_folder_of(cfg: DictConfig) -> Path | None:
    """The folder a training config runs in: the resumed run's, or ``paths.output_dir``."""
    if cfg.get("resume"):
        return Path(str(cfg.resume))
    out = OmegaConf.select(cfg, "paths.output_dir", default=None)
    return Path(str(out)) if out else None


def park_refused_log(cfg: DictConfig, reason: BaseException | None = None) -> Path | None:
    """After a refused resume: write the reason into its pending log (``config.job_log``),
    first moving there a log an older hydra config put beside the folder's parent (removing
    the emptied folder). Returns the log's path, or None."""
    log_dir = OmegaConf.select(cfg, "paths.log_dir", default=None)
    if not log_dir:
        return None
    home = Path(str(log_dir)).resolve() / str(cfg.get("job_name") or "train") / "resume-logs"
    moved = None
    for h, name in pending_logs():
        if name.parent.resolve().is_relative_to(home.parent.parent):
            log_to_files(logging.ERROR, f"resume refused: {reason} (this log: {name})")
            moved = name  # already inside the log folder
            continue
        detach(h)
        home.mkdir(parents=True, exist_ok=True)
        moved = home / name.name
        if name.is_file():
            shutil.move(name, moved)
        with contextlib.suppress(OSError):
            name.parent.rmdir()
        handler = NoFollowFileHandler(moved, encoding="utf-8")
        handler.setFormatter(h.formatter)
        logging.getLogger().addHandler(handler)
        log_to_files(logging.ERROR, f"resume refused: {reason} (this log: {moved})")
    return moved


# ---- a new run never writes into a folder that holds anything -------------------------------

#: Folders chosen with ``hydra.run.dir``/``paths.output_dir`` for a new run, checked before
#: Hydra wrote into them: resolved folder -> (it existed, the folders above it that did not).
#: A run refused before it trained removes what was made for it (``discard_refused_folder``).
#: The current run's only: a process runs one at a time, each check starts it afresh.
_CHOSEN: dict[str, tuple[bool, list[str]]] = {}

#: The values these keys have when not set: a new folder of this process (``unique_dir``),
#: or the resumed run's.
_DEFAULT_FOLDERS = {"hydra.run.dir": "${mrtpo.run_dir:", "paths.output_dir": "${hydra:runtime"}


def _chosen_folder(cfg: DictConfig, key: str) -> Path | None:
    """The folder ``key`` names when the user set it; None when it has its default."""
    parent, leaf = key.rsplit(".", 1)
    node = OmegaConf.select(cfg, parent, default=None)
    if node is None:
        return None
    # (never ``leaf in node``: it would resolve the default and make a new run folder)
    raw = OmegaConf.to_container(node, resolve=False).get(leaf)
    if raw is None or str(raw).startswith(_DEFAULT_FOLDERS[key]):
        return None
    return Path(str(OmegaConf.select(cfg, key)))


def check_new_run_folder(cfg: DictConfig) -> None:
    """Refuse, before Hydra writes there, a new run whose chosen folder already holds
    anything (a finished run's checkpoints, a user's files). Resumes and DDP workers pass."""
    from mrtpo.run.checks import check_names
    from mrtpo.run.settings import ConfigError

    check_names(cfg)
    _CHOSEN.clear()
    if cfg.get("resume") or secondary_process():
        return
    for key in _DEFAULT_FOLDERS:
        folder = _chosen_folder(cfg, key)
        if folder is None:
            continue
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise ConfigError(f"{key}={folder} is not a folder: name a new or empty folder")
        if folder.is_dir() and any(folder.iterdir()):
            raise ConfigError(
                f"{key}={folder} already holds files, and a new run there would replace or "
                "append to them: name a new or empty folder, or continue the run in it with "
                f"+resume={folder}"
            )
        missing = [p for p in [folder, *folder.parents] if not p.exists()]
        _CHOSEN[str(folder.resolve())] = (folder.exists(), [str(p) for p in missing[1:]])


def _refuse_early(check, config: DictConfig) -> None:
    """Run ``check`` on the composed config as Hydra starts; its refusal is one line."""
    from hydra.core.hydra_config import HydraConfig

    from mrtpo.run import cli
    from mrtpo.run.settings import ConfigError

    HydraConfig.instance().set_config(config)  # ${hydra:...} in run_name resolves
    try:
        check(config)
    except ConfigError as exc:
        if not cli.COMMAND_LINE:
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - the bare GPU runner has no Hydra
    Callback = object  # type: ignore[assignment,misc]


class NewRunFolderCheck(Callback):
    """Hydra callback (configs/hydra/default.yaml): ``check_new_run_folder`` before Hydra
    makes or writes the run folder, and the names of a sweep before its jobs start."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_early(check_new_run_folder, config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from mrtpo.run.checks import check_names

        _refuse_early(check_names, config)


# ---- a new run refused before it trained leaves no folder -----------------------------------

#: What a new run's folder holds before its first step: Hydra's config (``.hydra/``), the
#: run's record of its command (``history.yaml``), its job log and empty folders its loggers
#: made (``csv/``). A folder holding anything else is a run's, and is kept.
HYDRA_START_FILES = frozenset({"config.yaml", "hydra.yaml", "overrides.yaml", "history.yaml"})


def _empty_tree(folder: Path) -> bool:
    return all(p.is_dir() and not p.is_symlink() and _empty_tree(p) for p in folder.iterdir())


def _only_hydra_start(folder: Path) -> bool:
    for entry in folder.iterdir():
        if entry.is_symlink():
            return False
        if entry.name == ".hydra" and entry.is_dir():
            if not all(p.name in HYDRA_START_FILES and p.is_file() for p in entry.iterdir()):
                return False
        elif entry.is_dir():
            if not _empty_tree(entry):
                return False
        elif not (entry.is_file() and entry.suffix == ".log"):
            return False
    return True


def is_refusal(exc: BaseException) -> bool:
    """A run refused before it started: a ``ConfigError`` or a missing file, maybe wrapped by
    Hydra's ``instantiate``. Its one line says it all; after any other error the run folder
    keeps the log holding the traceback."""
    from hydra.errors import InstantiationException

    from mrtpo.run.settings import ConfigError

    if isinstance(exc, InstantiationException):
        exc = exc.__cause__
    return isinstance(exc, (ConfigError, FileNotFoundError))


def discard_refused_folder(cfg: DictConfig) -> Path | None:
    """After a new run stopped before training (refused, or ``dry_run=true``): remove the run
    folder this process made (and the empty parents it made), so a refused command leaves
    nothing; a user-named folder that was empty before is only emptied. A resume's folder, a
    sweep job's, and one holding more than Hydra's config and log are kept. Returns the
    removed (or emptied) folder, or None."""
    from mrtpo.run.config import made_here

    if cfg.get("resume") or secondary_process():
        return None
    folder = run_folder_of(cfg)
    made = made_here(folder) if folder is not None else None
    entry = _CHOSEN.pop(str(folder.resolve()), None) if folder is not None else None
    existed, chosen = entry or (False, [])
    if not made and entry is not None:
        made = [folder, *map(Path, chosen)]  # a folder the user named, made for this run
    if not made or not made[0].is_dir() or not _only_hydra_start(made[0]):
        return None
    for h in list(logging.getLogger().handlers):  # the job log: closed before its file goes
        name = getattr(h, "baseFilename", "")
        if isinstance(h, logging.FileHandler) and Path(name).parent == made[0].resolve():
            detach(h)
    if existed:  # an empty folder the user named: emptied again, kept
        for entry in made[0].iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        return made[0]
    shutil.rmtree(made[0], ignore_errors=True)
    for parent in made[1:]:
        with contextlib.suppress(OSError):  # not empty: something else lives there
            parent.rmdir()
    return made[0]
