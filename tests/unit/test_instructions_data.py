"""Instruction data: the generator, the prompt templates, leave-one-out prompts, HIR-16K."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrtpo.tasks.base import Score
from mrtpo.tasks.instructions import InstructionTask, checkers
from mrtpo.tasks.instructions.data import (
    Constraint,
    constraint_record,
    load_hir,
    read_rows,
    render_prompt,
)
from mrtpo.tasks.instructions.generator import (
    BASE_PROMPTS,
    EXCLUDED,
    conflict_table,
    generate_records,
)


@pytest.fixture(scope="module")
def nltk_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("nltk_data"))


@pytest.fixture(scope="module")
def reg(nltk_dir: str) -> checkers.Registry:
    return checkers.ifeval_registry(nltk_dir)


@pytest.fixture(scope="module")
def generated(reg):
    return generate_records(reg, 300, seed=3)


def test_generator_counts_and_no_conflicting_pair(reg, generated):
    table = conflict_table(reg)
    counts = [len(r.constraints) for r in generated]
    assert min(counts) >= 5 and max(counts) <= 13
    assert set(counts) == set(range(5, 14))  # the whole range is used
    for r in generated:
        ids = [c.id for c in r.constraints]
        assert len(set(ids)) == len(ids)
        assert not set(ids) & set(EXCLUDED)
        for i, a in enumerate(ids):
            for b in ids[i + 1 :]:
                assert b not in table[a] and a not in table[b], (r.uid, a, b)
        # a word asked for by one constraint is never forbidden (or counted) by another
        words = [w for c in r.constraints for w in _words(c)]
        assert len(words) == len(set(words)), (r.uid, words)


def _words(c: Constraint) -> list[str]:
    out = []
    for key in ("keywords", "keyword", "forbidden_words", "first_word"):
        v = c.kwargs.get(key)
        out += [v.lower()] if isinstance(v, str) else [w.lower() for w in v or []]
    return out


def test_generator_is_reproducible_by_seed(reg, generated):
    again = generate_records(reg, 300, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in generated]
    assert [[dict(c.kwargs) for c in r.constraints] for r in again] == [
        [dict(c.kwargs) for c in r.constraints] for r in generated
    ]
    other = generate_records(reg, 300, seed=4)
    assert sum(a.prompt != b.prompt for a, b in zip(other, generated)) > 250


def test_generated_sentences_are_the_librarys_descriptions(reg, generated):
    for r in generated[:60]:
        for c in r.constraints:
            checker = reg.instructions[c.id](c.id)
            assert checker.build_description(**c.kwargs) == c.text
            assert dict(checker.get_instruction_args() or {}) == dict(c.kwargs)


def test_generated_prompts_are_not_ifeval_prompts(shared_data: Path):
    prompts = [row["prompt"] for row in read_rows(shared_data / "ifeval" / "input_data.jsonl")]
    for base in BASE_PROMPTS:
        assert not any(base in p or p in base for p in prompts), base


def _is_removal(longer: str, shorter: str, piece: str) -> bool:
    """True if deleting one occurrence of ``piece`` from ``longer`` gives ``shorter``."""
    i = longer.find(piece)
    while i >= 0:
        if longer[:i] + longer[i + len(piece) :] == shorter:
            return True
        i = longer.find(piece, i + 1)
    return False


def test_leave_one_out_prompt_drops_exactly_constraint_k(nltk_dir):
    task = InstructionTask(nltk_data_dir=nltk_dir, generator={"num_prompts": 40, "seed": 1})
    for ex in task.examples("train"):
        cons = ex.data["constraints"]
        ctx = task.contexts(ex, Score(rewards={}))
        assert ctx.all == ex.messages
        assert set(ctx.without) == {f"c{k}" for k in range(len(cons))}
        p0 = ex.messages[0]["content"]
        for k, c in enumerate(cons):
            pk = ctx.without[f"c{k}"][0]["content"]
            # the sentence and the line break that separated it, nothing else
            assert _is_removal(p0, pk, c["text"] + "\n") or _is_removal(p0, pk, "\n" + c["text"])
            assert len(p0) - len(pk) == len(c["text"]) + (1 if len(cons) > 1 else 2)
        assert ctx.none[0]["content"] == ex.data["base"]


@pytest.mark.parametrize("template", ["type1", "type2", "type3", "type4", "type5", "type6"])
def test_templates_leave_one_out(template):
    sentences = ["Use no commas", "Answer in French.", "End with a question?"]
    p0 = render_prompt("Describe a bridge.", sentences, template)
    for s in sentences:
        assert s in p0
    p1 = render_prompt("Describe a bridge.", [sentences[0], sentences[2]], template)
    piece = {
        "type1": "Answer in French. ",
        "type2": "Answer in French. ",
        "type5": "Answer in French. ",
        "type4": "- Answer in French.\n",
        "type6": "Answer in French.\n",
    }.get(template)
    if piece is not None:
        assert _is_removal(p0, p1, piece)
    else:  # the numbered list renumbers later items, as HiR's template does
        assert "1. Use no commas\n2. End with a question?" in p1
    assert render_prompt("Describe a bridge.", [], template) == "Describe a bridge."


def test_type1_template_adds_full_stops():
    got = render_prompt("Write.", ["No commas", "Be brief."], "type1")
    assert got == "Write. No commas. Be brief."


# ---- HIR-16K ---------------------------------------------------------------------------------
def _hir_row(source, q_type, question, ids, kwargs, criteria, as_text=True):
    gt = {"instruction_id_list": ids, "kwargs": kwargs}
    prompt = render_prompt(question, criteria, q_type)
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "instruction_following",
        "reward_model": {"style": "rule", "ground_truth": json.dumps(gt) if as_text else gt},
        "extra_info": {"index": 7, "question": question, "criteria": criteria, "q_type": q_type},
    }


def _hir_rows():
    return [
        _hir_row(
            "type1",
            "type1",
            "Write a note to a friend.",
            ["punctuation:no_comma", "keywords:existence"],
            [{}, {"keywords": ["kite"]}],
            ["Do not use any commas", "Mention the word kite."],
        ),
        _hir_row(
            "type2",
            "type3",
            "Describe a harbour.",
            ["count:keywords_multiple", "format:list"],
            [
                {
                    "keyword1": "a",
                    "keyword2": "b",
                    "keyword3": "c",
                    "keyword4": "d",
                    "keyword5": "e",
                },
                {"sep": "-"},
            ],
            ["Use the five keywords.", "Write a list."],
            as_text=False,
        ),
        _hir_row("type3", "type6", "Muldimif row.", ["x"], [{}], ["Some rule."]),
        _hir_row(
            "type1", "type4", "Broken row.", ["punctuation:no_comma"], [{}, {}], ["one", "two"]
        ),
    ]


def test_hir_loader_reads_its_published_format(tmp_path: Path):
    path = tmp_path / "hir.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _hir_rows()) + "\n")
    recs, skipped = load_hir(path, ["ifeval", "ifbench"])
    assert [r.registry for r in recs] == ["ifeval", "ifbench"]
    first = recs[0]
    assert first.base == "Write a note to a friend."
    assert [c.id for c in first.constraints] == ["punctuation:no_comma", "keywords:existence"]
    assert first.constraints[1].kwargs == {"keywords": ["kite"]}
    assert first.prompt == "Write a note to a friend. Do not use any commas. Mention the word kite."
    assert first.template == "type1" and recs[1].template == "type3"
    assert all(r.meta["stored_prompt_matches"] for r in recs)
    assert skipped == {
        "subset muldimif not selected": 1,
        "instruction ids, kwargs and criteria differ in length": 1,
    }
    only_ifeval, _ = load_hir(path, ["type1"])
    assert [r.registry for r in only_ifeval] == ["ifeval"]


def test_hir_loader_reads_parquet(tmp_path: Path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = _hir_rows()[:2]
    for r in rows:  # verl parquet keeps ground truth as text
        gt = r["reward_model"]["ground_truth"]
        r["reward_model"]["ground_truth"] = gt if isinstance(gt, str) else json.dumps(gt)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    recs, skipped = load_hir(path, ["ifeval", "ifbench"])
    assert len(recs) == 2 and not skipped
    assert recs[1].constraints[1].kwargs == {"sep": "-"}


def test_task_trains_on_hir_when_a_path_is_given(tmp_path: Path, nltk_dir: str):
    pytest.importorskip("if_verifiable", reason="IFBench-style rows need if-verifiable")
    path = tmp_path / "hir.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _hir_rows()))
    task = InstructionTask(nltk_data_dir=nltk_dir, data={"path": str(path)})
    train = task.examples("train")
    assert [e.data["source"] for e in train] == ["hir", "hir"]
    score = task.score(train[0], "I flew a kite today")
    assert score.rewards["c0"] == 1.0 and score.rewards["c1"] == 1.0 and score.rewards["c2"] is None
    ctx = task.contexts(train[0], score)
    assert ctx.without["c0"][0]["content"] == "Write a note to a friend. Mention the word kite."


def test_constraint_without_sentence_is_rejected():
    with pytest.raises(ValueError, match="sentence"):
        constraint_record("x", "base", [Constraint("a", {}, " ")], "ifeval", "hir")
