"""Text formats of the tool-calling task: tool lists in the system prompt, tags, tool calls.

The response format is ToolRL's: ``<think> ... </think>``, then a ``<tool_call>`` block with
one JSON object ``{"name": ..., "parameters": {...}}`` per line and/or a
``<response> ... </response>`` block. The system prompt lists the tools as numbered
``Name`` / ``Description`` / ``Parameters`` entries (the RLLA data's own layout), which
``parse_tools`` reads back and ``render_tools`` writes (the BFCL prompts reuse it, so a model
trained on RLLA sees the same layout at evaluation).
"""

from __future__ import annotations

import json
import re
from typing import Any

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
    "parameters"}`` (parameter name -> ``type``, ``description``, ``default``), text as written
    so ``render_tools`` gives the list back verbatim. No tool list: ``[]``; a ``Parameters``
    line that is not a JSON object: ``ParseError``.
    """
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
        if not (
            isinstance(c, dict)
            and isinstance(c.get("name"), str)
            and isinstance(c.get("parameters"), dict)
        ):
            raise ParseError(f"reference call {i} is not {{'name': str, 'parameters': dict}}")
    return calls


def response_calls(response: str) -> list[Any]:
    """Calls of a model response, read exactly as ToolRL's reward reads them: one JSON value
    per line between the first ``<tool_call>`` and the next ``</tool_call>``. Raises
    ``ParseError`` on a missing tag or a non-JSON line; values are not validated here (the
    correctness reward decides what a malformed call costs).
    """
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
    int, "2.5" for a float, "true" for a bool); otherwise unchanged.

    For reference values only (the paper's rule): RLLA references often quote numbers
    ("page": "1" for an ``int``), and a model writing the typed value should not lose for it.
    """
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
        if (
            isinstance(call, dict)
            and isinstance(call.get("name"), str)
            and isinstance(call.get("parameters"), dict)
            and call["name"] in tools
        ):
            schema = tools[call["name"]] or {}
            params = {k: coerce_value(v, schema.get(k)) for k, v in call["parameters"].items()}
            call = {**call, "parameters": params}
        out.append(call)
    return out
