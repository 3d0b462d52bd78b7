"""Loaders for ToolRL's RLLA data, in either of its two published layouts.

- RL layout (``rlla_4k*``; json, jsonl or parquet): ``prompt`` (chat messages: the system
  prompt with the tool list, then the dialogue) and ``reward_model.ground_truth`` (the gold
  answer, whose reasoning is a placeholder).
- SFT layout (``rlla_sft.json``): ``instruction`` (the system prompt), ``input`` (the
  dialogue) and ``output`` (the gold answer with distilled reasoning).

Both become ``Example``s with the same ``data``: the tools parsed from the system prompt
(``name -> parameter schema``, used to coerce argument types), the
reference calls (``None`` when the gold answers directly) and the answer tags the gold
implies. Rows whose gold calls cannot be parsed cannot be scored and are dropped (counted
in the log).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mrtpo.tasks.base import Example
from mrtpo.tasks.toolcall.parsing import (
    ParseError,
    parse_tools,
    reference_calls,
    reference_tags,
    tools_by_name,
)

log = logging.getLogger(__name__)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``.json`` (a list, or ``{"data": [...]}``), ``.jsonl`` or ``.parquet`` file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"RLLA data file not found: {p} (set task.data_files.<split> or paths.data_dir)"
        )
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # comes with `datasets`; imported only when needed

        return pq.read_table(p).to_pylist()
    if suffix == ".jsonl":
        with open(p, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{p}: expected a JSON list of rows")
        return data
    raise ValueError(f"{p}: unsupported data file type {suffix!r} (use .json, .jsonl, .parquet)")


def _messages_and_reference(row: dict[str, Any]) -> tuple[list[dict[str, str]], str]:
    if "prompt" in row:  # RL layout
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["prompt"]]
        rm = row.get("reward_model") or {}
        ref = rm.get("ground_truth") if isinstance(rm, dict) else None
        if ref is None:
            ref = (row.get("extra_info") or {}).get("output")
        if not isinstance(ref, str):
            raise ParseError("RL row has no reward_model.ground_truth string")
        return msgs, ref
    if "instruction" in row and "output" in row:  # SFT layout
        msgs = []
        if row["instruction"]:
            msgs.append({"role": "system", "content": str(row["instruction"])})
        msgs.append({"role": "user", "content": str(row.get("input") or "")})
        return msgs, str(row["output"])
    raise ParseError(
        "row is neither RL layout (prompt, reward_model) nor SFT layout (instruction, input, output)"
    )


def example_from_row(row: dict[str, Any], example_id: str) -> Example:
    """One RLLA row (either layout) as an ``Example``; raises ``ParseError`` if unusable."""
    messages, reference = _messages_and_reference(row)
    system = next((m["content"] for m in messages if m["role"] == "system"), "")
    tools = tools_by_name(parse_tools(system))
    calls = reference_calls(reference)
    data = {
        "source": "rlla",
        "tools": tools,
        "reference_calls": calls,
        "tags": reference_tags(reference),
    }
    return Example(id=example_id, messages=messages, data=data, reference=reference)


def load_rlla(path: str | Path, limit: int | None = None) -> list[Example]:
    """Examples of one RLLA file; ids are ``<file stem>-<row index>``."""
    rows = read_rows(path)
    stem = Path(path).stem
    out: list[Example] = []
    dropped: dict[str, int] = {}
    for i, row in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        try:
            out.append(example_from_row(row, f"{stem}-{i}"))
        except ParseError as exc:
            dropped[str(exc)] = dropped.get(str(exc), 0) + 1
    if dropped:
        log.warning(
            "%s: dropped %d of %d rows whose reference cannot be scored: %s",
            path,
            sum(dropped.values()),
            len(rows),
            dropped,
        )
    log.info("loaded %d tool-calling examples from %s", len(out), path)
    return out
