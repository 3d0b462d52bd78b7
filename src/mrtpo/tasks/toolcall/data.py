"""Loaders for ToolRL's RLLA data, in either of its two published layouts.

- RL (``rlla_4k*``; json, jsonl or parquet): ``prompt`` (chat messages: system prompt with the
  tool list, then the dialogue) and ``reward_model.ground_truth`` (gold answer, placeholder
  reasoning).
- SFT (``rlla_sft.json``): ``instruction`` (system prompt), ``input`` (dialogue) and ``output``
  (gold answer with distilled reasoning).

Both give the same ``data``: the tools (``name -> parameter schema``, to coerce argument types),
the reference calls (``None`` when the gold answers directly) and the answer tags the gold
implies. Rows whose gold calls do not parse cannot be scored and are dropped (counted in the log).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mrtpo.tasks.base import Example
from mrtpo.tasks.toolcall.parsing import (
    ParseError,
    answer_part,
    coerce_calls,
    parse_tools,
    reference_calls,
    reference_tags,
    tools_by_name,
)

log = logging.getLogger(__name__)


def _jsonl_rows(p: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a bad line fails naming ``file:line`` and the problem."""
    rows = []
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{p}:{lineno}: not valid UTF-8 (byte {exc.start + 1} of the line); RLLA "
                    "files are UTF-8 JSON lines (task.data_files.<split>)"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{p}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); each "
                    "line of an RLLA .jsonl file must be one JSON object"
                ) from None
            except (ValueError, RecursionError) as exc:  # e.g. an integer too long to convert
                raise ValueError(f"{p}:{lineno}: cannot be decoded ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{p}:{lineno}: a JSON {type(row).__name__}, not an object; each line of an "
                    "RLLA .jsonl file must be one row object"
                )
            rows.append(row)
    return rows


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``.json`` (a list, or ``{"data": [...]}``), ``.jsonl`` or ``.parquet`` file;
    a malformed one is a ``ValueError`` naming the file and, where known, the line."""
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
        return _jsonl_rows(p)
    if suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{p}: not valid UTF-8 (byte offset {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{p}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{p}: expected a JSON list of rows")
        bad = next((i for i, row in enumerate(data) if not isinstance(row, dict)), None)
        if bad is not None:
            raise ValueError(f"{p}: row {bad} is a JSON {type(data[bad]).__name__}, not an object")
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


def typed_reference(reference: str, calls: list[dict[str, Any]] | None, tools: dict) -> str:
    """``reference`` with calls whose quoted numbers or booleans the schema types rewritten as
    the typed JSON the correctness reward compares with (other lines verbatim). The published
    text (``"page": "1"`` for an int) would not score full marks against itself; this does, so
    an SFT warm start on it teaches the form the reward wants.
    """
    if not calls:
        return reference
    typed = coerce_calls(calls, tools)
    # coerce_value returns the very same object for a value it leaves alone
    changed = [
        any(t["parameters"][k] is not v for k, v in c["parameters"].items())
        for c, t in zip(calls, typed, strict=True)
    ]
    if not any(changed):
        return reference
    tail = answer_part(reference)
    head = reference[: len(reference) - len(tail)]
    start = tail.rfind("<tool_call>") + len("<tool_call>")
    end = tail.find("</tool_call>", start)
    block = tail[start:end]
    core = block.strip()
    lead = block[: len(block) - len(block.lstrip())]
    trail = block[len(block.rstrip()) :]
    lines = core.split("\n")
    new = [
        json.dumps(t, ensure_ascii=False) if ch else line
        for line, t, ch in zip(lines, typed, changed, strict=True)
    ]
    return head + tail[:start] + lead + "\n".join(new) + trail + tail[end:]


def example_from_row(row: dict[str, Any], example_id: str) -> Example:
    """One RLLA row (either layout) as an ``Example``; raises ``ParseError`` if unusable."""
    messages, reference = _messages_and_reference(row)
    system = next((m["content"] for m in messages if m["role"] == "system"), "")
    tools = tools_by_name(parse_tools(system))
    calls = reference_calls(reference)
    reference = typed_reference(reference, calls, tools)
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
