"""Verifier blocks of the tool-calling task (the information each reward is scored against).

Replay appends them to the last user message (correctness, then format) and measures, token by
token, how much each changes the policy's predictions. They state what the verifier checks, no
more: correctness, the reference calls after type coercion (what the reward compares; a reference
without calls has none: its reward is a constant 0); format, the tag layout the reference implies
(tool-call, direct-response, or both).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_CALL_LINE = '{"name": ..., "parameters": {...}}'


def correctness_block(calls: list[dict[str, Any]] | None) -> str | None:
    """The reference calls, one JSON object per line (``None`` when there are none)."""
    if calls is None:
        return None
    lines = "\n".join(
        json.dumps({"name": c["name"], "parameters": c["parameters"]}, ensure_ascii=False)
        for c in calls
    )
    n = len(calls)
    what = "this tool call" if n == 1 else f"these {n} tool calls"
    return f"The correct answer to this turn makes {what}:\n{lines}"


def format_block(tags: Sequence[str]) -> str:
    """The required layout: ``<think>`` then the tags the reference implies, each once."""
    think = "Write your reasoning inside <think> </think> first"
    calls = (
        "then, on a new line, <tool_call>, one JSON object per line of the form "
        f"{_CALL_LINE}, and </tool_call> on its own line"
    )
    reply = "then, on a new line, your reply inside <response> </response>"
    has_call, has_reply = "tool_call" in tags, "response" in tags
    if has_call and has_reply:
        body = f"{think}, {calls}, {reply}."
        tail = "Use each tag exactly once and write nothing after </response>."
    elif has_call:
        body = f"{think}, {calls}."
        tail = "Use each tag exactly once, add no <response>, and write nothing after </tool_call>."
    elif has_reply:
        body = f"{think}, {reply}."
        tail = "Make no tool call, use each tag exactly once, and write nothing after </response>."
    else:
        body = f"{think}."
        tail = "Write nothing outside the <think> </think> pair."
    return f"Required answer format: {body} {tail}"
