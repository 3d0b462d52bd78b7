"""The synthetic task's toy setting: one token per word, references meet every constraint,
and each checker's decisive words are where the analysis expects them."""

from __future__ import annotations

import pytest
import yaml
from tests.conftest import CONFIG_DIR

from mrtpo.models import build_tokenizer
from mrtpo.tasks.synthetic import SyntheticTask
from mrtpo.tasks.synthetic.task import MARKS, WORDS


@pytest.fixture(scope="module")
def toy_tokenizer():
    tiny = yaml.safe_load((CONFIG_DIR / "model" / "toy.yaml").read_text())["tiny"]
    return build_tokenizer(tiny["vocab_size"], tiny["extra_corpus"])


def test_every_word_is_one_token_with_or_without_a_leading_space(toy_tokenizer):
    for w in WORDS:
        for text in (w, " " + w):
            ids = toy_tokenizer(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == 1, f"{text!r} -> {ids}"


@pytest.mark.parametrize("mark", [False, True])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_references_meet_every_constraint(k, mark):
    task = SyntheticTask(num_constraints=k, num_train=200, closing_mark=mark)
    for ex in task.examples("train"):
        s = task.score(ex, ex.reference)
        assert s.checks["success"], (ex.messages[-1]["content"], ex.reference, s.reasons)


def test_decisive_words():
    task = SyntheticTask(num_constraints=8, num_train=50)
    ex = task.examples("train")[0]
    by = {c.kind: c.value for c in ex.data["constraints"]}
    words = [by["first"], by["include_1"], by["exclude_1"], by["include_1"], by["last"]]
    d = task.decisive_words(ex, " ".join(words))
    assert d["first"] == [0] and d["last"] == [4]
    assert d["include_1"] == [1, 3] and d["exclude_1"] == [2]
    assert d["include_2"] == [] and d["exclude_2"] == []
    assert d["count"] == [5]  # the end of the response
    assert task.decisive_words(ex, "")["first"] == []


@pytest.mark.parametrize("k", [2, 4, 8])
def test_reference_success_sets_the_share_of_fully_compliant_references(k):
    task = SyntheticTask(num_constraints=k, num_train=3000, reference_success=0.25)
    scores = [task.score(ex, ex.reference) for ex in task.examples("train")]
    share = sum(s.checks["success"] for s in scores) / len(scores)
    assert abs(share - 0.25) < 0.04
    per = 0.25 ** (1 / k)  # each constraint is broken independently
    for name in task.reward_names:
        met = sum(s.rewards[name] for s in scores) / len(scores)
        assert abs(met - per) < 0.07, (name, met, per)
    # the prompts do not change with the references' quality
    clean = SyntheticTask(num_constraints=k, num_train=3000)
    assert [e.messages for e in clean.examples("train")] == [
        e.messages for e in task.examples("train")
    ]


def test_reference_success_must_be_a_rate():
    with pytest.raises(ValueError, match=r"task\.reference_success"):
        SyntheticTask(reference_success=0.0)


# ---- the optional few-token constraint (task.closing_mark) ----------------------------------


def test_closing_mark_is_off_by_default_and_changes_nothing_then():
    off = SyntheticTask(num_constraints=4, num_train=100)
    assert "mark" not in off.reward_names
    assert off.reward_names == ("first", "last", "include_1", "count")


@pytest.mark.parametrize(
    ("k", "names"),
    [
        (2, ("first", "mark")),  # no include: the last constraint becomes the mark
        (4, ("first", "last", "mark", "count")),  # the count (where to stop) is kept
        (8, ("first", "last", "include_1", "count", "exclude_1", "include_2", "exclude_2", "mark")),
    ],
)
def test_closing_mark_takes_the_last_include_slot(k, names):
    assert SyntheticTask(num_constraints=k, closing_mark=True).reward_names == names


def _mark_example(value: str):
    task = SyntheticTask(num_constraints=4, num_train=60, closing_mark=True)
    ex = next(e for e in task.examples("train") if e.data["constraints"][2].value == value)
    return task, ex


@pytest.mark.parametrize("value", MARKS)
def test_mark_checker_reads_the_last_visible_character_only(value):
    task, ex = _mark_example(value)
    by = {c.kind: c.value for c in ex.data["constraints"]}
    words = [by["first"], *["red"] * (int(by["count"]) - 2), by["last"]]
    body = " ".join(words)
    other = next(m for m in MARKS if m != value)

    def mark(text):
        return task.score(ex, text).rewards["mark"]

    assert mark(body + value) == 1.0
    assert mark(body + " " + value + "  \n") == 1.0  # a space before, whitespace after
    assert mark(body) == 0.0  # no mark
    assert mark(body + other) == 0.0  # another mark
    assert mark(body + value + other) == 0.0  # the last one counts
    assert mark(value + " " + body) == 0.0  # elsewhere does not count
    assert mark("") == 0.0 and mark(value) == 1.0
    # nothing else depends on it: the words' constraints are met either way
    for text in (body, body + value, body + other):
        s = task.score(ex, text)
        assert all(s.rewards[n] == 1.0 for n in ("first", "last", "count")), s.reasons
    assert task.score(ex, body + value).checks["success"]
    assert not task.score(ex, body + other).checks["success"]
    assert "ends with" in task.score(ex, body + other).reasons["mark"]


def test_mark_is_stated_in_the_prompt_and_removed_from_its_replay_context():
    task, ex = _mark_example("?")
    prompt = ex.messages[-1]["content"]
    assert "Add the mark ? after the words." in prompt
    ctx = task.contexts(ex, task.score(ex, ex.reference))
    assert "Add the mark" not in ctx.without["mark"][-1]["content"]
    assert "Add the mark ? after the words." in ctx.without["first"][-1]["content"]


def test_mark_is_one_token_of_the_toy_tokenizer(toy_tokenizer):
    for m in MARKS:
        ids = toy_tokenizer("stone" + m, add_special_tokens=False)["input_ids"]
        assert len(ids) == 2, (m, ids)  # the word, then the mark on its own


def test_noisy_references_break_the_mark_independently():
    task = SyntheticTask(
        num_constraints=4, num_train=3000, closing_mark=True, reference_success=0.25
    )
    scores = [task.score(ex, ex.reference) for ex in task.examples("train")]
    per = 0.25 ** (1 / 4)
    met = sum(s.rewards["mark"] for s in scores) / len(scores)
    assert abs(met - per) < 0.05
    share = sum(s.checks["success"] for s in scores) / len(scores)
    assert abs(share - 0.25) < 0.04
    # same prompts as the clean task
    clean = SyntheticTask(num_constraints=4, num_train=3000, closing_mark=True)
    assert [e.messages for e in clean.examples("train")][:50] == [
        e.messages for e in task.examples("train")
    ][:50]


def test_decisive_words_of_the_mark_is_the_end():
    task, ex = _mark_example("!")
    assert task.decisive_words(ex, "red blue green!")["mark"] == [3]
