"""Writing files without following a link that someone else put in the way.

A run folder can come from elsewhere, and any name in it can be a symbolic link to a user's
file or a FIFO that blocks whoever opens it. The helpers open with ``O_NOFOLLOW`` and
``O_NONBLOCK`` and refuse anything but a regular file (``UnsafePath``, a ValueError printed as
one line). Folders on the way are checked with ``lstat``: that stops links planted before a
run, not a process swapping folders while it runs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
from pathlib import Path

_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFDIR: "a folder",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


class UnsafePath(ValueError):
    """A path the project was about to write is a link, or not what it should be (a FIFO
    where a file goes, a file where a folder goes); nothing was written there."""


def kind(path: str | Path) -> str | None:
    """What ``path`` is when it is not a regular file ("a symbolic link (to X)", "a FIFO
    (named pipe)", ...); None for a regular file or no file at all."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    what = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            what += f" (to {os.readlink(path)})"
    return what


def refusal(path: str | Path, what: str) -> UnsafePath:
    """The error for ``path`` being ``what`` (see ``kind``) where the project writes."""
    kept = " (what it points to is left as it is)" if what.startswith("a symbolic link") else ""
    return UnsafePath(
        f"refusing to write {path}: it is {what}, and the project writes only files and "
        "folders it made itself, never through a link or into a pipe or device. Move it "
        f"away{kept} and run again"
    )


def refuse_unsafe(path: str | Path) -> None:
    """Raise ``UnsafePath`` when ``path`` exists and is not a regular file."""
    what = kind(path)
    if what is not None:
        raise refusal(path, what)


def check_folders(path: str | Path, root: str | Path) -> None:
    """Refuse when a part of ``path`` below ``root`` (itself followed: the user named it)
    is a link or not a folder; parts that do not exist yet are fine."""
    here = Path(root)
    for part in Path(path).relative_to(root).parts:
        here = here / part
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                raise refusal(here, kind(here) or "a file, not a folder")


def make_dirs(path: str | Path, root: str | Path) -> None:
    """``mkdir -p path`` below ``root``, refusing a link or a non-folder on the way."""
    here = Path(root)
    for part in Path(path).relative_to(root).parts:
        here = here / part
        try:
            os.mkdir(here)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                raise refusal(here, kind(here) or "a file, not a folder") from None


def open_fd(path: str | Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that never follows a link as the last part and never blocks on a FIFO:
    anything but a regular file there is refused (``UnsafePath``), naming it."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:  # ELOOP: a link; ENXIO: a FIFO nobody reads; EISDIR: a folder
        what = kind(path) if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR) else None
        if what is not None:
            raise refusal(path, what) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refusal(path, kind(path) or "not a regular file")
    os.set_blocking(fd, True)
    return fd


#: an ``opener`` for ``open()``: ``open(p, "a", opener=no_follow)``
no_follow = open_fd


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """``data`` into ``path`` through a fsynced temporary file and one rename (old or new
    content at every instant); a link or non-regular file is refused, not replaced."""
    path = Path(path)
    refuse_unsafe(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp's 0600 would differ from a plain open's mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class NoFollowFileHandler(logging.FileHandler):
    """``logging.FileHandler`` that opens its file with ``no_follow``."""

    def _open(self):
        kw = {"encoding": self.encoding, "errors": self.errors}
        return open(self.baseFilename, self.mode, opener=no_follow, **kw)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine lives (a folder's or file's owner: a stale
    temporary file or lock is one whose process died)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
