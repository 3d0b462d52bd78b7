"""One process at a time in a run folder: ``RunFolderLock``, an ``flock`` on the folder itself
that the kernel drops with its process; ``run.lock`` names who holds it. A folder where a name
the run writes is a link, or that cannot be written, is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from mrtpo.run.resume import ResumeRefused
from mrtpo.safe_files import UnsafePath, check_folders, open_fd, refuse_unsafe

log = logging.getLogger(__name__)


#: The record of a run folder: who runs there while a run does (absent otherwise). The lock
#: itself is an ``flock`` on the folder, which deleting this file cannot break.
LOCK_NAME = "run.lock"

#: What a run writes in its folder, besides its checkpoints: a run starting in a folder where
#: one of these is a link, or not a regular file, is refused before anything is written.
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
    """The run folder cannot take a run: read-only, or a name the run writes is a link, a
    FIFO or a folder. Nothing was changed."""


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
    """A worker of a multi-process run (DDP rank > 0, another node): the launching process
    of the run holds the folder's lock for all of them."""
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
    """Lock ``fd`` exclusively without waiting: True, False (another process holds it), or
    None (this filesystem has no ``flock`` for it)."""
    import fcntl

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
    """A one-line refusal for a run folder that cannot be written (read-only, no
    permission); any other error is raised as it is."""
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
    """Refuse a folder where a name a run writes (``RUN_FILES``, ``RUN_FOLDERS``) is a link
    or not what it should be: nothing written there may land elsewhere."""
    try:
        for name in RUN_FOLDERS:
            check_folders(folder / name, folder)
        for name in RUN_FILES:
            check_folders((folder / name).parent, folder)
            refuse_unsafe(folder / name)
    except UnsafePath as exc:
        raise RunFolderUnusable(str(exc)) from None


class RunFolderLock:
    """An exclusive lock on a run folder for the ``with`` block (a no-op in worker ranks).

    ``flock`` on the folder itself: the kernel drops it however the process dies, and
    deleting ``run.lock`` does not free it. The holder is named in ``run.lock`` (another
    process gets ``RunFolderBusy``). Before ``accept()`` an exception puts ``run.lock`` back
    as it was (a refused run changes nothing); otherwise it is removed while still locked."""

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
