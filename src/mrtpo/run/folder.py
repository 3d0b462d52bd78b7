"""A run's folder as a new run starts in it (never one holding anything:
``NewRunFolderCheck``) and as a refused run leaves it (no folder: ``discard_refused_folder``;
a refused or idle resume's log parked outside: ``park_refused_log``, ``drop_pending_log``);
one process at a time in it (``RunFolderLock``), and none in a folder where a name the run
writes is a link, or that cannot be written."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mrtpo.run import cli
from mrtpo.run.checks import check_names
from mrtpo.run.cli import log_to_files
from mrtpo.run.config import made_here
from mrtpo.run.resume import ResumeRefused, append_history, detach, pending_logs
from mrtpo.run.settings import ConfigError
from mrtpo.safe_files import (
    NoFollowFileHandler,
    UnsafePath,
    check_folders,
    open_fd,
    refuse_unsafe,
)

log = logging.getLogger(__name__)


def record_invocation(cfg: DictConfig) -> None:
    """Append a new run's overrides to ``.hydra/history.yaml`` (launching process only)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        subdir, output_dir = hc.output_subdir, hc.runtime.output_dir
    except Exception:  # composed outside a Hydra run (tests, library use): nothing to record
        return
    folder = Path(output_dir) / str(subdir)
    if subdir and os.environ.get("LOCAL_RANK", "0") == "0" and folder.is_dir():
        append_history(folder, {"overrides": list(hc.overrides.task)})


def _only_info(log_file: Path) -> bool:
    """Whether every line of a log written with the project's format is an INFO line."""
    try:
        lines = log_file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return False
    return all("][INFO] - " in line for line in lines if line.strip())


def drop_pending_log() -> None:
    """After a resume that did nothing: close its pending log, removed unless it warns or errs."""
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
    """After a refused resume: write the reason into its pending log (moved to
    ``resume-logs/`` from beside the folder's parent, where older configs put it); its path."""
    log_dir = OmegaConf.select(cfg, "paths.log_dir", default=None)
    if not log_dir:
        return None
    home = Path(str(log_dir)).resolve() / str(cfg.get("job_name") or "train") / "resume-logs"
    moved = None
    for h, name in pending_logs():
        moved = name  # already inside the log folder, unless:
        if not name.parent.resolve().is_relative_to(home.parent.parent):
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


#: The current run's folder chosen with ``hydra.run.dir``/``paths.output_dir``, as checked
#: before Hydra wrote there: resolved folder -> (it existed, the folders above it that did not).
_CHOSEN: dict[str, tuple[bool, list[str]]] = {}

#: These keys' values when not set (a new folder of ``unique_dir``, or the resumed run's).
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
    """Refuse, before Hydra writes there, a new run whose chosen folder holds anything."""
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
    """Hydra callback (configs/hydra/default.yaml): the checks before Hydra writes the folder."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_early(check_new_run_folder, config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_early(check_names, config)


#: A new run's ``.hydra/`` before its first step (with its job log and empty logger folders);
#: a folder holding anything else is a run's, and is kept.
HYDRA_START_FILES = frozenset({"config.yaml", "hydra.yaml", "overrides.yaml", "history.yaml"})


def _empty_tree(folder: Path) -> bool:
    return all(p.is_dir() and not p.is_symlink() and _empty_tree(p) for p in folder.iterdir())


def _start_entry(entry: Path) -> bool:
    """Whether ``entry`` of a run folder is what a new run makes before its first step."""
    if entry.is_symlink():
        return False
    if entry.name == ".hydra" and entry.is_dir():
        return all(p.name in HYDRA_START_FILES and p.is_file() for p in entry.iterdir())
    return _empty_tree(entry) if entry.is_dir() else entry.suffix == ".log" and entry.is_file()


def is_refusal(exc: BaseException) -> bool:
    """A run refused before it started: a ``ConfigError`` or missing file, maybe wrapped by
    ``instantiate``; after any other error the run folder keeps the log with the traceback."""
    from hydra.errors import InstantiationException

    if isinstance(exc, InstantiationException):
        exc = exc.__cause__
    return isinstance(exc, (ConfigError, FileNotFoundError))


def discard_refused_folder(cfg: DictConfig) -> Path | None:
    """After a new run stopped before training (refused, or ``dry_run=true``): remove the run
    folder (and empty parents) this process made, or empty a user-named folder that was empty
    before; return it. A resume's, a sweep job's, or one holding more is kept."""
    if cfg.get("resume") or secondary_process():
        return None
    folder = run_folder_of(cfg)
    made = made_here(folder) if folder is not None else None
    entry = _CHOSEN.pop(str(folder.resolve()), None) if folder is not None else None
    existed, chosen = entry or (False, [])
    if not made and entry is not None:
        made = [folder, *map(Path, chosen)]  # a folder the user named, made for this run
    if not made or not made[0].is_dir() or not all(map(_start_entry, made[0].iterdir())):
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


#: Who runs in a run folder while a run does (the lock is an ``flock`` on the folder).
LOCK_NAME = "run.lock"

#: What a run writes in its folder besides checkpoints: each must be a regular file or absent.
RUN_FILES = (
    LOCK_NAME,
    "train.log",
    ".hydra/history.yaml",
    "csv/metrics.csv",
    "samples.jsonl",
    "relevance.jsonl",
    "curves.png",
    "job.json",
)

#: The folders they go in (checkpoints/ is ``mrtpo.run.checkpointing``'s).
RUN_FOLDERS = (".hydra", ".hydra/resumes", "csv")

_HELD: dict[str, tuple[int, ...]] = {}  # resolved run folder -> its open descriptors, here


class RunFolderBusy(ResumeRefused):
    """Another live process runs in this run folder; nothing was changed."""


class RunFolderUnusable(ResumeRefused):
    """The run folder cannot take a run (read-only, or a name it writes is not a plain file)."""


def _close_held_in_child() -> None:
    # A forked child (a worker pool) must not keep the parent's lock alive after the parent
    # dies; closing its copy does not release the parent's lock.
    for fds in _HELD.values():
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


def secondary_process() -> bool:
    """A worker of a multi-process run (DDP rank > 0, another node); its launcher locks."""
    keys = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")
    return any(os.environ.get(k, "0").strip() not in ("", "0") for k in keys)


def _holder() -> bytes:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }
    return (json.dumps(info) + "\n").encode()


def _flock(fd: int) -> bool | None:
    """Lock ``fd`` without waiting: True, False (held elsewhere), or None (no ``flock`` here)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _flock_owner(fd: int) -> int | None:
    """The pid holding an ``flock`` on ``fd``'s file, from ``/proc/locks`` (Linux)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        f = line.split()
        if len(f) > 5 and f[1] == "FLOCK" and f[5] == ident and f[4].isdigit():
            return int(f[4])
    return None


def _busy_message(folder: Path, dir_fd: int | None = None) -> str:
    """Who holds ``folder``: the record in its run.lock, else the pid the kernel knows."""
    data = b""
    with contextlib.suppress(OSError, ValueError):
        fd = open_fd(folder / LOCK_NAME, os.O_RDONLY)
        data = os.pread(fd, 1 << 16, 0)
        os.close(fd)
    try:
        h = json.loads(data.decode())
        who = f"process {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        pid = _flock_owner(dir_fd) if dir_fd is not None else None
        gone = not os.path.lexists(folder / LOCK_NAME)
        who = (
            "a process that is still starting (it has not recorded itself yet)"
            if pid is None
            else f"process {pid} on this machine"
            + (f", whose record in {LOCK_NAME} was deleted" if gone else "")
        )
    return (
        f"run folder {folder} is in use by another run ({who}); two runs in one folder would "
        f"mix their metrics and checkpoints. Wait for it to end or stop it, then resume. "
        "The lock is released by the system when its process dies: there is nothing to delete"
    )


def _cannot_write(folder: Path, exc: OSError) -> RunFolderUnusable:
    """A one-line refusal of a read-only or forbidden run folder; any other error is raised."""
    if exc.errno == errno.EROFS:
        return RunFolderUnusable(
            f"run folder {folder} is on a read-only filesystem, and a run writes its "
            f"metrics, checkpoints and log there. Copy it somewhere writable (cp -a {folder} "
            "<new place>) and resume the copy"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return RunFolderUnusable(
            f"run folder {folder} cannot be written by this user ({exc.strerror}): give this "
            "user write permission, or copy the folder somewhere writable and resume the copy"
        )
    raise exc


def check_planted(folder: Path) -> None:
    """Refuse a folder where a name a run writes is a link or not what it should be."""
    try:
        for name in RUN_FOLDERS:
            check_folders(folder / name, folder)
        for name in RUN_FILES:
            check_folders((folder / name).parent, folder)
            refuse_unsafe(folder / name)
    except UnsafePath as exc:
        raise RunFolderUnusable(str(exc)) from None


class RunFolderLock:
    """An exclusive ``flock`` on a run folder for the ``with`` block (a no-op in worker ranks):
    the kernel drops it however the process dies. The holder is named in ``run.lock``; before
    ``accept()`` an exception puts ``run.lock`` back as it was, else it is removed."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.fd: int | None = None  # run.lock, while held
        self.dir_fd: int | None = None  # the folder, locked
        self.previous: bytes | None = None  # None: this lock created run.lock
        self.accepted = False

    def accept(self) -> None:
        self.accepted = True

    def _open_record(self) -> tuple[int, bool]:
        """run.lock, opened for writing (created when missing); never through a link."""
        path = self.folder / LOCK_NAME
        try:
            try:
                return open_fd(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                return open_fd(path, os.O_RDWR), False
        except UnsafePath as exc:
            raise RunFolderUnusable(str(exc)) from None
        except OSError as exc:
            raise _cannot_write(self.folder, exc) from exc

    def __enter__(self) -> RunFolderLock:
        key = str(self.folder.resolve())
        if secondary_process() or key in _HELD or not self.folder.is_dir():
            return self
        try:
            dir_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise _cannot_write(self.folder, exc) from exc
        fd, created = None, False
        try:
            locked = _flock(dir_fd)
            if locked is False:
                raise RunFolderBusy(_busy_message(self.folder, dir_fd))
            check_planted(self.folder)
            fd, created = self._open_record()
            if locked is None:  # no flock on folders here: lock run.lock itself
                locked = _flock(fd)
                if locked is False:
                    raise RunFolderBusy(_busy_message(self.folder))
                if locked is None:
                    log.warning("cannot lock run folder %s; running without", self.folder)
        except BaseException:
            if fd is not None:
                os.close(fd)
                if created:
                    (self.folder / LOCK_NAME).unlink(missing_ok=True)
            os.close(dir_fd)
            raise
        self.previous = None if created else os.pread(fd, os.fstat(fd).st_size, 0)
        self.fd, self.dir_fd = fd, dir_fd
        _HELD[key] = (fd, dir_fd)
        self._write(_holder())
        return self

    def _write(self, data: bytes) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.fd is None:
            return
        try:
            if exc_type is not None and not self.accepted and self.previous is not None:
                self._write(self.previous)  # a refused run changes nothing
            else:  # the run ended (or made run.lock): no holder is left to name
                (self.folder / LOCK_NAME).unlink(missing_ok=True)
        finally:
            _HELD.pop(str(self.folder.resolve()), None)
            os.close(self.fd)
            os.close(self.dir_fd)  # releases the flock
            self.fd = self.dir_fd = None
