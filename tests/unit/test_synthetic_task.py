"""The synthetic task's toy setting: one token per word, references meet every constraint,
and each checker's decisive words are where the analysis expects them."""

from __future__ import annotations

import pytest
import yaml
from tests.conftest import CONFIG_DIR

from mrtpo.models import build_tokenizer
from mrtpo.tasks.synthetic import SyntheticTask
from mrtpo.tasks.synthetic.task import WORDS


@pytest.fixture(scope="module")
def toy_tokenizer():
    tiny = yaml.safe_load((CONFIG_DIR / "model" / "toy.yaml").read_text())["tiny"]
    return build_tokenizer(tiny["vocab_size"], tiny["extra_corpus"])


def test_every_word_is_one_token_with_or_without_a_leading_space(toy_tokenizer):
    for w in WORDS:
        for text in (w, " " + w):
            ids = toy_tokenizer(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == 1, f"{text!r} -> {ids}"


@pytest.mark.parametrize("k", [2, 4, 8])
def test_references_meet_every_constraint(k):
    task = SyntheticTask(num_constraints=k, num_train=200)
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
