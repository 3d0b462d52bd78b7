"""Reading a user's prompts: JSONL / JSON / parquet / CSV files, saved or hub HF datasets.

Every source becomes a list of plain dict rows. Files are opened read-only and nothing is
written next to them: JSONL, JSON and CSV are parsed directly, parquet with pyarrow, and
only a hub id or a ``save_to_disk`` folder goes through ``datasets`` (whose caches live in
the user's HF cache, never beside the data).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

FILE_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
FORMATS = ("jsonl", "json", "parquet", "csv", "hf")


def detect_format(path: str, given: str | None, key: str) -> str:
    """The reader for ``path``: ``given`` if set, else from the extension; a path that is
    not on disk is taken to be a hub dataset id."""
    if given:
        if given not in FORMATS:
            raise ValueError(f"{key}={given!r} is not a supported format; use one of {FORMATS}")
        return given
    p = Path(path)
    if p.is_file():
        fmt = FILE_FORMATS.get(p.suffix.lower())
        if fmt is None:
            raise ValueError(
                f"cannot tell the format of {path} from its extension ({p.suffix or 'none'}); "
                f"set {key} to one of {FORMATS}"
            )
        return fmt
    return "hf"  # a saved dataset folder, a folder of data files, or a hub id


def read_rows(
    path: str,
    fmt: str,
    *,
    split: str | None,
    name: str | None,
    key: str,
) -> list[dict[str, Any]]:
    """All rows of one source. ``split`` / ``name`` apply to HF datasets only; ``key`` is the
    config key that set ``path``, for error messages."""
    if fmt != "hf" and not Path(path).is_file():
        raise FileNotFoundError(f"{key}={path}: no such file")
    if fmt == "jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from exc
        return _check_dicts(rows, path)
    if fmt == "json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict):  # {"data": [...]} or a single list-valued field
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise ValueError(f"{path}: expected a JSON list of rows (or one list field)")
            data = lists[0]
        return _check_dicts(data, path)
    if fmt == "csv":
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return _read_hf(path, split=split, name=name, key=key)


def _check_dicts(rows, path: str) -> list[dict[str, Any]]:
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of rows, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"{path}: row {i} is a {type(r).__name__}, not an object")
    return rows


def _read_hf(path: str, *, split: str | None, name: str | None, key: str) -> list[dict]:
    import datasets

    p = Path(path)
    split = split or "train"
    try:
        saved = ("dataset_info.json", "state.json", "dataset_dict.json")
        if p.is_dir() and any((p / f).exists() for f in saved):
            ds = datasets.load_from_disk(str(p))  # save_to_disk: a Dataset or a DatasetDict
        else:
            ds = datasets.load_dataset(path, name, split=split)
    except Exception as exc:
        where = "folder" if p.is_dir() else "hub dataset id (there is no such local file or folder)"
        raise ValueError(
            f"{key}={path}: could not read it as an HF dataset {where}: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{key}={path} has splits {sorted(ds)}, not {split!r}")
        ds = ds[split]
    return ds.to_list()


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """Column names, in first-seen order (rows of a JSONL file may differ in their keys)."""
    seen: dict[str, None] = {}
    for r in rows[:1000]:
        seen.update(dict.fromkeys(r))
    return list(seen)
