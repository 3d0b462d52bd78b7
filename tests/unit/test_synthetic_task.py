"""The synthetic task's toy setting: one token per word, references meet every constraint,
and each checker's decisive words are where the analysis expects them."""

from __future__ import annotations

import pytest
import yaml
from tests.conftest import CONFIG_DIR

from mrtpo.core.models import build_tokenizer
from mrtpo.tasks.synthetic import SyntheticTask
from mrtpo.tasks.synthetic.task import (
    BASE_PROMPT,
    CLOSE,
    FILLER,
    MARKS,
    OPEN,
    THINK_PROMPT,
    WORDS,
    response_words,
    split_free,
)


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


# ---- the optional free part (task.free_tokens) and the mark's own rate (task.mark_success) ----


def _long(**kw):
    kw = {"num_constraints": 4, "num_train": 200, "closing_mark": True, "free_tokens": 5, **kw}
    return SyntheticTask(**kw)


def test_free_part_is_off_by_default_and_leaves_every_example_unchanged():
    off = SyntheticTask(num_constraints=4, num_train=100, closing_mark=True)
    again = SyntheticTask(
        num_constraints=4, num_train=100, closing_mark=True, free_tokens=None, mark_success=None
    )
    assert off.examples("train") == again.examples("train")
    assert "success_others" not in off.score(off.examples("train")[0], "x").checks


def test_free_part_only_adds_the_think_sentence_and_prefixes_the_reference():
    off = SyntheticTask(num_constraints=4, num_train=100, closing_mark=True)
    on = _long(num_train=100, free_tokens=[2, 7])
    for a, b in zip(off.examples("train"), on.examples("train"), strict=True):
        assert b.messages[-1]["content"] == a.messages[-1]["content"].replace(
            BASE_PROMPT, f"{BASE_PROMPT} {THINK_PROMPT}"
        )
        free, answer = split_free(b.reference)
        assert answer == " " + a.reference  # the same answer words, after the free part
        inner = free.removeprefix(OPEN).removesuffix(CLOSE).split()
        assert 2 <= len(inner) <= 7 and set(inner) <= set(FILLER)
        assert on.score(b, b.reference).checks["success"]


def test_free_words_are_one_token_and_no_task_or_prompt_word(toy_tokenizer):
    prompt_words = set(response_words(_long().examples("train")[0].messages[-1]["content"]))
    for w in FILLER:
        assert w not in WORDS and w not in prompt_words, w
        assert len(toy_tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1, w


def test_checkers_read_only_the_answer_part():
    task = _long()
    ex = task.examples("train")[0]
    by = {c.kind: c.value for c in ex.data["constraints"]}
    body = " ".join([by["first"], *["red"] * (int(by["count"]) - 2), by["last"]]) + by["mark"]
    good = task.score(ex, f"{OPEN} and or {CLOSE} {body}")
    assert good.checks["success"] and good.checks["answer_part"], good.reasons
    # the task's words (and a mark) inside the free part count for nothing ...
    decoy = f"{OPEN} {by['first']} {by['last']} {by['mark']} {CLOSE} red{by['mark']}"
    s = task.score(ex, decoy)
    assert s.rewards["first"] == 0.0 and s.rewards["last"] == 0.0 and s.rewards["count"] == 0.0
    assert s.rewards["mark"] == 1.0  # ... only the answer's own mark does
    # the same free part before the same answer words: only the answer decides
    a = task.score(ex, f"{OPEN} {CLOSE} {body}").rewards
    b = task.score(ex, f"{OPEN} {' '.join(WORDS)} {CLOSE} {body}").rewards
    assert a == b


@pytest.mark.parametrize(
    "response",
    ["", "red blue!", f"{OPEN} and or red blue!", f"{CLOSE} red blue!", f"red {OPEN} {CLOSE} x!"],
)
def test_a_response_without_an_answer_part_scores_zero_with_the_reason(response):
    task = _long()
    ex = task.examples("train")[0]
    s = task.score(ex, response)
    assert set(s.rewards.values()) == {0.0}, s.rewards  # exclude-type checks too: nothing passes
    assert not s.checks["answer_part"] and all("no answer part" in r for r in s.reasons.values())
    assert set(map(len, task.decisive_words(ex, response).values())) == {0}


def test_the_answer_follows_the_first_closing_marker():
    assert split_free(f"  {OPEN} a {CLOSE} b {CLOSE} c") == (f"  {OPEN} a {CLOSE}", f" b {CLOSE} c")
    assert split_free(f"{OPEN}{CLOSE}x!") == (f"{OPEN}{CLOSE}", "x!")


def test_decisive_words_count_the_free_part_words_too():
    task = _long(num_constraints=8, closing_mark=False)
    ex = task.examples("train")[0]
    by = {c.kind: c.value for c in ex.data["constraints"]}
    answer = " ".join([by["first"], by["include_1"], by["last"]])
    free = f"{OPEN} and {by['include_1']} or {CLOSE}"  # 5 words: think, and, <word>, or, think
    d = task.decisive_words(ex, f"{free} {answer}")
    assert d["first"] == [5] and d["include_1"] == [6] and d["last"] == [7]
    assert d["count"] == [8]  # the end of the response


@pytest.mark.parametrize("k", [2, 4, 8])
def test_mark_success_sets_the_marks_rate_apart_from_the_others(k):
    task = _long(num_constraints=k, num_train=3000, reference_success=0.3, mark_success=0.05)
    scores = [task.score(ex, ex.reference) for ex in task.examples("train")]
    assert all(s.checks["answer_part"] for s in scores)
    mark = sum(s.rewards["mark"] for s in scores) / len(scores)
    others = sum(s.checks["success_others"] for s in scores) / len(scores)
    assert abs(mark - 0.05) < 0.02 and abs(others - 0.3) < 0.04, (mark, others)
    summary = task.summarize(task.examples("train"), scores)
    assert summary["success_others"] == pytest.approx(others)
    assert summary["reward/mark"] == pytest.approx(mark)


def test_mark_break_none_leaves_a_broken_mark_out():
    kw = dict(num_train=600, reference_success=0.3, mark_success=0.0)
    either = [ex.reference for ex in _long(**kw).examples("train")]
    none = [ex.reference for ex in _long(mark_break="none", **kw).examples("train")]
    # by default a broken mark is missing or another one; with "none" it is always missing
    assert any(r.endswith(("!", "?", ".")) for r in either)
    assert not any(r.endswith(("!", "?", ".")) for r in none)
    clean = [ex.reference for ex in _long(mark_break="none", num_train=50).examples("train")]
    assert all(r.endswith(("!", "?", ".")) for r in clean)  # only broken marks are left out


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"mark_break": "other"}, "mark_break"),
        ({"free_tokens": -1}, "free_tokens"),
        ({"free_tokens": [5, 2]}, "free_tokens"),
        ({"free_tokens": "60"}, "free_tokens"),
        ({"mark_success": 1.5}, "mark_success"),
        ({"mark_success": 0.1, "closing_mark": False}, "closing_mark"),
    ],
)
def test_bad_free_part_or_mark_rate_is_refused_naming_the_key(kw, key):
    with pytest.raises(ValueError, match=rf"task\.{key}"):
        _long(**kw)


def test_long_presets_compose_a_free_part_that_fits_the_token_budget():
    from mrtpo.run.config import compose

    for name in ("toy_long", "toy_long_sft", "toy_long_sft_noisy"):
        cfg = compose("train.yaml", [f"experiment={name}"])
        free = cfg.task.free_tokens
        # 3 tokens per marker, one per word, the toy's 12 for the answer
        assert cfg.rollout.sampling.max_new_tokens >= free + 6 + 12, name
    noisy = compose("train.yaml", ["experiment=toy_long_sft_noisy"])
    assert noisy.stage.sft.target_metric == "reward/mark" and noisy.task.mark_success == 0.0
    assert noisy.stage.sft.stop_when == "below" and noisy.stage.sft.target_success == 0.05
