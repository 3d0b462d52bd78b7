"""The files a paper preset trains on: present and in the paper's layout, or the run is refused.

A preset of ``configs/experiment/`` whose paper setting reads data files lists them under
``paper_data``, one entry per config key that holds a path::

    paper_data:
      task.data.path:
        what: HIR-16K as released (HIR_trainv1.jsonl of the hub dataset sastpg/HIR-16K)
        layouts: [[source, prompt, criteria, ground_truth], [data_source, reward_model]]

``layouts`` (optional): the file's first row must hold every field of one of them. Without
it an entry may name a folder (``kind: folder``) or a list of them; ``unless_set`` keys supply
the data another way (``task.splits.train.hub``) and skip the entry. Before anything loads
(``pipeline.prepare``) an unset key, a missing path or another layout is refused naming the
key, the path and the expected file: a paper preset never falls back to other data (the
instruction presets trained on the generated set without a word).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mrtpo.run.settings import ConfigError

#: How many bytes of a JSON-lines file are read to find its first row.
FIRST_LINE_BYTES = 1 << 24


def first_row(path: Path) -> dict[str, Any] | None:
    """The field names of the first row of a .jsonl, .json (a list) or .parquet file, as a
    dict (values of JSON rows kept); None when the file holds no row."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path)
        return dict.fromkeys(meta.schema_arrow.names) if meta.metadata.num_rows else None
    if suffix == ".jsonl":
        with open(path, encoding="utf-8-sig") as f:
            for line in iter(lambda: f.readline(FIRST_LINE_BYTES), ""):
                if line.strip():
                    row = json.loads(line)
                    return row if isinstance(row, dict) else {}
        return None
    data = json.loads(path.read_text(encoding="utf-8-sig"))
    rows = data if isinstance(data, list) else [data]
    return (rows[0] if isinstance(rows[0], dict) else {}) if rows else None


def _layout_problem(path: Path, layouts: list[list[str]]) -> str | None:
    """Why ``path``'s first row is in none of ``layouts`` (None: it is in one)."""
    try:
        row = first_row(path)
    except Exception as exc:  # not JSON, not parquet, not UTF-8: the reader's words
        return f"cannot be read as rows ({type(exc).__name__}: {str(exc)[:200]})"
    if row is None:
        return "holds no row"
    if any(all(f in row for f in layout) for layout in layouts):
        return None
    wanted = " or ".join("{" + ", ".join(layout) + "}" for layout in layouts)
    return f"is not in the paper's layout: its first row has {sorted(row)[:12]}, not {wanted}"


def entry_problems(key: str, value: Any, spec: Mapping[str, Any]) -> list[str]:
    """What is wrong with the path(s) at ``key`` for the paper's data ``spec`` (none: [])."""
    what = str(spec.get("what") or "the paper's data")
    if value in (None, "", []):
        return [f"{key} is not set: it must name {what}"]
    paths = [Path(str(v)) for v in value] if isinstance(value, (list, tuple)) else [Path(value)]
    folder = spec.get("kind") == "folder"
    problems = []
    for p in paths:
        if folder and not p.is_dir():
            problems.append(f"{key}={p}: no such folder; it must be {what}")
        elif not folder and not p.is_file():
            problems.append(f"{key}={p}: no such file; it must be {what}")
        elif not folder and spec.get("layouts"):
            why = _layout_problem(p, [list(map(str, lay)) for lay in spec["layouts"]])
            if why:
                problems.append(f"{key}={p} {why}; it must be {what}")
    return problems


def problems(cfg) -> list[str]:
    """One line per problem with the preset's ``paper_data`` files ([] when none)."""
    from omegaconf import OmegaConf

    declared = OmegaConf.select(cfg, "paper_data", default=None)
    if not declared:
        return []
    out = []
    for key, spec in OmegaConf.to_container(declared, resolve=False).items():
        spec = spec if isinstance(spec, Mapping) else {}
        if any(OmegaConf.select(cfg, str(k), default=None) for k in spec.get("unless_set") or []):
            continue
        value = OmegaConf.select(cfg, str(key), default=None, throw_on_missing=False)
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        out += entry_problems(str(key), value, spec)
    return out


def check_paper_data(cfg) -> None:
    """Refuse (``ConfigError``) a preset whose paper data is missing or in another layout,
    naming the key, the path and what the file must be."""
    from mrtpo.run.placement import _preset

    found = problems(cfg)
    if found:
        more = f" (and {len(found) - 1} more: dry_run=true lists them)" if len(found) > 1 else ""
        raise ConfigError(
            f"{_preset(cfg)}trains on the paper's data, and {found[0]}{more}. Put the file "
            "there or point the key at it (docs/tasks/); a preset never trains on other data"
        )
