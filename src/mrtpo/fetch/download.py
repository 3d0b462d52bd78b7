"""Streaming downloads that land only when whole and right, and zips laid out safely.

A download goes to a hidden temp file beside its target, is hashed while it streams, and is
renamed onto the target only when its length matches what the server announced (and the
registry's size) and its sha256 matches the expected one; otherwise the temp file is removed
and a :class:`FetchError` says why in one line. Nothing is resumed from an old temp file: a
new attempt starts from zero, so a half-written file can never be taken for the real one.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import stat
import urllib.error
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

CHUNK = 1 << 20
#: seconds a connection may stay silent (a hang guard, not a limit on the whole download)
TIMEOUT_S = 60.0


class FetchError(Exception):
    """A download or archive that was refused; the message is one line."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _open(url: str):
    req = urllib.request.Request(url, headers={"User-Agent": "mrtpo-data-fetch"})
    try:
        return urllib.request.urlopen(req, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        raise FetchError(f"HTTP {exc.code} from {url}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"cannot reach {url} ({reason})") from None


def _stream(url: str, tmp: Path) -> tuple[str, int, int | None]:
    """Write ``url``'s body to ``tmp``: (sha256, bytes received, bytes announced or None)."""
    h, n = hashlib.sha256(), 0
    with _open(url) as resp, open(tmp, "wb") as out:
        announced = resp.headers.get("Content-Length")
        announced = int(announced) if announced and announced.isdigit() else None
        try:
            for block in iter(lambda: resp.read(CHUNK), b""):
                h.update(block)
                out.write(block)
                n += len(block)
        except (http.client.IncompleteRead, OSError) as exc:
            got = n + len(getattr(exc, "partial", b"") or b"")
            raise FetchError(f"the connection broke after {got} bytes ({url})") from None
    return h.hexdigest(), n, announced


def format_problem(path: Path, name: str) -> str | None:
    """Why ``path`` is not what a file called ``name`` holds (None: it looks right). Used when
    no checksum can vouch for a download, so an error page served with 200 is not pinned."""
    suffix = Path(name.split("?")[0]).suffix.lower()
    with open(path, "rb") as f:
        head = f.read(CHUNK)
        f.seek(max(0, path.stat().st_size - 4))
        tail = f.read(4)
    try:
        if suffix == ".parquet" and not (head[:4] == tail == b"PAR1"):
            return "not a parquet file"
        if suffix == ".zip" and head[:4] != b"PK\x03\x04":
            return "not a zip archive"
        if suffix == ".jsonl":
            first = head.split(b"\n", 1)[0]
            if len(first) == len(head) == CHUNK or not isinstance(json.loads(first), dict):
                return "not a JSON-lines file of objects"
        if suffix == ".json":
            json.loads(path.read_bytes())
    except ValueError:
        return f"not a {suffix[1:].upper()} file"
    return None


def download(
    url: str, dest: Path, sha256: str | None, size: int | None, name: str | None = None
) -> tuple[str, int]:
    """Fetch ``url`` to ``dest`` if whole and right: (sha256, bytes). With ``sha256=None``
    the content is accepted when its format fits ``name`` (the caller pins what arrived)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        got, n, announced = _stream(url, tmp)
        if announced is not None and n != announced:
            raise FetchError(f"truncated download: {n} of {announced} bytes ({url})")
        if size is not None and n != size:
            raise FetchError(f"wrong size: {n} bytes, expected {size} ({url})")
        if sha256 is not None and got != sha256:
            raise FetchError(f"checksum mismatch: sha256 {got}, expected {sha256} ({url})")
        if sha256 is None and (why := format_problem(tmp, name or dest.name)):
            raise FetchError(f"{why}: {url} sent something else (an error page?)")
        os.replace(tmp, dest)
        return got, n
    finally:
        tmp.unlink(missing_ok=True)


def _safe_name(name: str) -> bool:
    p = PurePosixPath(name)
    return not (p.is_absolute() or "\\" in name or ".." in p.parts or re.match(r"^[A-Za-z]:", name))


def _check_members(zf: zipfile.ZipFile, label: str) -> None:
    """Refuse an archive that holds an absolute or escaping name, or a symlink."""
    for info in zf.infolist():
        if not _safe_name(info.filename):
            raise FetchError(f"{label}: unsafe member name {info.filename!r}; nothing extracted")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise FetchError(f"{label}: member {info.filename!r} is a symlink; nothing extracted")


def _target(name: str, rules: Sequence[tuple[str, str]]) -> str | None:
    if name.startswith("__MACOSX/") or name.endswith("/"):
        return None
    for pattern, template in rules:
        m = re.match(pattern, name)
        if m:
            return m.expand(template)
    return None


def _write_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, to: Path, target: str) -> Path:
    dest = (to / target).resolve()
    if not _safe_name(target) or not dest.is_relative_to(to.resolve()):
        raise FetchError(
            f"member {info.filename!r} would land outside {to}; nothing more extracted"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        with zf.open(info) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, CHUNK)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def extract(
    zip_path: Path,
    to: Path,
    rules: Sequence[tuple[str, str]],
    nested: str | None = None,
    inner: Sequence[tuple[str, str]] = (),
) -> dict[str, int]:
    """Lay out the members of ``zip_path`` that ``rules`` map (target -> bytes); a member
    matching ``nested`` is a zip laid out by ``inner``. On any failure what was written is
    removed again."""
    written: dict[str, int] = {}
    try:
        with zipfile.ZipFile(zip_path) as zf:
            _check_members(zf, zip_path.name)
            for info in zf.infolist():
                if nested and re.match(nested, info.filename):
                    inner_zip = _write_member(zf, info, to, f".{zip_path.name}.inner.zip")
                    try:
                        written |= extract(inner_zip, to, inner)
                    finally:
                        inner_zip.unlink(missing_ok=True)
                elif (target := _target(info.filename, rules)) is not None:
                    _write_member(zf, info, to, target)
                    written[target] = info.file_size
    except zipfile.BadZipFile as exc:
        remove_laid_out(to, written)
        raise FetchError(f"{zip_path.name} is not a readable zip ({exc})") from None
    except BaseException:
        remove_laid_out(to, written)
        raise
    return written


def remove_laid_out(to: Path, targets: dict[str, int]) -> None:
    """Remove the files ``extract`` wrote (folders stay: they may have been there before)."""
    for target in targets:
        (to / target).unlink(missing_ok=True)
