"""ToolRL's format and correctness rewards on hand-made cases, with values worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mrtpo.tasks.base import Example
from mrtpo.tasks.toolcall import ToolCallTask
from mrtpo.tasks.toolcall.parsing import (
    ParseError,
    clean_response,
    coerce_value,
    parse_tools,
    reference_calls,
    reference_tags,
    response_calls,
    system_prompt,
    tools_by_name,
)
from mrtpo.tasks.toolcall.rewards import (
    correctness_block,
    correctness_reward,
    format_block,
    format_reward,
    match_score,
)

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "city": {"description": "City name.", "type": "string", "default": ""},
            "unit": {"description": "celsius or fahrenheit.", "type": "str", "default": "celsius"},
            "days": {"description": "Forecast days.", "type": "int, optional", "default": 1},
        },
    },
    {
        "name": "get_time",
        "description": "Local time of a city.",
        "parameters": {
            "city": {"description": "City name.", "type": "string", "default": ""},
            "utc": {"description": "Answer in UTC.", "type": "bool", "default": False},
        },
    },
]
SCHEMA = tools_by_name(TOOLS)
PARIS = {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}


def answer(*calls: dict, think: str = "reasoning") -> str:
    lines = "\n".join(json.dumps(c) for c in calls)
    return f"<think> {think} </think>\n<tool_call>\n{lines}\n</tool_call>"


def correctness(gold: list[dict] | None, response: str) -> float:
    return correctness_reward(gold, clean_response(response), SCHEMA)[0]


# ---- correctness: the acceptance cases ----------------------------------------------------------
# S_max for one reference call with 2 arguments = 1 (names) + 1 + 2 = 4.
@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        pytest.param([PARIS], 3.0, id="exact-match"),
        # names 1 + (param names 1 + values 1) = 3 -> 6*3/4-3
        pytest.param(
            [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "fahrenheit"}}],
            1.5,
            id="wrong-value",
        ),
        # names 1 + (param-name overlap 1/2 + values 1) = 2.5 -> 6*2.5/4-3
        pytest.param(
            [{"name": "get_weather", "parameters": {"city": "Paris"}}], 0.75, id="missing-param"
        ),
        # names |{w}|/|{w,t}| = 1/2, + (1 + 2) = 3.5 -> 6*3.5/4-3
        pytest.param(
            [PARIS, {"name": "get_time", "parameters": {"city": "Paris"}}], 2.25, id="extra-call"
        ),
        # no name overlap, no matched call: S = 0 -> -3
        pytest.param(
            [{"name": "get_time", "parameters": {"city": "Paris"}}], -3.0, id="wrong-tool"
        ),
        # extra argument: names 1 + (param overlap 2/3 + values 2) -> 6*(11/3)/4-3
        pytest.param(
            [
                {
                    "name": "get_weather",
                    "parameters": {"city": "Paris", "unit": "celsius", "days": 2},
                }
            ],
            6 * (1 + 2 / 3 + 2) / 4 - 3,
            id="extra-param",
        ),
    ],
)
def test_correctness_hand_cases(calls: list[dict], expected: float) -> None:
    assert correctness([PARIS], answer(*calls)) == pytest.approx(expected)


def test_correctness_malformed_json_is_minus_three_with_reason() -> None:
    bad = '<think> x </think>\n<tool_call>\n{"name": "get_weather", "parameters": {"city": \n</tool_call>'
    value, reason = correctness_reward([PARIS], bad, SCHEMA)
    assert value == -3.0
    assert reason and "not valid JSON" in reason


def test_correctness_missing_tags_is_minus_three() -> None:
    value, reason = correctness_reward(
        [PARIS], "<think> x </think>\n<response>Paris</response>", SCHEMA
    )
    assert value == -3.0 and "no <tool_call>" in reason
    # an unclosed block is also a missing tag
    assert correctness([PARIS], '<think> x </think>\n<tool_call>\n{"name": "a"}') == -3.0


def test_correctness_no_call_reference_is_zero() -> None:
    value, reason = correctness_reward(None, answer(PARIS), SCHEMA)
    assert value == 0.0 and "no tool call" in reason
    assert correctness(None, "garbage") == 0.0


@pytest.mark.parametrize(
    "line",
    [
        '["get_weather", {"city": "Paris"}]',  # not an object
        '{"parameters": {"city": "Paris"}}',  # no name
        '{"name": "get_weather", "parameters": ["Paris"]}',  # same name, parameters not an object
        '{"name": ["get_weather"], "parameters": {}}',  # unhashable name
    ],
)
def test_correctness_malformed_calls_never_raise(line: str) -> None:
    text = f"<think> x </think>\n<tool_call>\n{line}\n</tool_call>"
    value, reason = correctness_reward([PARIS], text, SCHEMA)
    assert value == -3.0 and reason


def test_parallel_calls_in_another_order_score_full_marks_by_formula() -> None:
    rome = {"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}
    # not an exact match (order differs), but each reference call finds its twin:
    # S = 1 + 3 + 3 = S_max = 7
    assert correctness([PARIS, rome], answer(rome, PARIS)) == pytest.approx(3.0)


def test_reference_strings_are_coerced_to_declared_types() -> None:
    gold = [
        {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius", "days": "3"}}
    ]
    typed = {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius", "days": 3}}
    assert correctness(gold, answer(typed)) == 3.0
    gold_bool = [{"name": "get_time", "parameters": {"city": "Oslo", "utc": "true"}}]
    assert (
        correctness(
            gold_bool, answer({"name": "get_time", "parameters": {"city": "Oslo", "utc": True}})
        )
        == 3.0
    )
    # a string parameter is never coerced: "3" and 3 differ there
    gold_str = [{"name": "get_time", "parameters": {"city": "3"}}]
    assert correctness(gold_str, answer({"name": "get_time", "parameters": {"city": 3}})) < 3.0


# ---- ToolRL's own scoring (verl/utils/reward_score/rlla.py), worked out by hand --------------
# ToolRL parses both sides with json.loads and compares with Python ==, converting nothing.
# The paper converts the reference's numeric and boolean strings to the schema's types; the
# model's values are compared as written. For one reference call with 3 arguments
# S_max = 1 (names) + 1 (parameter names) + 3 (values) = 5, reward = 6 * S / 5 - 3.
GOLD_DAYS = [
    {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius", "days": "3"}}
]


def _weather(days: object) -> dict:
    return {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius", "days": days}}


@pytest.mark.parametrize(
    ("days", "expected"),
    [
        # the reference's "3" becomes 3 (schema: int); 3 == 3: gt_tools == pd_tools -> max
        pytest.param(3, 3.0, id="typed-int"),
        # JSON 3.0 is a float; Python's 3 == 3.0 holds, so ToolRL's exact-match test passes
        pytest.param(3.0, 3.0, id="float-equal-to-int"),
        # the model's "3" stays a string: "3" != 3. S = names 1 + keys 1 + values 2 = 4
        pytest.param("3", 6 * 4 / 5 - 3, id="stringified-int"),
        # "3.0" is not converted either (the model's values are kept as written)
        pytest.param("3.0", 6 * 4 / 5 - 3, id="N.0-string"),
        pytest.param(" 3", 6 * 4 / 5 - 3, id="padded-string"),
    ],
)
def test_model_values_are_compared_as_written(days: object, expected: float) -> None:
    assert correctness(GOLD_DAYS, answer(_weather(days))) == pytest.approx(expected)


def test_model_booleans_are_compared_as_written() -> None:
    gold = [{"name": "get_time", "parameters": {"city": "Oslo", "utc": "false"}}]
    # S_max = 1 + 1 + 2 = 4
    as_bool = {"name": "get_time", "parameters": {"city": "Oslo", "utc": False}}
    as_text = {"name": "get_time", "parameters": {"city": "Oslo", "utc": "false"}}
    as_zero = {"name": "get_time", "parameters": {"city": "Oslo", "utc": 0}}
    assert correctness(gold, answer(as_bool)) == 3.0
    assert correctness(gold, answer(as_text)) == pytest.approx(6 * 3 / 4 - 3)  # names 1 + 1 + 1
    assert correctness(gold, answer(as_zero)) == 3.0  # Python: 0 == False, as in ToolRL


def test_a_boolean_for_an_int_parameter_counts_as_toolrl_counts_it() -> None:
    """Issue 25 item 12: ``true`` against the int 1 scores like 1 itself, because ToolRL's
    ``rlla.py`` compares with Python's ``==`` (``True == 1``) and the paper follows it. The
    verdict is kept on purpose and documented in docs/tasks/toolcall.md."""
    gold = [{"name": "get_weather", "parameters": {"city": "Rome", "days": "1"}}]  # -> 1
    as_true = {"name": "get_weather", "parameters": {"city": "Rome", "days": True}}
    as_false = {"name": "get_weather", "parameters": {"city": "Rome", "days": False}}
    assert correctness(gold, answer(as_true)) == 3.0  # the whole call equals the reference
    # S_max = 1 + 1 + 2 = 4; False != 1 costs the value point: names 1 + keys 1 + values 1
    assert correctness(gold, answer(as_false)) == pytest.approx(6 * 3 / 4 - 3)
    # in the partial-credit sum too: a wrong city, but days=true still earns its point
    wrong_city = {"name": "get_weather", "parameters": {"city": "Oslo", "days": True}}
    assert correctness(gold, answer(wrong_city)) == pytest.approx(6 * 3 / 4 - 3)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "tasks" / "toolcall.md").read_text()
    doc = " ".join(doc.split())
    assert "`true` for an `int` parameter whose reference is `1`" in doc


def test_the_block_shows_the_converted_reference() -> None:
    ex = _example(answer(GOLD_DAYS[0]))
    score = ToolCallTask().score(ex, answer(_weather("3")))
    assert '"days": 3}' in score.blocks["correctness"]
    assert score.rewards["correctness"] == pytest.approx(6 * 4 / 5 - 3)


@pytest.mark.parametrize(
    ("value", "type_", "expected"),
    [
        ("3", "int", 3),
        ("-3", "integer", -3),
        ("3.0", "int, optional", 3),
        ("2.5", "float", 2.5),
        ("1e3", "number", 1000.0),
        ("True", "bool", True),
        ("false", "boolean", False),
        ("abc", "int", "abc"),  # not a number: left alone
        ("3", "string", "3"),
        ("3", "['string', 'integer']", "3"),  # unions are not guessed
        (3, "string", 3),  # only strings are converted
    ],
)
def test_coerce_value(value, type_, expected) -> None:
    out = coerce_value(value, {"type": type_})
    assert out == expected and type(out) is type(expected)


def test_match_score_is_multiset_overlap() -> None:
    assert match_score(["a", "b"], ["a", "b"]) == 1.0
    assert match_score(["a", "b"], ["b", "a"]) == 1.0  # equal as multisets: 2 / (2+2-2)
    assert match_score(["a", "a"], ["a"]) == pytest.approx(0.5)
    assert match_score([], ["a"]) == 0.0
    assert match_score([], []) == 1.0


# ---- format --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("response", "tags", "expected"),
    [
        (answer(PARIS), ("tool_call",), 1.0),
        ("<think> x </think>\n<response> hi </response>", ("response",), 1.0),
        (answer(PARIS) + "\n<response> done </response>", ("tool_call", "response"), 1.0),
        ("<think> x </think>", (), 1.0),
        # the reference calls a tool but the response answers directly
        ("<think> x </think>\n<response> hi </response>", ("tool_call",), 0.0),
        # missing think
        ('<tool_call>\n{"name": "a", "parameters": {}}\n</tool_call>', ("tool_call",), 0.0),
        # a second think pair: ToolRL's lazy ".*?" spans it and only answer tags are counted
        ("<think> a </think>\n<think> b </think>\n<response> hi </response>", ("response",), 1.0),
        (
            "<think> a </think>\n<think> b </think>\n"
            + answer(PARIS).removeprefix("<think> reasoning </think>\n"),
            ("tool_call",),
            1.0,
        ),
        # think-only layout: ^<think>.*?</think>$ with no counts at all
        ("<think> a </think>\n<response> r </response>\n<think> b </think>", (), 1.0),
        # a <response> inside the reasoning is not counted when the layout has no response
        (answer(PARIS, think="no <response> yet"), ("tool_call",), 1.0),
        # but the text must start with <think>
        ("x <think> a </think>\n<response> hi </response>", ("response",), 0.0),
        # the tag mentioned inside the reasoning counts as a second tag
        (answer(PARIS, think="I will use <tool_call> now"), ("tool_call",), 0.0),
        # text after the last tag
        (answer(PARIS) + "\nanything else", ("tool_call",), 0.0),
        # the response block required by the reference is missing
        (answer(PARIS), ("tool_call", "response"), 0.0),
        # wrong order
        (
            "<think> x </think>\n<response> r </response>\n<tool_call>\n{}\n</tool_call>",
            ("tool_call", "response"),
            0.0,
        ),
        # no newline between the tags
        ('<think> x </think><tool_call>\n{"name": "a"}\n</tool_call>', ("tool_call",), 0.0),
        ("", ("tool_call",), 0.0),
    ],
)
def test_format_reward(response: str, tags: tuple[str, ...], expected: float) -> None:
    value, reason = format_reward(clean_response(response), tags)
    assert value == expected
    assert (reason is None) == (expected == 1.0)


def test_clean_response_cuts_end_of_turn_markers() -> None:
    assert clean_response("  <think> x </think>\n<response> r </response><|im_end|>\njunk") == (
        "<think> x </think>\n<response> r </response>"
    )


# ---- parsing -------------------------------------------------------------------------------------
def test_system_prompt_round_trip() -> None:
    text = system_prompt(TOOLS)
    assert parse_tools(text) == TOOLS
    assert system_prompt(parse_tools(text)) == text


def test_parse_tools_rejects_broken_parameters() -> None:
    text = system_prompt(TOOLS).replace('Parameters: {"city"', "Parameters: {city", 1)
    with pytest.raises(ParseError, match="not JSON"):
        parse_tools(text)
    assert parse_tools("no tool list here") == []


def test_reference_tags_and_calls_ignore_tags_mentioned_in_reasoning() -> None:
    ref = answer(PARIS, think="I need a <tool_call> and no <response> yet")
    assert reference_tags(ref) == ("tool_call",)
    assert reference_calls(ref) == [PARIS]
    assert reference_calls("<think> x </think>\n<response> hi </response>") is None
    # ToolRL's response-side reading takes the first tag: here the one in the reasoning
    with pytest.raises(ParseError):
        response_calls(ref)


# ---- blocks and contexts ------------------------------------------------------------------------
def _example(reference: str) -> Example:
    return Example(
        id="x",
        messages=[
            {"role": "system", "content": system_prompt(TOOLS)},
            {
                "role": "user",
                "content": "**Dialogue Records History**\n<user> Weather in Paris? </user>",
            },
        ],
        data={
            "source": "rlla",
            "tools": SCHEMA,
            "reference_calls": reference_calls(reference),
            "tags": reference_tags(reference),
        },
        reference=reference,
    )


def test_blocks_are_appended_correctness_first() -> None:
    gold = {"name": "get_weather", "parameters": {"city": "Paris", "days": "3"}}
    ex = _example(answer(gold))
    task = ToolCallTask()
    score = task.score(ex, "no tags at all")
    assert score.rewards == {"format": 0.0, "correctness": -3.0}
    assert set(score.reasons) == {"format", "correctness"}
    ctx = task.contexts(ex, score)
    user = ctx.all[-1]["content"]
    original = ex.messages[-1]["content"]
    corr, fmt = score.blocks["correctness"], score.blocks["format"]
    assert user == f"{original}\n\n{corr}\n\n{fmt}"
    assert '"days": 3' in corr  # the block shows the coerced value the reward compares with
    assert ctx.without["correctness"][-1]["content"] == f"{original}\n\n{fmt}"
    assert ctx.without["format"][-1]["content"] == f"{original}\n\n{corr}"
    assert ctx.none[-1]["content"] == original
    assert ctx.all[0] == ex.messages[0]  # the system prompt is untouched


def test_direct_response_example_has_only_a_format_block() -> None:
    ex = _example("<think> x </think>\n<response> It is sunny. </response>")
    task = ToolCallTask()
    score = task.score(ex, "<think> y </think>\n<response> sunny </response>")
    assert score.rewards == {"format": 1.0, "correctness": 0.0}
    assert score.blocks["correctness"] is None
    assert score.blocks["format"] == format_block(("response",))
    assert "<response>" in score.blocks["format"] and "no tool call" in score.blocks["format"]
    assert set(task.contexts(ex, score).without) == {"format"}


def test_format_block_variants_differ() -> None:
    variants = {
        format_block(t) for t in [("tool_call",), ("response",), ("tool_call", "response"), ()]
    }
    assert len(variants) == 4
    assert correctness_block(None) is None
    assert correctness_block([PARIS]).endswith(json.dumps(PARIS))


# ---- robustness: malformed output is scored, never raised ----------------------------------------
_FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<response>",
    "</response>",
    "\n",
    " ",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"parameters"',
    ":",
    ",",
    '"get_weather"',
    '"city"',
    '"Paris"',
    "3",
    "null",
    "true",
    json.dumps(PARIS),
    '{"name": "get_weather", "parameters": []}',
    '{"name": {"a": 1}, "parameters": {}}',
    "<|im_end|>",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=40))
def test_fuzzed_responses_never_raise(pieces: list[str]) -> None:
    text = "".join(pieces)
    task = ToolCallTask()
    for ex in (_example(answer(PARIS)), _example("<think> x </think>\n<response> r </response>")):
        score = task.score(ex, text)
        assert score.rewards["format"] in (0.0, 1.0)
        assert -3.0 <= score.rewards["correctness"] <= 3.0
        assert (score.rewards["correctness"] == 3.0) or "correctness" in score.reasons
