"""A vLLM server engine's weight snapshots: the files, their folders, and their removal.

Each push goes into ``pushes-<random>/v<version>/`` inside the folder the server reads; each
folder's ``owner.json`` lets the next run remove a killed run's leftovers only when it proves
the owner dead (docs/rollout.md, "Snapshots").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from mrtpo.safe_files import open_fd, pid_alive, refuse_unsafe

log = logging.getLogger(__name__)

RECORD = "owner.json"
OWN_ROOT = "mrtpo-vllm-server-"  # a started server's temporary folder, in the temp folder
PUSHES = "pushes-"  # one engine's snapshots, inside the folder the server reads


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc); None where unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> int | None:
    """This process's pid namespace (the inode of /proc/self/ns/pid): containers that share
    a hostname and a folder but not their pids tell their runs apart by it."""
    with contextlib.suppress(OSError):
        return os.stat("/proc/self/ns/pid").st_ino
    return None


def owner() -> dict[str, Any]:
    """This process, as ``owner.json`` records it."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot_id(), "pidns": _pid_namespace(),
            "pid": pid, "start": _start_time(pid)}  # fmt: skip


def make_folder(prefix: str, parent: Path | None = None) -> Path:
    """A new ``mkdtemp`` folder (0700) that names this process as its owner."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd = open_fd(folder / RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(owner(), f)
    return folder


def _own_storage(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """CPU, contiguous tensors, a copy where two share memory (safetensors refuses those:
    a tied ``lm_head.weight`` is ``embed_tokens.weight``)."""
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        yield name, t


def write_snapshot(folder: Path, index: int, tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One bucket of a push as ``folder/bucket-<index>.safetensors``; returns the file name.

    Written beside its final name and renamed into place (a link there is refused). Not
    fsynced: ``folder`` is the engine's own (``mkdtemp``) and the server reads the file at
    once (measured on a 119 MB model: a push took 0.5-0.7 s, 0.9-1.5 s fsynced)."""
    from safetensors.torch import save_file

    name = f"bucket-{index:05d}.safetensors"
    path = folder / name
    refuse_unsafe(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        save_file(dict(_own_storage(dict(tensors))), tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return name


def _record(folder: Path) -> dict[str, Any] | None:
    try:
        fd = open_fd(folder / RECORD, os.O_RDONLY)
    except (OSError, ValueError):  # none, or a link or anything but a file
        return None
    with os.fdopen(fd) as f, contextlib.suppress(ValueError):
        data = json.load(f)
        return data if isinstance(data, dict) else None
    return None


def is_dead_leftover(folder: Path) -> bool:
    """Whether ``folder`` is provably a snapshot folder of a run of this user on this host
    whose process has ended (by its record: host, boot, pid namespace, pid, start time)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    rec = _record(folder)
    if rec is None or rec.get("host") != socket.gethostname() or not rec.get("boot"):
        return False
    if not isinstance(rec.get("pid"), int) or isinstance(rec.get("pid"), bool):
        return False
    ns = _pid_namespace()
    if ns is None or rec.get("pidns") != ns:
        return False  # its pid means nothing here (another container), or cannot tell
    if rec["boot"] != _boot_id():
        return True  # the machine restarted since: nothing of that boot runs
    if not pid_alive(rec["pid"]):
        return True
    now, then = _start_time(rec["pid"]), rec.get("start")
    return now is not None and then is not None and now != then  # the pid names another process


def leftovers(weight_dir: str | Path | None = None) -> list[Path]:
    """Dead runs' snapshot folders: ``mrtpo-vllm-server-*`` in the temp folder and, when
    given, ``pushes-*`` in ``weight_dir``."""
    places = [(Path(tempfile.gettempdir()), OWN_ROOT)]
    if weight_dir is not None:
        places.append((Path(weight_dir), PUSHES))
    found = []
    for parent, prefix in places:
        with contextlib.suppress(OSError):
            found += [p for p in parent.iterdir() if p.name.startswith(prefix)]
    return sorted(p for p in found if is_dead_leftover(p))


def remove_leftovers(weight_dir: str | Path | None = None) -> list[Path]:
    """Remove what ``leftovers`` finds (``rmtree`` does not follow links); what went."""
    gone = []
    for folder in leftovers(weight_dir):
        shutil.rmtree(folder, ignore_errors=True)
        if not os.path.lexists(folder):
            gone.append(folder)
            log.info("removed %s: weight snapshots of a run that was killed", folder)
    return gone


def leftover_note(weight_dir: str | Path | None = None) -> str | None:
    """For ``--check``: the leftovers that the run would remove at start, or None."""
    found = leftovers(weight_dir)
    if not found:
        return None
    shown = ", ".join(map(str, found[:3])) + (
        f" and {len(found) - 3} more" if len(found) > 3 else ""
    )
    return (
        f"{len(found)} weight snapshot folder(s) of killed runs ({shown}): the run removes "
        "them at start"
    )


def remove(folder: Path | None) -> None:
    """Remove one engine's folder (at close and at exit); nothing when it is gone."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
