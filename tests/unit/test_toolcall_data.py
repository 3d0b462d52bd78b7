"""RLLA loaders on the real public files (../shared/data/toolrl_rlla), both layouts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from mrtpo.tasks.toolcall import ToolCallTask
from mrtpo.tasks.toolcall.data import load_rlla, read_rows
from mrtpo.tasks.toolcall.parsing import parse_tools, system_prompt


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
