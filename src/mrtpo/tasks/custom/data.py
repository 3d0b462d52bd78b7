"""Reading a user's prompts: JSONL / JSON / parquet / CSV files, saved or hub HF datasets.

Every source becomes plain dict rows, read-only, nothing written beside them: JSONL, JSON and
CSV parsed directly, parquet with pyarrow; only a hub id or a ``save_to_disk`` folder goes
through ``datasets`` (its caches live in the user's HF cache).
"""

from __future__ import annotations

import csv
import io
import json
import stat
from pathlib import Path
from typing import Any

FILE_FORMATS = {f".{f}": f for f in ("jsonl", "json", "parquet", "csv")} | {".ndjson": "jsonl"}
FORMATS = ("jsonl", "json", "parquet", "csv", "hf")
CSV_FIELD_LIMIT = 1 << 30  # characters in one CSV field


def detect_format(path: str, given: str | None, key: str, path_key: str = "task.data.path") -> str:
    """The reader for ``path``: ``given`` if set, else from the extension; a path not on disk
    is a hub dataset id, unless it can only be a file or folder (``looks_local``: refused at
    once). ``key`` / ``path_key``: the config keys of the format and the path, for errors."""
    if given:
        if given not in FORMATS:
            raise ValueError(f"{key}={given!r} is not a supported format; use one of {FORMATS}")
        if given != "hf" or Path(path).exists() or not looks_local(path):
            return given
    p = Path(path)
    _refuse_special(path, path_key)
    if not p.exists() and looks_local(path):
        raise FileNotFoundError(
            f"{path_key}={path}: no such file (a relative path is read from the folder the "
            f"command started in, {Path.cwd()}); give the path of your data file"
        )
    if p.is_file():
        fmt = FILE_FORMATS.get(p.suffix.lower())
        if fmt is None:
            raise ValueError(
                f"cannot tell the format of {path} from its extension ({p.suffix or 'none'}); "
                f"set {key} to one of {FORMATS}"
            )
        return fmt
    return "hf"  # a saved dataset folder, a folder of data files, or a hub id


def looks_local(path: str) -> bool:
    """Whether ``path`` can only name a file or folder, never a hub dataset id (``owner/name``
    or ``name``): it ends in a data file's extension, starts like a path (``/``, ``.``, ``~``)
    or has more than one ``/``."""
    text = str(path)
    return (
        Path(text).suffix.lower() in FILE_FORMATS
        or text.startswith(("/", ".", "~"))
        or text.count("/") > 1
        or "\\" in text
    )


def _refuse_special(path: str, key: str) -> None:
    """A FIFO, socket or device is on disk but is no data file: say so (never open it: a
    FIFO blocks until something writes to it)."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "not a regular file"
        raise ValueError(
            f"{key}={path} is {kind}; the data is read more than once, so give a regular file "
            "(copy the stream to one first)"
        )


def read_rows(
    path: str, fmt: str, *, split: str | None, name: str | None, key: str
) -> list[dict[str, Any]]:
    """All rows of one source. ``split`` / ``name`` apply to HF datasets only; ``key`` is the
    config key that set ``path``, for error messages. Text files are UTF-8, with or without a
    byte-order mark; every error names the file (and the line where there is one)."""
    if fmt != "hf":
        _refuse_special(path, key)
        if not Path(path).is_file():
            what = "a folder, not a file" if Path(path).is_dir() else "no such file"
            raise FileNotFoundError(f"{key}={path}: {what}")
    if fmt in ("jsonl", "json"):
        return _check_dicts((_read_jsonl if fmt == "jsonl" else _read_json)(path), path)
    if fmt == "csv":
        return _read_csv(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow's errors do not name the file
            raise ValueError(f"{path}: not a readable parquet file ({exc})") from exc
    return _read_hf(path, split=split, name=name, key=key)


def decode_utf8(raw: bytes, path: str, first_line: int = 1) -> str:
    """``raw`` as UTF-8, or an error naming the line. A byte-order mark is dropped at the
    start of the file only (``first_line`` 1), as the evaluation's readers do."""
    try:
        return raw.decode("utf-8-sig" if first_line == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + raw.count(b"\n", 0, exc.start)
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {column}); "
            "save the file as UTF-8"
        ) from None


def _read_jsonl(path: str) -> list[Any]:
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = decode_utf8(raw, path, n)
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from exc
            except RecursionError:
                raise ValueError(f"{path}:{n}: JSON nested too deeply to read") from None
    return rows


def _read_json(path: str) -> Any:
    text = decode_utf8(Path(path).read_bytes(), path)
    if not text.strip():
        raise ValueError(f"{path}: the file is empty; expected a JSON list of rows")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
        ) from exc
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None
    if isinstance(data, dict):  # {"data": [...]} or a single list-valued field
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: expected a JSON list of rows (or one list field)")
        data = lists[0]
    return data


def _read_csv(path: str) -> list[dict[str, Any]]:
    """CSV rows. Fields may be as long as ``CSV_FIELD_LIMIT`` (``csv``'s own default of
    128 KiB is too short for long prompts); the module-wide limit is restored afterwards."""
    text = decode_utf8(Path(path).read_bytes(), path)
    old = csv.field_size_limit()
    csv.field_size_limit(max(old, CSV_FIELD_LIMIT))
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        return list(reader)
    except csv.Error as exc:
        raise ValueError(f"{path}:{reader.reader.line_num}: not valid CSV ({exc})") from exc
    finally:
        csv.field_size_limit(old)


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
    return list(dict.fromkeys(k for r in rows[:1000] for k in r))
