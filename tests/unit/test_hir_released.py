"""HIR-16K as published (``HIR_trainv1.jsonl``) and HiR's checker variants.

The fixtures are written here in both layouts (the released rows and the verl rows HiR's
trainer reads); no file from ../shared is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrtpo.tasks.instructions import InstructionTask, checkers
from mrtpo.tasks.instructions.data import hir_layout, load_hir
from mrtpo.tasks.instructions.hir_checkers import HIR_CHINESE_ANSWERS

pytest.importorskip("lm_eval", reason="the IFEval checkers come from lm-eval")

ZH_TEXT = "今天天气很好，我们一起去公园散步吧。我很喜欢这样的日子。"


@pytest.fixture(scope="module")
def nltk_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("nltk_data"))


def released_rows() -> list[dict]:
    """Rows shaped like the published file: one per subset, plus rows that must be dropped."""
    return [
        {
            "id": 11,
            "source": "type1",
            "prompt": "Write a note to a friend.",
            "criteria": ["Do not use any commas", "Mention the word kite.", "Answer in zh."],
            "ground_truth": {
                "instruction_id_list": [
                    "punctuation:no_comma",
                    "keywords:existence",
                    "language:response_language",
                ],
                "kwargs": [{}, {"keywords": ["kite"]}, {"language": "zh"}],
            },
        },
        {
            "id": 12,
            "source": "type2",
            "prompt": "Describe a harbour.",
            "criteria": ["Write a list."],
            "ground_truth": {"instruction_id_list": ["format:list"], "kwargs": [{"sep": "-"}]},
        },
        {
            "id": 13,
            "source": "type3",
            "prompt": "A MulDimIF-style row.",
            "criteria": ["At most 50 words."],
            "ground_truth": {
                "constraints": [["Length", "Words", "At most 50 words."]],
                "constraint_pattern": "Listing",
            },
        },
        {
            "id": 14,
            "source": "type4",
            "prompt": "A mixed row.",
            "criteria": ["Be polite."],
            "ground_truth": {"checker": ["[llm] polite?"], "functions": ["NONE"]},
        },
        {  # an instruction no installed checker knows: dropped and counted
            "id": 15,
            "source": "type1",
            "prompt": "Write a haiku.",
            "criteria": ["Use a made-up rule."],
            "ground_truth": {"instruction_id_list": ["made:up"], "kwargs": [{}]},
        },
        {  # ids and sentences disagree: dropped and counted
            "id": 16,
            "source": "type1",
            "prompt": "Broken row.",
            "criteria": ["one", "two"],
            "ground_truth": {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
        },
    ]


def verl_row(row: dict, q_type: str) -> dict:
    """The same row as HiR's trainer reads it."""
    return {
        "data_source": row["source"],
        "prompt": [{"role": "user", "content": "(stored prompt)"}],
        "ability": "instruction_following",
        "reward_model": {"style": "rule", "ground_truth": json.dumps(row["ground_truth"])},
        "extra_info": {
            "index": row["id"],
            "question": row["prompt"],
            "criteria": row["criteria"],
            "q_type": q_type,
        },
    }


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


def test_released_layout_selects_the_first_two_subsets_and_counts_drops(tmp_path: Path):
    path = write_jsonl(tmp_path / "HIR_trainv1.jsonl", released_rows())
    recs, skipped = load_hir(path, ["type1", "type2"])
    assert [r.uid for r in recs] == ["hir-11", "hir-12", "hir-15"]  # 15: unknown id, dropped later
    assert [r.registry for r in recs] == ["ifeval", "ifbench", "ifeval"]
    assert recs[0].base == "Write a note to a friend."
    assert recs[0].constraints[2].kwargs == {"language": "zh"}
    assert recs[0].template == "type6" and recs[0].meta["layout"] == "released"
    assert skipped == {
        "subset muldimif not selected": 1,
        "subset mixed not selected": 1,
        "instruction ids, kwargs and criteria differ in length": 1,
    }
    # selecting the other subsets says why no program checks them
    _, other = load_hir(path, ["type3", "type4"])
    assert other["MulDimIF-style constraint table (no IFEval/IFBench checker)"] == 1
    assert other["rule/LLM checker entries (embedded code is never executed)"] == 1


def test_task_counts_prompts_constraints_and_unknown_ids(tmp_path: Path, nltk_dir: str):
    pytest.importorskip("if_verifiable", reason="IFBench-style rows need if-verifiable")
    path = write_jsonl(tmp_path / "HIR_trainv1.jsonl", released_rows())
    task = InstructionTask(nltk_data_dir=nltk_dir, data={"path": str(path)})
    train = task.examples("train")
    assert [e.id for e in train] == ["hir-11", "hir-12"]
    assert task.hir_counts["prompts"] == 2 and task.hir_counts["constraints"] == 4
    assert task.hir_counts["skipped/instruction id unknown to the ifeval checkers"] == 1
    with pytest.raises(ValueError, match=r"task\.data\.subsets"):
        InstructionTask(
            nltk_data_dir=nltk_dir, data={"path": str(path), "subsets": ["type4"]}
        )._load("hir")


@pytest.mark.parametrize("template", ["type3", "type1"])
def test_released_rows_build_p_without_k_with_hirs_template(
    tmp_path: Path, nltk_dir: str, template: str
):
    pytest.importorskip("if_verifiable", reason="IFBench-style rows need if-verifiable")
    path = write_jsonl(tmp_path / "HIR_trainv1.jsonl", released_rows())
    task = InstructionTask(nltk_data_dir=nltk_dir, data={"path": str(path), "template": template})
    ex = task.examples("train")[0]
    score = task.score(ex, "I flew a kite today")
    ctx = task.contexts(ex, score)
    if template == "type3":  # HiR's numbered rules: later items are renumbered
        assert ex.messages[0]["content"] == (
            "Write a note to a friend.\n\nThe output must follow the following rules:\n"
            "1. Do not use any commas\n2. Mention the word kite.\n3. Answer in zh."
        )
        assert ctx.without["c0"][0]["content"] == (
            "Write a note to a friend.\n\nThe output must follow the following rules:\n"
            "1. Mention the word kite.\n2. Answer in zh."
        )
    else:  # run-on prose, a full stop added where a sentence has none
        assert ex.messages[0]["content"] == (
            "Write a note to a friend. Do not use any commas. Mention the word kite. Answer in zh."
        )
        assert ctx.without["c1"][0]["content"] == (
            "Write a note to a friend. Do not use any commas. Answer in zh."
        )
    assert ctx.none[0]["content"] == "Write a note to a friend."


def test_verl_layout_of_the_same_rows_loads_the_same_constraints(tmp_path: Path):
    rows = released_rows()
    released, _ = load_hir(write_jsonl(tmp_path / "a.jsonl", rows), ["ifeval", "ifbench"])
    verl, _ = load_hir(
        write_jsonl(tmp_path / "b.jsonl", [verl_row(r, "type4") for r in rows]),
        ["ifeval", "ifbench"],
    )
    assert [[(c.id, dict(c.kwargs), c.text) for c in r.constraints] for r in verl] == [
        [(c.id, dict(c.kwargs), c.text) for c in r.constraints] for r in released
    ]
    assert all(r.template == "type4" and r.meta["layout"] == "verl" for r in verl)


def test_unknown_layout_names_fields_found_and_layouts_accepted(tmp_path: Path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answers": []}])
    with pytest.raises(ValueError) as err:
        load_hir(path, ["ifeval"])
    msg = str(err.value)
    assert "['answers', 'question']" in msg
    assert "released: id, source, prompt, criteria, ground_truth" in msg
    assert "verl: data_source, reward_model, extra_info" in msg
    assert hir_layout({"data_source": 1, "reward_model": 2, "extra_info": 3}) == "verl"


def _one_constraint_task(tmp_path: Path, nltk_dir: str, source, iid, kwargs, checkers_="hir"):
    row = {
        "id": 1,
        "source": source,
        "prompt": "Repeat this: Write a poem about the sea.",
        "criteria": ["One rule."],
        "ground_truth": {"instruction_id_list": [iid], "kwargs": [kwargs]},
    }
    path = write_jsonl(tmp_path / f"{iid.replace(':', '_')}-{checkers_}.jsonl", [row])
    task = InstructionTask(nltk_data_dir=nltk_dir, data={"path": str(path), "checkers": checkers_})
    return task, task.examples("train")[0]


@pytest.mark.parametrize(
    ("source", "iid", "kwargs", "response", "hir", "official"),
    [
        # only HiR's language table has zh (officially the row is dropped); langdetect says
        # zh-cn, which HiR maps to zh
        ("type1", "language:response_language", {"language": "zh"}, ZH_TEXT, 1.0, "dropped"),
        ("type1", "language:response_language", {"language": "en"}, ZH_TEXT, 0.0, 0.0),
        # HiR's Chinese options for a constrained response
        ("type1", "detectable_format:constrained_response", {}, HIR_CHINESE_ANSWERS[0], 1.0, 0.0),
        ("type1", "detectable_format:constrained_response", {}, "My answer is no.", 1.0, 1.0),
        # older IFBench RepeatChangeChecker: the first character, not the first word
        (
            "type2",
            "repeat:repeat_change",
            {"prompt_to_repeat": "Write a poem about the sea."},
            "Compose a poem about the sea.",
            0.0,
            1.0,
        ),
        (
            "type2",
            "repeat:repeat_change",
            {"prompt_to_repeat": "Write a poem about the sea."},
            "Brite a poem about the sea.",  # both versions accept a changed first letter
            1.0,
            1.0,
        ),
    ],
)
def test_hir_checker_variants_give_hirs_verdicts(
    tmp_path, nltk_dir, source, iid, kwargs, response, hir, official
):
    if source == "type2":
        pytest.importorskip("if_verifiable", reason="IFBench checkers need if-verifiable")
    task, ex = _one_constraint_task(tmp_path, nltk_dir, source, iid, kwargs)
    assert ex.data["checkers"] == "hir"
    assert task.score(ex, response).rewards["c0"] == hir
    if official == "dropped":
        with pytest.raises(ValueError, match="official ifeval checker rejects its arguments"):
            _one_constraint_task(tmp_path, nltk_dir, source, iid, kwargs, "official")
        return
    task_o, ex_o = _one_constraint_task(tmp_path, nltk_dir, source, iid, kwargs, "official")
    assert task_o.score(ex_o, response).rewards["c0"] == official


def test_benchmarks_keep_the_official_checkers(nltk_dir: str):
    official = checkers.registry("ifeval", nltk_dir)
    hir = checkers.registry("ifeval", nltk_dir, "hir")
    iid = "language:response_language"
    assert official.instructions[iid].__name__ == "ResponseLanguageChecker"
    assert issubclass(hir.instructions[iid], official.instructions[iid])
    with pytest.raises(KeyError):  # the benchmark's table has no zh
        official.build(iid, {"language": "zh"}, "p")
    assert checkers.check(hir, iid, {"language": "zh"}, "p", ZH_TEXT, loose=False).strict
    ja = checkers.check(official, iid, {"language": "ja"}, "p", ZH_TEXT, loose=False)
    assert ja.strict is False
    with pytest.raises(ValueError, match=r"task\.data\.checkers"):
        InstructionTask(data={"checkers": "mine"})
