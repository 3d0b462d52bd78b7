"""Checkpoints that cannot silently lose or corrupt a run (docs/reliability.md).

``SafeCheckpointIO`` (the trainer's plugin; Lightning's stages through fsspec's temp folder
and passes torch's raw errors through) writes atomically with a SHA-256 sidecar
(``<name>.ckpt.sha256``, ``sha256sum -c`` format) verified on load, refuses non-finite state,
reads weights-only with ``CHECKPOINT_GLOBALS`` (the sidecar proves the bytes, not the author),
never writes or removes through a link, and names the usable checkpoints beside a bad one.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import re
import tempfile
import zipfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from mrtpo.run.settings import leaves
from mrtpo.safe_files import pid_alive as _alive

log = logging.getLogger(__name__)

CHECKSUM_SUFFIX = ".sha256"
_CHUNK = 1 << 24  # 16 MiB per read when hashing


class CheckpointError(RuntimeError):
    """An unusable checkpoint (empty, truncated, altered, non-finite, or not plain data).
    ``path``/``reason`` are set for a damaged file so ``advice`` can reword the remedy."""

    def __init__(self, message: str, path: Path | None = None, reason: str | None = None):
        super().__init__(message)
        self.path, self.reason = path, reason

    def advice(self, use: str) -> str:
        """The message, offering the other checkpoints for ``use`` ("evaluate one", ...)."""
        if self.path is None or self.reason is None:
            return str(self)
        return damaged_message(self.path, self.reason, use)


def _damaged(path: str | Path, what: str) -> CheckpointError:
    return CheckpointError(damaged_message(path, what), Path(path), what)


class NonFiniteStateError(FloatingPointError):
    """Training state (parameters or optimizer state) holds NaN or infinity."""


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The first float tensor holding NaN or ±inf, with its counts, or None. One device
    sync for the whole set (flags stacked first), cheap enough to run after every update."""
    # A sharded (FSDP2) tensor is checked on this rank's shard: the caller decides jointly.
    named = [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in named]
    items = [(n, t) for n, t in named if t.is_floating_point() or t.is_complex()]
    if not items:
        return None
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in items:
        flags.setdefault(t.device, []).append(torch.isfinite(t.detach()).all())
    if all(bool(torch.stack(f).all()) for f in flags.values()):
        return None
    for name, t in items:
        t = t.detach()
        if not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            return f"{name} ({nan} NaN, {inf} inf of {t.numel()} values)"
    return None  # pragma: no cover - the stacked check and the loop agree


def checkpoint_nonfinite(checkpoint: dict[str, Any]) -> str | None:
    """The first non-finite tensor of a checkpoint's weights or optimizer state, or None."""
    parts = [(k, checkpoint.get(k, {})) for k in ("state_dict", "optimizer_states")]
    return first_nonfinite(
        (name, v) for k, part in parts for name, v in leaves(part, k) if torch.is_tensor(v)
    )


def assert_finite_state(model: torch.nn.Module, optimizer: Any = None) -> None:
    """Raise ``NonFiniteStateError`` naming the first non-finite parameter or optimizer state."""
    params = list(model.named_parameters())
    named: list[tuple[str, torch.Tensor]] = [(f"parameter {n}", p) for n, p in params]
    opt = getattr(optimizer, "_optimizer", optimizer)
    if opt is not None:
        names = {id(p): n for n, p in params}
        for p, state in opt.state.items():
            pname = names.get(id(p), f"<parameter {tuple(p.shape)} not in the model>")
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    named.append((f"optimizer state {key} of {pname}", value))
    bad = first_nonfinite(named)
    if bad is not None:
        raise NonFiniteStateError(
            f"non-finite training state: {bad}. The update that produced it is not saved; "
            "lower optim.lr or rl.max_grad_norm, and resume from the last checkpoint"
        )


class _HashingWriter:
    """A write-only stream that hashes and counts what passes through it to ``raw``."""

    def __init__(self, raw) -> None:
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        n = self.raw.write(data)
        self.size += len(memoryview(data))
        return n

    def flush(self) -> None:
        self.raw.flush()


def checksum_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def _fsync_dir(folder: Path) -> None:
    # some filesystems do not open or sync folders; the rename is still atomic
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_temp(folder: Path, name: str, fill) -> tuple[Path, Any]:
    """Create a temporary file in ``folder``, let ``fill(stream)`` write it, fsync it."""
    # the writer's pid in the name tells a later run whether its writer is still alive
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.{os.getpid()}.", suffix=".tmp", dir=folder)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # mkstemp's 0600 would hide checkpoints from a group
        with os.fdopen(fd, "wb") as raw:
            result = fill(raw)
            raw.flush()
            os.fsync(raw.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp), result


#: ``.<name>.ckpt[.sha256].[<pid>.]<random>.tmp``: a temporary file of ``_write_temp``.
_TEMP = re.compile(r"^\.(?P<name>.+\.ckpt(?:\.sha256)?)\.(?:(?P<pid>\d+)\.)?[A-Za-z0-9_]+\.tmp$")


def remove_stale_temporaries(folder: str | Path, all_stale: bool = False) -> list[Path]:
    """Remove (and return) temp files left by writers killed mid-save: those whose pid is
    dead here, or all of them with ``all_stale`` (the caller holds the run folder's lock)."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:  # no checkpoint folder yet
        return removed
    for p in entries:
        m = _TEMP.match(p.name)
        if m is None or not p.is_file():
            continue
        pid = int(m["pid"]) if m["pid"] else None
        if not all_stale and (pid is None or pid == os.getpid() or _alive(pid)):
            continue
        size = p.stat().st_size
        p.unlink(missing_ok=True)
        removed.append(p)
        log.warning(
            "removed %s (%d bytes): a temporary file of a checkpoint save that was killed",
            *(p, size),
        )
    return removed


def atomic_save(checkpoint: dict[str, Any], path: str | Path) -> None:
    """Write ``checkpoint`` and its sidecar, all or nothing. Raises ``NonFiniteStateError``
    (nothing written) or an ``OSError`` naming ``path`` when the disk refuses."""
    path, folder = Path(path), Path(path).parent
    bad = checkpoint_nonfinite(checkpoint)
    if bad is not None:
        raise NonFiniteStateError(
            f"refusing to write checkpoint {path}: {bad} is not finite. The checkpoints "
            f"already in {folder} are kept as they were"
        )
    tmp = side_tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)

        def dump(raw):
            w = _HashingWriter(raw)
            torch.save(checkpoint, w)
            return w

        tmp, w = _write_temp(folder, path.name, dump)
        line = f"{w.sha.hexdigest()}  {path.name}\n# bytes {w.size}\n".encode()
        side = checksum_path(path)
        side_tmp, _ = _write_temp(folder, side.name, lambda raw: raw.write(line))
        # Old sidecar first: a crash between the two renames leaves a checkpoint without a
        # checksum (loaded unverified), never one with a wrong checksum.
        side.unlink(missing_ok=True)
        os.replace(tmp, path)
        tmp = None
        os.replace(side_tmp, side)
        side_tmp = None
        _fsync_dir(folder)
    except Exception as exc:
        # torch's zip writer turns a failed write into its own RuntimeError on the way out;
        # report the disk's error (ENOSPC, EACCES, EROFS...) that started it.
        cause, seen = exc, set()
        while cause is not None and not isinstance(cause, OSError) and id(cause) not in seen:
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        what = (cause.strerror or str(cause)) if isinstance(cause, OSError) else f"{exc!r}"
        msg = (
            f"could not write checkpoint {path} ({what}); nothing was written and the "
            f"checkpoints already in {folder} are unchanged"
        )
        if isinstance(cause, OSError):
            raise type(cause)(cause.errno, msg) from exc
        raise RuntimeError(msg) from exc
    finally:
        for t in (tmp, side_tmp):
            if t is not None:
                Path(t).unlink(missing_ok=True)


def read_checksum(path: str | Path) -> tuple[str, int | None] | None:
    """(sha256 hex, byte count or None) recorded for ``path``, or None without a sidecar."""
    side = checksum_path(path)
    if not side.is_file():
        return None
    digest, size = "", None
    for line in side.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("# bytes "):
            try:
                size = int(line.split()[-1])
            except ValueError:
                size = None
        elif line.strip() and not digest:
            digest = line.split()[0].lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise _damaged(path, f"has an unreadable checksum file {side.name}")
    return digest, size


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _step_of(p: Path) -> int:
    m = re.search(r"(\d+)", p.stem)
    return int(m.group(1)) if m else -1


def alternatives(path: str | Path) -> list[Path]:
    """Other checkpoints beside ``path`` that look usable, newest first: cheap on purpose
    (files may be 100 GB), only non-empty and of their recorded size."""
    path = Path(path)
    try:
        files = [p for p in path.parent.glob("*.ckpt") if p.is_file() and p.name != path.name]
    except OSError:
        return []
    out = [p for p in files if _recorded_size(p) not in (None, 0)]
    return sorted(out, key=lambda p: (p.stat().st_mtime, _step_of(p)), reverse=True)


def _recorded_size(path: Path) -> int | None:
    """``path``'s size if its sidecar records that size or none; None if unreadable or another."""
    try:
        rec, size = read_checksum(path), path.stat().st_size
    except (OSError, CheckpointError):
        return None
    return size if rec is None or rec[1] in (None, size) else None


def damaged_message(path: str | Path, what: str, use: str = "resume from one") -> str:
    """``checkpoint <path> <what>``, offering the usable checkpoints beside it for ``use``."""
    path = Path(path)
    alt = alternatives(path)
    if alt:
        names = ", ".join(p.name for p in alt[:5])
        hint = (
            f"Other checkpoints in {path.parent} (newest first): {names}. "
            f"{use[:1].upper() + use[1:]} with ckpt_path={alt[0]}"
        )
    else:
        hint = f"There is no other checkpoint in {path.parent}; the run has to start again"
    return f"checkpoint {path} {what}. {hint}"


def _check_zip(path: Path) -> None:
    """Without a recorded checksum, the CRC-32 that torch's zip format stores for each
    record is the next best check (it catches bytes changed inside a tensor too)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise _damaged(
            path,
            "is not a complete checkpoint: its zip structure cannot be read "
            f"({type(exc).__name__}), as when a file is truncated or overwritten",
        ) from exc
    if bad is not None:
        raise _damaged(path, f"is damaged: its record {bad!r} fails its CRC-32 check")


def verify_file(path: str | Path) -> str:
    """Check ``path`` holds the bytes written; return ``"sha256"`` or ``"crc32"`` (no
    sidecar). Reads once, builds no tensors: the cheap test before a run folder changes."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    size = path.stat().st_size
    if size == 0:
        raise _damaged(path, "is empty (0 bytes)")
    rec = read_checksum(path)
    if rec is None:
        log.warning(
            "checkpoint %s has no %s file (not written by this project?): checked by the "
            "CRC-32s of its zip records only",
            *(path, CHECKSUM_SUFFIX),
        )
        _check_zip(path)
        return "crc32"
    digest, want = rec
    if want is not None and size != want:
        what = "truncated" if size < want else "longer than it was written"
        raise _damaged(path, f"is {what}: {size} bytes, {want} were written")
    got = sha256_file(path)
    if got != digest:
        raise _damaged(
            path,
            f"was changed or damaged after it was written: its SHA-256 is {got[:16]}..., "
            f"{checksum_path(path).name} recorded {digest[:16]}...",
        )
    return "sha256"


#: All a read allows beyond torch's weights-only basics: found by listing the pickle globals
#: of real RL (every method), SFT and LoRA checkpoints. Widen only for a type we write.
CHECKPOINT_GLOBALS: tuple[Any, ...] = (OrderedDict, torch._utils._rebuild_tensor_v2)


def _torch_load(path: Any, map_location: Any, mmap: bool) -> Any:
    """``torch.load``, weights-only, with ``CHECKPOINT_GLOBALS`` allowed for this read only."""
    with torch.serialization.safe_globals(list(CHECKPOINT_GLOBALS)):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def _refused_globals(path: Path, exc: BaseException) -> list[str]:
    """The functions and classes a checkpoint's pickle names that the reader refused."""
    names = re.findall(r"GLOBAL ([\w.]+)", str(exc))
    allowed = torch.serialization.safe_globals(list(CHECKPOINT_GLOBALS))
    with contextlib.suppress(Exception), allowed:  # best effort; torch's message named one
        names += torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    return sorted(set(names))


def load_checkpoint(
    path: str | Path,
    map_location: Any = "cpu",
    weights_only: bool | None = None,
    mmap: bool = False,
) -> dict[str, Any]:
    """Verify and load; refuse non-finite state and pickles naming more than
    ``CHECKPOINT_GLOBALS``. ``weights_only`` is ignored: every read is weights-only, whatever
    a caller or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` asks."""
    path = Path(path)
    how = verify_file(path)
    try:
        ckpt = _torch_load(path, map_location, mmap)
    except pickle.UnpicklingError as exc:
        names = _refused_globals(path, exc)
        if not names:
            raise _unloadable(path, how, exc) from exc
        raise CheckpointError(
            f"checkpoint {path} names {', '.join(names[:5])} in its pickle, which no "
            "checkpoint of this project does: it was refused before anything in it could "
            "run (checkpoints are read as tensors and plain values only). Use a checkpoint "
            "this project wrote"
        ) from exc
    except Exception as exc:
        raise _unloadable(path, how, exc) from exc
    if not isinstance(ckpt, dict):
        raise _damaged(path, f"holds a {type(ckpt).__name__}, not a checkpoint dict")
    bad = checkpoint_nonfinite(ckpt)
    if bad is not None:
        raise _damaged(path, f"holds non-finite values: {bad}")
    return ckpt


def _unloadable(path: Path, how: str, exc: BaseException) -> CheckpointError:
    # The bytes are the ones written, so torch's own reason is the real one here.
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return CheckpointError(
        f"checkpoint {path} is intact (its {how} check passes) but torch could not "
        f"load it: {type(exc).__name__}: {reason}"
    )


def peek_checkpoint(path: str | Path, keys: Iterable[str]) -> dict[str, Any] | None:
    """Top-level entries (``global_step``, ...), unverified, memory-mapped; None if unreadable."""
    try:
        ckpt = _torch_load(path, "cpu", mmap=True)
    except Exception:
        return None
    if not isinstance(ckpt, dict):
        return None
    return {k: ckpt.get(k) for k in keys}


def _local(path: Any) -> str | None:
    """A local path (``file://`` dropped), or None for a remote store."""
    s = str(path)
    return s.removeprefix("file://") if "://" not in s or s.startswith("file://") else None


def _not_removable(path: Path) -> str | None:
    """Why ``path`` may not be removed, or None. Lightning takes the path from the resumed
    checkpoint and checks it by text only (``<folder>/../../notes.ckpt`` passes), so only a
    ``.ckpt`` whose sidecar records its size goes (a symlink itself, never its target)."""
    if ".." in path.parts:
        return "its path leaves the checkpoint folder through '..'"
    if path.is_symlink() or not path.exists():
        return None
    if path.suffix != ".ckpt" or not path.is_file():
        return "it is not a .ckpt file"
    try:
        rec = read_checksum(path)
        size = path.stat().st_size
    except (OSError, CheckpointError):
        rec = None
    if rec is None or rec[1] != size:
        return f"no {CHECKSUM_SUFFIX} file beside it records its size (not written here?)"
    return None


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` (module docstring); remote paths use Lightning's, weights-only."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if storage_options is not None or _local(path) is None:
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_save(checkpoint, _local(path))

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only=None):
        # Lightning passes weights_only=None (or what trainer.fit was given): read data only
        if _local(path) is None:
            with torch.serialization.safe_globals(list(CHECKPOINT_GLOBALS)):
                return super().load_checkpoint(path, map_location, weights_only=True)
        return load_checkpoint(_local(path), map_location)

    def remove_checkpoint(self, path) -> None:
        if _local(path) is None:
            return super().remove_checkpoint(path)
        path = Path(_local(path))
        why = _not_removable(path)
        if why is not None:
            log.warning("not removing %s, which Lightning asked to remove: %s", path, why)
            return
        path.unlink(missing_ok=True)
        checksum_path(path).unlink(missing_ok=True)
