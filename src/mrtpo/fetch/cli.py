"""``python -m mrtpo.data``: fetch the public data sets into the layout the tasks read.

Usage, checksums and refusals: docs/data.md. Exit status: 0 all good, 1 something refused,
missing or wrong (one line each), 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from mrtpo.fetch.download import (
    FetchError,
    already_there,
    check_no_links,
    download,
    extract,
    lay_out,
    sha256_of,
)
from mrtpo.fetch.registry import DATASETS, Archive, DataSet, Remote, base_url
from mrtpo.safe_files import write_atomic

RECORD = "FETCHED.json"


class UsageError(Exception):
    """A command line that names something wrong; the message is one line."""


def _load_record(to: Path) -> dict[str, Any]:
    path = to / RECORD
    try:
        rec = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc}); remove it to start over") from None
    return {"files": {}, "archives": {}, **rec}


def _key(r: Remote | Archive) -> str:
    return r.target if isinstance(r, Remote) else r.name


def _wanted(r: Remote | Archive, kind: str, rec: dict[str, Any]) -> str | None:
    """The sha256 a file must have: the committed one, else the one pinned in the record."""
    return r.sha256 or rec[kind].get(_key(r), {}).get("sha256")


def _entry(r: Remote | Archive, sha: str, n: int, url: str) -> dict[str, Any]:
    """What ``FETCHED.json`` records of one download."""
    how = "committed" if r.sha256 else "pinned"
    return {"sha256": sha, "bytes": n, "source": url, "checksum": how}


def _refuse_unknown(label: str, to: Path) -> FetchError:
    return FetchError(
        f"{label}: no checksum is committed for it (the project never downloaded it); rerun "
        f"with --trust-first-download to accept this download and pin its sha256 in {to / RECORD}"
    )


def fetch_file(
    r: Remote, to: Path, rec: dict, mirrors: dict, trust: bool, replace: bool = False
) -> str:
    """Get one file unless it is already there and right; what happened, in a word."""
    dest, want = to / r.target, _wanted(r, "files", rec)
    if want and dest.is_file() and sha256_of(dest) == want:
        return "present"
    if want is None and not trust:
        raise _refuse_unknown(r.target, to)
    check_no_links(to, r.target)
    if dest.exists() and not replace:
        raise already_there(dest) if want else already_there(dest, "no checksum vouches for it")
    url = f"{base_url(r.host, mirrors)}/{r.path}"
    sha, n = download(url, dest, want, r.size, r.max_bytes)
    rec["files"][r.target] = _entry(r, sha, n, url)
    return "fetched"


def fetch_archive(
    a: Archive, to: Path, rec: dict, mirrors: dict, trust: bool, replace: bool = False
) -> str:
    """Get, check and lay out one archive (staging folder always removed) unless already there."""
    want, old = _wanted(a, "archives", rec), rec["archives"].get(a.name)
    if old and want and not _archive_problems(a, to, rec):
        return "present"
    if want is None and not trust:
        raise _refuse_unknown(a.name, to)
    for e in a.expect:
        check_no_links(to, e)
    url = f"{base_url(a.host, mirrors)}/{a.path}"
    staging = to / f".staging-{a.name}"
    try:
        staging.mkdir(mode=0o700)  # a new private folder for the download, never an old one
    except FileExistsError:
        raise FetchError(
            f"{staging} is already there (left by an interrupted fetch?); remove it and rerun"
        ) from None
    try:
        sha, n = download(url, staging / "archive", want, a.size, a.max_bytes, name=a.name)
        out = staging / "out"
        members = extract(staging / "archive", out, a.rules, a.nested, a.inner, a.max_bytes)
        missing = [e for e in a.expect if not (out / e).exists()]
        if missing:
            raise FetchError(f"{a.name} ({url}) did not hold {', '.join(missing)}; nothing kept")
        lay_out(out, to, members, replace)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    rec["archives"][a.name] = {**_entry(a, sha, n, url), "members": members}
    return "fetched"


def _items(names: list[str]) -> list[Remote | Archive]:
    """The files and archives of ``names``, each target once, in order."""
    items: dict[str, Remote | Archive] = {}
    for name in names:
        for item in (*DATASETS[name].files, *DATASETS[name].archives):
            items.setdefault(_key(item), item)
    return list(items.values())


def run_fetch(names: list[str], to: Path, mirrors: dict, trust: bool, replace: bool = False) -> int:
    to.mkdir(parents=True, exist_ok=True)
    rec, failed, counts = _load_record(to), 0, {"present": 0, "fetched": 0}
    for item in _items(names):
        fn = fetch_file if isinstance(item, Remote) else fetch_archive
        try:
            counts[fn(item, to, rec, mirrors, trust, replace)] += 1
        except FetchError as exc:
            failed += 1
            print(f"refused: {exc}", file=sys.stderr)
            continue
        # the record after each download, whole or not at all, never through a link
        write_atomic(to / RECORD, json.dumps(rec, indent=1, sort_keys=True) + "\n")
    print(
        f"{', '.join(names)} -> {to}: {counts['fetched']} fetched, {counts['present']} already "
        f"present, {failed} refused"
    )
    return 1 if failed else 0


def _file_state(r: Remote, to: Path, rec: dict) -> str:
    dest, want = to / r.target, _wanted(r, "files", rec)
    if not dest.is_file():
        return "missing"
    if r.size is not None and dest.stat().st_size != r.size:
        return "wrong"
    if want is None:
        return "unverified"
    return "present" if sha256_of(dest) == want else "wrong"


def _archive_problems(a: Archive, to: Path, rec: dict) -> list[tuple[str, str]]:
    """(path, "missing") of each expected path absent or laid-out member gone, (member,
    "wrong") of each whose size changed."""
    out = [(e, "missing") for e in a.expect if not (to / e).exists()]
    for target, size in rec["archives"].get(a.name, {}).get("members", {}).items():
        p = to / target
        if not p.is_file():
            out.append((target, "missing"))
        elif p.stat().st_size != size:
            out.append((target, "wrong"))
    return out


def _states(d: DataSet, to: Path, rec: dict) -> dict[str, list[str]]:
    """state (present, missing, wrong, unverified) -> the targets of ``d`` in it."""
    states: dict[str, list[str]] = {}
    for r in d.files:
        states.setdefault(_file_state(r, to, rec), []).append(r.target)
    for a in d.archives:
        problems = _archive_problems(a, to, rec)
        if a.name not in rec["archives"] and len(problems) == len(a.expect):
            problems = [(e, "missing") for e in a.expect]  # never fetched: nothing laid out
        for target, state in problems:
            states.setdefault(state, []).append(target)
        if not problems:
            states.setdefault("present", []).append(a.name)
    return states


def run_check(names: list[str], to: Path, every: bool = False) -> int:
    """One line per data set, then one per file wrong, missing or unverified; with ``every``
    (no names given) a data set wholly absent is only "not fetched"."""
    rec, bad = _load_record(to), 0
    for name in names:
        states = _states(DATASETS[name], to, rec)
        if every and set(states) == {"missing"}:
            print(f"{name}: not fetched")
            continue
        bad += len(states.get("missing", [])) + len(states.get("wrong", []))
        print(f"{name}: " + ", ".join(f"{len(v)} {k}" for k, v in sorted(states.items())))
        for state in ("wrong", "missing", "unverified"):
            for target in states.get(state, []):
                print(f"  {state}: {target}")
    return 1 if bad else 0


def run_list() -> int:
    for d in DATASETS.values():
        items = [*d.files, *d.archives]
        unknown = sum(1 for i in items if i.sha256 is None)
        pin = f"; {unknown} without a committed checksum" if unknown else ""
        print(f"{d.name:<18} {d.what} ({len(items)} download(s){pin})")
    return 0


def _names(given: list[str], default_all: bool) -> list[str]:
    if not given or given == ["all"]:
        if default_all or given == ["all"]:
            return list(DATASETS)
        raise UsageError(f"name the data sets to fetch (or all): {', '.join(DATASETS)}")
    unknown = [n for n in given if n not in DATASETS]
    if unknown:
        raise UsageError(f"unknown data set {unknown[0]!r}; choose from: {', '.join(DATASETS)}")
    return given


def _mirrors(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        host, sep, url = pair.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise UsageError(
                f"--mirror {pair!r}: write HOST=http(s)://... (hosts: github, hub, ...)"
            )
        out[host] = url
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mrtpo.data", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the data sets this command knows")
    f = sub.add_parser("fetch", help="download, check and lay out data sets")
    f.add_argument("names", nargs="*", help="data sets (see `list`), or all")
    f.add_argument("--to", type=Path, help="the data folder (use it as paths.data_dir)")
    f.add_argument("--check", type=Path, metavar="DIR", help="say what is present/missing/wrong")
    f.add_argument(
        "--trust-first-download",
        action="store_true",
        help="accept files with no committed checksum and pin their sha256 in DIR/FETCHED.json",
    )
    f.add_argument(
        "--replace",
        action="store_true",
        help="overwrite files already in DIR that differ from the ones fetched (default: refuse)",
    )
    f.add_argument(
        "--mirror",
        action="append",
        default=[],
        metavar="HOST=URL",
        help="serve HOST (github, hub, gdrive, bird, zenodo) from URL; or MRTPO_FETCH_<HOST>",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            return run_list()
        if args.check is not None:
            if not args.check.is_dir():
                raise UsageError(f"--check {args.check}: no such folder")
            names = _names(args.names, default_all=True)
            return run_check(names, args.check, every=not args.names or args.names == ["all"])
        if args.to is None:
            raise UsageError("fetch needs --to DIR (the folder to use as paths.data_dir)")
        if args.to.exists() and not args.to.is_dir():
            raise UsageError(f"--to {args.to} is a file, not a folder")
        names = _names(args.names, default_all=False)
        mirrors, trust = _mirrors(args.mirror), args.trust_first_download
        return run_fetch(names, args.to, mirrors, trust, args.replace)
    except UsageError as exc:
        print(f"python -m mrtpo.data: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the data folder cannot be written, disk full, ...
        print(f"python -m mrtpo.data: {exc.strerror or exc}: {exc.filename or ''}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
