"""Streaming downloads that land only when whole and right, and zips laid out safely
(docs/data.md). A download goes to a new temp file, never an old one resumed (which could be
half-written); nothing is written through a symbolic link under the data folder.
"""

from __future__ import annotations

import filecmp
import hashlib
import http.client
import json
import os
import re
import secrets
import shutil
import stat
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath

CHUNK = 1 << 20
#: seconds a connection may stay silent (a hang guard, not a limit on the whole download)
TIMEOUT_S = 60.0
#: a member that unpacks to more than this many times its compressed size is refused...
MAX_RATIO = 200
#: ...when it unpacks to more than this (small files of one repeated byte are common)
RATIO_FROM = 4 << 20


class FetchError(Exception):
    """A download or archive that was refused; the message is one line."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()  # not hashlib.file_digest: Python 3.10 (supported) has none
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
        raise FetchError(f"cannot reach {url} ({getattr(exc, 'reason', exc)})") from None


def _too_big(url: str, max_bytes: int) -> FetchError:
    return FetchError(f"{url} sends more than {max_bytes} bytes (its max_bytes); nothing kept")


def _stream(url: str, tmp: Path, max_bytes: int) -> tuple[str, int, int | None]:
    """Write ``url``'s body to the new file ``tmp``: (sha256, bytes received, bytes announced
    or None). More than ``max_bytes`` (announced or received) is refused."""
    h, n = hashlib.sha256(), 0
    with _open(url) as resp, open(tmp, "xb") as out:  # "x": a new file, never one already there
        announced = resp.headers.get("Content-Length")
        announced = int(announced) if announced and announced.isdigit() else None
        if announced is not None and announced > max_bytes:
            raise _too_big(url, max_bytes)
        try:
            for block in iter(lambda: resp.read(CHUNK), b""):
                n += len(block)
                if n > max_bytes:
                    raise _too_big(url, max_bytes)
                h.update(block)
                out.write(block)
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
    url: str,
    dest: Path,
    sha256: str | None,
    size: int | None,
    max_bytes: int,
    name: str | None = None,
) -> tuple[str, int]:
    """Fetch ``url`` to ``dest`` if whole and right: (sha256, bytes). With ``sha256=None``
    the content is accepted when its format fits ``name`` (the caller pins what arrived).
    The caller has checked that ``dest``'s folders under the data folder are not links."""
    made = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]  # deepest first
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(8)}.part")
    done = False
    try:
        got, n, announced = _stream(url, tmp, max_bytes)
        if announced is not None and n != announced:
            raise FetchError(f"truncated download: {n} of {announced} bytes ({url})")
        if size is not None and n != size:
            raise FetchError(f"wrong size: {n} bytes, expected {size} ({url})")
        if sha256 is not None and got != sha256:
            raise FetchError(f"checksum mismatch: sha256 {got}, expected {sha256} ({url})")
        if sha256 is None and (why := format_problem(tmp, name or dest.name)):
            raise FetchError(f"{why}: {url} sent something else (an error page?)")
        os.replace(tmp, dest)
        done = True
        return got, n
    finally:
        tmp.unlink(missing_ok=True)
        for folder in made if not done else ():  # only the empty folders this call made
            try:
                folder.rmdir()
            except OSError:
                break


def _safe_name(name: str) -> bool:
    p = PurePosixPath(name)
    return not (p.is_absolute() or "\\" in name or ".." in p.parts or re.match(r"^[A-Za-z]:", name))


def _plan(
    zf: zipfile.ZipFile, rules: Sequence[tuple[str, str]], nested: str | None, label: str
) -> list[tuple[zipfile.ZipInfo, str | None]]:
    """(member, target) of each member to unpack (the first matching rule's; None: a nested
    zip). An archive holding an absolute or escaping name, or a symlink, is refused whole."""
    plan: list[tuple[zipfile.ZipInfo, str | None]] = []
    for info in zf.infolist():
        name = info.filename
        if not _safe_name(name):
            raise FetchError(f"{label}: unsafe member name {name!r}; nothing extracted")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise FetchError(f"{label}: member {name!r} is a symlink; nothing extracted")
        if nested and re.match(nested, name):
            plan.append((info, None))
        elif not name.startswith("__MACOSX/") and not name.endswith("/"):
            for pattern, template in rules:
                if m := re.match(pattern, name):
                    plan.append((info, m.expand(template)))
                    break
    return plan


def _check_sizes(plan: list[tuple[zipfile.ZipInfo, str | None]], label: str, budget: int) -> None:
    """Refuse before unpacking: members adding up past ``budget``, or one that expands more
    than MAX_RATIO times. zipfile stops reading a member at its declared size, so a header
    that understates the size cannot unpack more than it declares."""
    total = sum(info.file_size for info, _ in plan)
    if total > budget:
        raise FetchError(
            f"{label} would unpack {total} bytes, more than {budget} bytes (its max_bytes); "
            "nothing kept"
        )
    for info, _ in plan:
        ratio = info.file_size // max(info.compress_size, 1)
        if info.file_size > RATIO_FROM and ratio > MAX_RATIO:
            raise FetchError(
                f"{label}: member {info.filename!r} would expand {ratio}:1 to {info.file_size} "
                "bytes (a zip bomb?); nothing kept"
            )


def _write_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, to: Path, target: str) -> Path:
    dest = (to / target).resolve()
    if not _safe_name(target) or not dest.is_relative_to(to.resolve()):
        raise FetchError(f"member {info.filename!r} would land outside {to}; nothing kept")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zf.open(info) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, CHUNK)
    return dest


def extract(
    zip_path: Path,
    out: Path,
    rules: Sequence[tuple[str, str]],
    nested: str | None = None,
    inner: Sequence[tuple[str, str]] = (),
    budget: int = 4 << 30,
) -> dict[str, int]:
    """Unpack the members of ``zip_path`` that ``rules`` map into ``out`` (target -> bytes);
    a member matching ``nested`` is a zip unpacked by ``inner``. ``out`` and its parent are a
    staging folder the caller made and removes; nothing here touches the data folder."""
    written: dict[str, int] = {}
    try:
        with zipfile.ZipFile(zip_path) as zf:
            plan = _plan(zf, rules, nested, zip_path.name)
            _check_sizes(plan, zip_path.name, budget)
            for info, target in plan:
                if target is None:
                    inner_zip = _write_member(
                        zf, info, out.parent, PurePosixPath(info.filename).name
                    )
                    left = budget - sum(written.values()) - info.file_size
                    try:
                        written |= extract(inner_zip, out, inner, None, (), left)
                    finally:
                        inner_zip.unlink(missing_ok=True)
                else:
                    _write_member(zf, info, out, target)
                    written[target] = info.file_size
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{zip_path.name} is not a readable zip ({exc}); nothing kept") from None
    return written


def check_no_links(to: Path, rel: str) -> None:
    """Refuse to write ``rel`` under ``to`` if a path on the way (or the file) is a symbolic
    link: the command never writes through a link it did not make. ``to`` itself may be one."""
    p = to
    for part in PurePosixPath(rel).parts:
        p = p / part
        if p.is_symlink():
            raise FetchError(
                f"{p} is a symbolic link; fetch never writes through a link it did not make: "
                "make it a real folder, or fetch into another folder and move the files"
            )
        if not p.exists():
            return


def already_there(dest: Path, why: str = "differs from the file fetch would lay out") -> FetchError:
    return FetchError(
        f"{dest} is already there and {why}; fetch does not overwrite it: move it away, or "
        "rerun with --replace"
    )


def lay_out(out: Path, to: Path, targets: Iterable[str], replace: bool) -> None:
    """Move the staged files ``targets`` from ``out`` into ``to``. Every target is checked
    first: none may be under a link, and a file already there must be the same (then it is
    kept as it is) unless ``replace``. If a move fails, the files this call created are
    removed again; a file that was there before is never removed."""
    moves = []
    for target in targets:
        check_no_links(to, target)
        dest = to / target
        if dest.exists():
            if dest.is_file() and filecmp.cmp(out / target, dest, shallow=False):
                continue
            if not replace:
                raise already_there(dest)
        moves.append(target)
    created: list[Path] = []
    try:
        for target in moves:
            dest = to / target
            existed = dest.exists()
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(out / target, dest)
            if not existed:
                created.append(dest)
    except BaseException:
        for p in created:
            p.unlink(missing_ok=True)
        raise
