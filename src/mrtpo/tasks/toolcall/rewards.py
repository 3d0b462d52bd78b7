"""ToolRL's two rewards, format (0/1) and tool-call correctness (-3..3), and their blocks.

Both rewards follow ToolRL's verl fork (``verl/utils/reward_score/rlla.py``, defaults: no
reward scheduling, fine-grained matching); the definitions and the departures, with why, are in
docs/tasks/toolcall.md, "Rewards". The blocks (appended by replay to the last user message,
correctness first) state what the verifier checks, no more: the reference calls after type
coercion (none for a reference without calls, whose reward is a constant 0) and the tag layout
the reference implies.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

from mrtpo.tasks.toolcall.parsing import ParseError, call_lines, coerce_calls, response_calls

CORRECTNESS_MAX = 3.0
CORRECTNESS_MIN = -3.0

# ToolRL's patterns, one per set of answer tags the reference implies. Linear time: each is
# tried from position 0 only, and the tag counts are checked first, so each lazy group has at
# most one place to stop at (the think-only layout's end anchor fixes its one).
_FORMAT_PATTERNS: dict[tuple[str, ...], re.Pattern[str]] = {
    ("tool_call",): re.compile(r"^<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>$", re.S),
    ("response",): re.compile(r"^<think>.*?</think>\n<response>.*?</response>$", re.S),
    ("tool_call", "response"): re.compile(
        r"^<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>\n<response>.*?</response>$", re.S
    ),
    (): re.compile(r"^<think>.*?</think>$", re.S),
}


def format_reward(response: str, tags: Sequence[str]) -> tuple[float, str | None]:
    """ToolRL's format reward, (1 or 0, reason for a 0), for the ``tags`` the reference
    implies (``parsing.reference_tags``)."""
    key = tuple(t for t in ("tool_call", "response") if t in tags)
    for tag in key:
        for mark in (f"<{tag}>", f"</{tag}>"):
            n = response.count(mark)
            if n != 1:
                return 0.0, f"{mark} appears {n} times (expected once)"
    if not _FORMAT_PATTERNS[key].search(response):
        layout = " then ".join(f"<{t}>" for t in ("think", *key))
        return 0.0, f"tags are not laid out as {layout}, separated by newlines, nothing outside"
    return 1.0, None


def match_score(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """ToolRL's list overlap: 1 for equal lists, else multiset intersection over union."""
    a, b = list(a), list(b)
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    ca, cb = Counter(a), Counter(b)
    inter = sum(min(ca[k], cb[k]) for k in ca.keys() & cb.keys())
    union = len(a) + len(b) - inter
    return inter / union if union > 0 else 0.0


def _names(pred: list[Any]) -> list[Hashable]:
    names = []
    for i, call in enumerate(pred, 1):
        if not isinstance(call, dict) or "name" not in call:
            raise ParseError(f"predicted call {i} is not a JSON object with a 'name'")
        if not isinstance(call["name"], Hashable):
            raise ParseError(f"predicted call {i} has a non-scalar name")
        names.append(call["name"])
    return names


def tool_call_score(gold: list[dict[str, Any]], pred: list[Any]) -> float:
    """Correctness in [-3, 3] of predicted calls (as written) against reference calls:
    ``6 * S / S_max - 3`` (docs/tasks/toolcall.md). ``ParseError`` (the caller's -3) where
    ToolRL's comparison fails on a malformed prediction."""
    if gold == pred:
        return CORRECTNESS_MAX
    score = match_score([g["name"] for g in gold], _names(pred))
    s_max = 1.0
    used: set[int] = set()
    for g in gold:
        g_params = g["parameters"]
        s_max += 1.0 + len(g_params)
        best, best_i = 0.0, -1
        for i, p in enumerate(pred):
            if i in used or p["name"] != g["name"]:
                continue
            p_params = p.get("parameters")
            if not isinstance(p_params, dict):
                raise ParseError(f"predicted call {i + 1} ({p['name']!r}) has no parameter object")
            total = match_score(list(g_params), list(p_params))
            total += sum(1.0 for k, v in g_params.items() if k in p_params and p_params[k] == v)
            if total > best:  # strict: a same-named call that matches nothing stays unused
                best, best_i = total, i
        if best_i >= 0:
            used.add(best_i)
            score += best
    return (CORRECTNESS_MAX - CORRECTNESS_MIN) * score / s_max + CORRECTNESS_MIN


def correctness_reward(
    gold_calls: list[dict[str, Any]] | None,
    response: str,
    tools: dict[str, dict[str, Any]],
) -> tuple[float, str | None]:
    """(ToolRL correctness, reason when not a perfect 3) of a cleaned ``response``; never
    raises on model output. ``gold_calls``: ``parsing.reference_calls`` (``None``: reward 0);
    ``tools``: ``parsing.tools_by_name``, for the reference's type conversion."""
    if gold_calls is None:
        return 0.0, "the reference makes no tool call (ToolRL gives 0)"
    try:
        pred = response_calls(response)
    except ParseError as exc:
        return CORRECTNESS_MIN, str(exc)
    gold = coerce_calls(gold_calls, tools)  # the reference only: the model's text is kept
    try:
        value = tool_call_score(gold, pred)
    except ParseError as exc:
        return CORRECTNESS_MIN, str(exc)
    if value == CORRECTNESS_MAX:
        return value, None
    return value, _mismatch_reason(gold, pred)


def _mismatch_reason(gold: list[dict[str, Any]], pred: list[Any]) -> str:
    g_names = sorted(str(g["name"]) for g in gold)
    p_names = sorted(str(p.get("name")) for p in pred if isinstance(p, dict))
    if g_names != p_names:
        return f"called {p_names}, reference calls {g_names}"
    return "tool names match; parameter names or values differ from the reference"


# ---- verifier blocks ----------------------------------------------------------------------
_CALL_LINE = '{"name": ..., "parameters": {...}}'
#: The format block's last sentence, by (has a tool call, has a response).
_FORMAT_TAILS = {
    (True, True): "Use each tag exactly once and write nothing after </response>.",
    (True, False): "Use each tag exactly once, add no <response>, and write nothing after </tool_call>.",
    (False, True): "Make no tool call, use each tag exactly once, and write nothing after </response>.",
    (False, False): "Write nothing outside the <think> </think> pair.",
}  # fmt: skip


def correctness_block(calls: list[dict[str, Any]] | None) -> str | None:
    """The reference calls, one JSON object per line (``None`` when there are none)."""
    if calls is None:
        return None
    n = len(calls)
    what = "this tool call" if n == 1 else f"these {n} tool calls"
    return f"The correct answer to this turn makes {what}:\n{call_lines(calls)}"


def format_block(tags: Sequence[str]) -> str:
    """The required layout: ``<think>`` then the tags the reference implies, each once."""
    think = "Write your reasoning inside <think> </think> first"
    calls = (
        "then, on a new line, <tool_call>, one JSON object per line of the form "
        f"{_CALL_LINE}, and </tool_call> on its own line"
    )
    reply = "then, on a new line, your reply inside <response> </response>"
    has_call, has_reply = "tool_call" in tags, "response" in tags
    parts = [think]
    if has_call:
        parts.append(calls)
    if has_reply:
        parts.append(reply)
    body = ", ".join(parts)
    tail = _FORMAT_TAILS[has_call, has_reply]
    return f"Required answer format: {body}. {tail}"
