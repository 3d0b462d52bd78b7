"""Text formats and data of the tool-calling task: tool lists in the system prompt, tags, tool
calls, and the RLLA loaders.

The response format is ToolRL's: ``<think> ... </think>``, then a ``<tool_call>`` block with
one JSON object ``{"name": ..., "parameters": {...}}`` per line and/or a
``<response> ... </response>`` block. The system prompt lists the tools as numbered
``Name`` / ``Description`` / ``Parameters`` entries (the RLLA data's own layout), which
``parse_tools`` reads back and ``render_tools`` writes (the BFCL prompts reuse it, so a model
trained on RLLA sees the same layout at evaluation).

ToolRL's RLLA data comes in two published layouts, RL (``rlla_4k*``: ``prompt``,
``reward_model.ground_truth``) and SFT (``rlla_sft.json``: ``instruction``, ``input``,
``output``); both load into the same ``data``: tools, reference calls and answer tags. Rows
whose gold calls do not parse cannot be scored and are dropped (counted in the log).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mrtpo.tasks.base import Example

log = logging.getLogger(__name__)

TAGS = ("think", "tool_call", "response")

# Everything between these two headings of the RLLA system prompt is the tool list.
_TOOLS_HEADING = "**Available Tools**"
_STEPS_HEADING = "**Steps for Each Turn**"
_TOOL_START = re.compile(r"^(\d+)\. Name: ", re.M)

_CALL_EXAMPLE = (
    '{"name": "Tool name", "parameters": {"Parameter name": "Parameter content", '
    '"... ...": "... ..."}}\n'
    '{"name": "... ...", "parameters": {"... ...": "... ...", "... ...": "... ..."}}'
)

#: The RLLA system prompt with ``{tools}`` left open (the training data's exact wording, so
#: that prompts built here for BFCL match what the policy saw in training).
SYSTEM_TEMPLATE = (
    "You are a helpful multi-turn dialogue assistant capable of leveraging tool calls to solve "
    "user tasks and provide structured chat responses.\n\n"
    "**Available Tools**\n"
    "In your response, you can use the following tools:\n"
    "{tools}\n\n"
    "**Steps for Each Turn**\n"
    "1. **Think:** Recall relevant context and analyze the current user goal.\n"
    "2. **Decide on Tool Usage:** If a tool is needed, specify the tool and its parameters.\n"
    "3. **Respond Appropriately:** If a response is needed, generate one while maintaining "
    "consistency across user queries.\n\n"
    "**Output Format**\n"
    "```plaintext\n"
    "<think> Your thoughts and reasoning </think>\n"
    "<tool_call>\n" + _CALL_EXAMPLE + "\n...\n</tool_call>\n"
    "<response> AI's final response </response>\n"
    "```\n\n"
    "**Important Notes**\n"
    "1. You must always include the `<think>` field to outline your reasoning. Provide at least "
    "one of `<tool_call>` or `<response>`. Decide whether to use `<tool_call>` (possibly "
    "multiple times), `<response>`, or both.\n"
    "2. You can invoke multiple tool calls simultaneously in the `<tool_call>` fields. Each tool "
    'call should be a JSON object with a "name" field and an "parameters" field containing a '
    'dictionary of parameters. If no parameters are needed, leave the "parameters" field an '
    "empty dictionary.\n"
    "3. Refer to the previous dialogue records in the history, including the user's queries, "
    "previous `<tool_call>`, `<response>`, and any tool feedback noted as `<obs>` (if exists)."
)


class ParseError(ValueError):
    """Text that does not follow the expected layout (the message says where)."""


# ---- tool lists ------------------------------------------------------------------------------
def parse_tools(system_prompt: str) -> list[dict[str, Any]]:
    """Tools of an RLLA-style system prompt, in order, as ``{"name", "description",
    "parameters"}``, text as written (``render_tools`` gives the list back verbatim). No tool
    list: ``[]``; a ``Parameters`` line that is not a JSON object: ``ParseError``."""
    start = system_prompt.find(_TOOLS_HEADING)
    if start < 0:
        return []
    end = system_prompt.find(_STEPS_HEADING, start)
    block = system_prompt[start + len(_TOOLS_HEADING) : end if end >= 0 else None]
    starts = list(_TOOL_START.finditer(block))
    tools: list[dict[str, Any]] = []
    for i, m in enumerate(starts):
        entry = block[m.end() : starts[i + 1].start() if i + 1 < len(starts) else None]
        name, sep, rest = entry.partition("\nDescription: ")
        desc, sep2, params_text = rest.rpartition("\nParameters: ")
        if not sep or not sep2:
            raise ParseError(f"tool entry {m.group(1)} lacks a Description or Parameters line")
        try:
            params = json.loads(params_text.strip())
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"tool {name!r}: Parameters is not JSON ({exc})") from exc
        if not isinstance(params, dict):
            raise ParseError(f"tool {name!r}: Parameters is not a JSON object")
        tools.append({"name": name, "description": desc, "parameters": params})
    return tools


def tools_by_name(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``name -> parameter schema`` for type coercion; the first of duplicate names wins
    (a few RLLA prompts list two tools under one name)."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools:
        out.setdefault(t["name"].strip(), t["parameters"])
    return out


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The numbered tool list of the system prompt (inverse of ``parse_tools``)."""
    return "\n".join(
        f"{i}. Name: {t['name']}\nDescription: {t['description']}\n"
        f"Parameters: {json.dumps(t['parameters'])}"
        for i, t in enumerate(tools, 1)
    )


def system_prompt(tools: list[dict[str, Any]]) -> str:
    """The RLLA system prompt for a list of tools."""
    return SYSTEM_TEMPLATE.replace("{tools}", render_tools(tools))


# ---- tags and calls --------------------------------------------------------------------------
def clean_response(text: str) -> str:
    """The assistant text as the rewards see it: cut at an end-of-turn marker, stripped."""
    for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        text = text.split(marker)[0]
    return text.strip()


def answer_part(reference: str) -> str:
    """The part of a reference after its reasoning (``</think>``), where its tags live: the
    reasoning of 17 of the 400 RLLA SFT rows names ``<tool_call>`` or ``<response>`` in prose."""
    _, sep, tail = reference.partition("</think>")
    return tail if sep else reference


def reference_tags(reference: str) -> tuple[str, ...]:
    """The answer tags a reference implies: ``tool_call`` and/or ``response``, in order."""
    tail = answer_part(reference)
    return tuple(t for t in ("tool_call", "response") if f"<{t}>" in tail)


def call_lines(calls: Sequence[dict[str, Any]]) -> str:
    """The lines of a ``<tool_call>`` block making ``calls``: one JSON object each."""
    return "\n".join(
        json.dumps({"name": c["name"], "parameters": c["parameters"]}, ensure_ascii=False)
        for c in calls
    )


def parse_call_lines(block: str) -> list[Any]:
    """JSON values of the lines of a ``<tool_call>`` block (ToolRL: strip, split on newlines)."""
    out = []
    for i, line in enumerate(block.strip().split("\n"), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ParseError(f"tool-call line {i} is not valid JSON ({exc.msg})") from exc
        except (ValueError, RecursionError) as exc:
            # deeply nested arrays or integers too long to convert: hostile, not JSON we use
            raise ParseError(
                f"tool-call line {i} cannot be decoded ({type(exc).__name__})"
            ) from exc
    return out


def reference_calls(reference: str) -> list[dict[str, Any]] | None:
    """The calls of a reference's last ``<tool_call>`` block after its reasoning (``None``:
    no call). ``ParseError`` when a call is not ``{"name": str, "parameters": dict}``."""
    tail = answer_part(reference)
    if "<tool_call>" not in tail:
        return None
    block = tail.split("<tool_call>")[-1]
    if "</tool_call>" not in block:
        raise ParseError("reference <tool_call> block is not closed")
    calls = parse_call_lines(block.split("</tool_call>")[0])
    for i, c in enumerate(calls, 1):
        if not _is_call(c):
            raise ParseError(f"reference call {i} is not {{'name': str, 'parameters': dict}}")
    return calls


def _is_call(c: Any) -> bool:
    return (
        isinstance(c, dict)
        and isinstance(c.get("name"), str)
        and isinstance(c.get("parameters"), dict)
    )


def response_calls(response: str) -> list[Any]:
    """Calls of a model response as ToolRL's reward reads them: one JSON value per line
    between the first ``<tool_call>`` and the next ``</tool_call>`` (not validated here).
    ``ParseError`` on a missing tag or a non-JSON line."""
    if "<tool_call>" not in response or "</tool_call>" not in response:
        raise ParseError("no <tool_call> ... </tool_call> block")
    return parse_call_lines(response.split("<tool_call>")[1].split("</tool_call>")[0])


# ---- declared types ----------------------------------------------------------------------------
_INT_TYPES = {"int", "integer", "long", "short", "byte"}
_FLOAT_TYPES = {"float", "number", "double"}
_BOOL_TYPES = {"bool", "boolean"}
_INT_RE = re.compile(r"[+-]?\d+")
# Digits after the dot are matched only behind a literal dot, so a run of digits has one
# way to match: linear time even on a long digit run that ends in a non-digit (the former
# ``\d+\.?\d*`` could split such a run between its two repeats in quadratically many ways).
_FLOAT_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def _base_type(schema: Any) -> str | None:
    if not isinstance(schema, dict) or not isinstance(schema.get("type"), str):
        return None
    t = schema["type"].strip().lower()
    return t.removesuffix(", optional").strip()


def coerce_value(value: Any, schema: Any) -> Any:
    """``value`` as the schema's scalar type when it is a string spelling of it ("3" for an
    int, "2.5" for a float, "true" for a bool); otherwise unchanged. For reference values only
    (the paper's rule, docs/tasks/toolcall.md "Argument types")."""
    if not isinstance(value, str):
        return value
    t = _base_type(schema)
    s = value.strip()
    if t in _INT_TYPES:
        if _INT_RE.fullmatch(s):
            return int(s)
        if _FLOAT_RE.fullmatch(s) and float(s).is_integer():
            return int(float(s))
    elif t in _FLOAT_TYPES:
        if _FLOAT_RE.fullmatch(s):
            return float(s)
    elif t in _BOOL_TYPES and s.lower() in ("true", "false"):
        return s.lower() == "true"
    return value


def coerce_calls(calls: list[Any], tools: dict[str, dict[str, Any]]) -> list[Any]:
    """Copies of reference ``calls``, each argument of a known tool (``tools``, from
    ``tools_by_name``) coerced to its declared type; anything else passes unchanged."""
    out: list[Any] = []
    for call in calls:
        if _is_call(call) and call["name"] in tools:
            schema = tools[call["name"]] or {}
            params = {k: coerce_value(v, schema.get(k)) for k, v in call["parameters"].items()}
            call = {**call, "parameters": params}
        out.append(call)
    return out


# ---- RLLA data -------------------------------------------------------------------------------
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
    """``reference`` with the calls whose values ``coerce_calls`` converts rewritten as typed
    JSON (other lines verbatim), so that it scores full marks against itself and an SFT warm
    start teaches the typed form (docs/tasks/toolcall.md, "Argument types")."""
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
    # the calls' block is the last one, after the reasoning (``reference_calls``)
    start = reference.rfind("<tool_call>") + len("<tool_call>")
    end = reference.find("</tool_call>", start)
    block = reference[start:end]
    lead = block[: len(block) - len(block.lstrip())]
    trail = block[len(block.rstrip()) :]
    new = [
        json.dumps(t, ensure_ascii=False) if ch else line
        for line, t, ch in zip(block.strip().split("\n"), typed, changed, strict=True)
    ]
    return reference[:start] + lead + "\n".join(new) + trail + reference[end:]


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
