"""RLLA loaders: on RLLA-shaped rows built here (always), and on the real public files
(../shared/data/toolrl_rlla, skipped per test where absent), both layouts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tests.task_fixtures import RLLA_TOOLS, make_rlla

from mrtpo.tasks.toolcall import ToolCallTask
from mrtpo.tasks.toolcall.parsing import (
    load_rlla,
    parse_tools,
    read_rows,
    system_prompt,
    tools_by_name,
)


# ---- rows built here: the loaders and rewards without ../shared ---------------------------------
@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    return make_rlla(tmp_path_factory.mktemp("rlla")) / "toolrl_rlla"


@pytest.fixture(scope="module")
def fixture_task(fixture_dir: Path) -> ToolCallTask:
    return ToolCallTask(
        data_files={
            "train": str(fixture_dir / "rlla_sft.json"),
            "val": str(fixture_dir / "rlla_4k_test.jsonl"),
        }
    )


def test_fixture_rows_load_in_both_layouts_alike(fixture_task: ToolCallTask, caplog) -> None:
    rl, sft = fixture_task.examples("val"), fixture_task.examples("train")
    assert len(rl) == len(sft) == 4  # the fifth row's gold call is broken: dropped
    assert [e.messages for e in rl] == [e.messages for e in sft]
    assert [e.data for e in rl] == [e.data for e in sft]
    assert rl[0].data["tools"] == tools_by_name(RLLA_TOOLS)
    assert [e.data["tags"] for e in rl] == [
        ("tool_call",), ("tool_call",), ("response",), ("tool_call", "response"),
    ]  # fmt: skip
    assert rl[2].data["reference_calls"] is None


def test_fixture_references_are_typed_and_score_full_marks(fixture_task: ToolCallTask) -> None:
    """The reward converts the reference's quoted numbers and booleans to the schema's types
    and keeps the model's values as written; ``Example.reference`` is written typed, so it
    scores 3 against itself and an SFT warm start teaches the typed form."""
    e0, e1 = fixture_task.examples("val")[:2]
    assert e0.data["reference_calls"] == [{"name": "GetNews", "parameters": {"page": "1"}}]
    assert '{"name": "GetNews", "parameters": {"page": 1}}' in e0.reference
    assert e0.reference.startswith("<think> I should use")  # the rest is kept verbatim
    alarm = '{"name": "SetAlarm", "parameters": {"hour": 6, "repeat": true, "volume": 0.2}}'
    assert alarm in e1.reference
    assert '{"name": "GetNews", "parameters": {"topic": "AI"}}' in e1.reference  # unchanged line
    for split in ("train", "val"):
        for e in fixture_task.examples(split):
            s = fixture_task.score(e, e.reference)
            assert s.rewards["format"] == 1.0, (e.id, s.reasons)
            assert s.rewards["correctness"] == (3.0 if e.data["reference_calls"] else 0.0)
    # the published quoted form, written by a model, is compared as written: "1" != 1
    quoted = '<think> x </think>\n<tool_call>\n{"name": "GetNews", "parameters": {"page": "1"}}\n</tool_call>'
    # S = names 1 + parameter names 1 + values 0 = 2 of S_max = 1 + 1 + 1 = 3
    assert fixture_task.score(e0, quoted).rewards["correctness"] == pytest.approx(6 * 2 / 3 - 3)


def test_fixture_system_prompts_round_trip(fixture_task: ToolCallTask) -> None:
    for e in fixture_task.examples("val"):
        assert system_prompt(parse_tools(e.messages[0]["content"])) == e.messages[0]["content"]


def test_fixture_parquet_matches_jsonl(fixture_dir: Path, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = read_rows(fixture_dir / "rlla_4k_test.jsonl")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    a, b = load_rlla(tmp_path / "rows.parquet"), load_rlla(fixture_dir / "rlla_4k_test.jsonl")
    assert [(e.messages, e.reference, e.data) for e in a] == [
        (e.messages, e.reference, e.data) for e in b
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(b'{"a": 1}\n\n{"a": 2,\n', r"rows\.jsonl:3: not valid JSON", id="bad-json"),
        pytest.param(
            b'{"a": 1}\n[1, 2]\n', r"rows\.jsonl:2: a JSON list, not an object", id="list"
        ),
        pytest.param(b'"text"\n', r"rows\.jsonl:1: a JSON str, not an object", id="string"),
        pytest.param(b'{"a": 1}\n{"a": "\xff"}\n', r"rows\.jsonl:2: not valid UTF-8", id="utf8"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_rlla(path)


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text('[\n {"instruction": "", "input": "", "output": ""},\n {"oops"\n]')
    with pytest.raises(ValueError, match=r"rows\.json:4: not valid JSON \(Expecting ':'"):
        load_rlla(path)
    path.write_text('[{"instruction": "", "input": "", "output": ""}, 5]')
    with pytest.raises(ValueError, match=r"rows\.json: row 1 is a JSON int, not an object"):
        load_rlla(path)


# ---- the real public files --------------------------------------------------------------------


@pytest.fixture(scope="module")
def rlla(shared_data: Path) -> Path:
    folder = shared_data / "toolrl_rlla"
    if not (folder / "rlla_sft.json").is_file():
        pytest.skip(f"RLLA files not found in {folder}")
    return folder


@pytest.fixture(scope="module")
def task(rlla: Path) -> ToolCallTask:
    return ToolCallTask(
        data_files={"train": str(rlla / "rlla_sft.json"), "val": str(rlla / "rlla_4k_test.jsonl")}
    )


def test_gold_sft_outputs_score_full_marks_where_they_parse(task: ToolCallTask) -> None:
    """Scoring each gold output as a response: format 1 and correctness 3 (0 for a gold that
    answers without a call, ToolRL's value) on every row whose gold follows the format."""
    examples = task.examples("train")
    assert len(examples) == 400
    scores = [task.score(e, e.reference) for e in examples]
    parsed = [(e, s) for e, s in zip(examples, scores) if s.rewards["format"] == 1.0]
    for e, s in parsed:
        expected = 3.0 if e.data["reference_calls"] is not None else 0.0
        assert s.rewards["correctness"] == expected, (e.id, s.reasons)
    # The rest mention a tag inside their reasoning, which ToolRL's checks count as a tag.
    rest = [(e, s) for e, s in zip(examples, scores) if s.rewards["format"] != 1.0]
    for e, _ in rest:
        think = e.reference.split("</think>")[0]
        assert "<tool_call>" in think or "<response>" in think, e.id
    counts = Counter(
        (s.rewards["format"], s.rewards["correctness"], e.data["reference_calls"] is not None)
        for e, s in zip(examples, scores)
    )
    # measured on the shared file: 329 calls -> 3, 54 direct answers -> 0, 17 unparsable
    assert counts == {(1.0, 3.0, True): 329, (1.0, 0.0, False): 54, (0.0, -3.0, True): 17}


def test_rl_layout_ground_truths_score_full_marks(task: ToolCallTask) -> None:
    examples = task.examples("val")
    assert len(examples) == 80
    for e in examples:
        s = task.score(e, e.reference)
        assert s.rewards["format"] == 1.0
        assert s.rewards["correctness"] == (3.0 if e.data["reference_calls"] else 0.0)
    metrics = task.summarize(examples, [task.score(e, e.reference) for e in examples])
    assert metrics["exact_match"] == 1.0 and metrics["format_accuracy"] == 1.0


def test_typed_answer_to_quoted_reference_gets_full_marks(task: ToolCallTask) -> None:
    """val row 0: the reference writes page "1" for an int parameter."""
    e = task.examples("val")[0]
    assert e.data["reference_calls"] == [{"name": "GetNews", "parameters": {"page": "1"}}]
    typed = '<think> ok </think>\n<tool_call>\n{"name": "GetNews", "parameters": {"page": 1}}\n</tool_call>'
    assert task.score(e, typed).rewards["correctness"] == 3.0


def test_system_prompts_round_trip(task: ToolCallTask) -> None:
    for split in ("train", "val"):
        for e in task.examples(split):
            text = e.messages[0]["content"]
            assert system_prompt(parse_tools(text)) == text, e.id


def test_layouts_agree_and_parquet_loads(rlla: Path, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = read_rows(rlla / "rlla_4k_test.jsonl")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    from_parquet = load_rlla(tmp_path / "test.parquet")
    from_jsonl = load_rlla(rlla / "rlla_4k_test.jsonl")
    assert [e.messages for e in from_parquet] == [e.messages for e in from_jsonl]
    assert [e.reference for e in from_parquet] == [e.reference for e in from_jsonl]
    # the same rows in the SFT layout give the same examples
    sft_rows = [
        {
            "instruction": r["extra_info"]["instruction"],
            "input": r["extra_info"]["input"],
            "output": r["extra_info"]["output"],
        }
        for r in rows
    ]
    (tmp_path / "sft.json").write_text(json.dumps(sft_rows))
    from_sft = load_rlla(tmp_path / "sft.json")
    assert [e.messages for e in from_sft] == [e.messages for e in from_jsonl]
    assert [e.data for e in from_sft] == [e.data for e in from_jsonl]


def test_bad_rows_are_dropped_and_missing_files_name_the_key(tmp_path: Path) -> None:
    good = {
        "instruction": system_prompt([]),
        "input": "<user> hi </user>",
        "output": "<think> x </think>\n<response> hello </response>",
    }
    broken = dict(good, output='<think> x </think>\n<tool_call>\n{"name": \n</tool_call>')
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in [good, broken]))
    examples = load_rlla(tmp_path / "rows.jsonl")
    assert [e.id for e in examples] == ["rows-0"]
    with pytest.raises(FileNotFoundError, match=r"task\.data_files"):
        load_rlla(tmp_path / "absent.json")
    with pytest.raises(KeyError, match=r"task\.data_files\.test"):
        ToolCallTask(data_files={"train": str(tmp_path / "rows.jsonl")}).examples("test")
    limited = ToolCallTask(
        data_files={"train": str(tmp_path / "rows.jsonl")}, limits={"train": 1}
    ).examples("train")
    assert len(limited) == 1
