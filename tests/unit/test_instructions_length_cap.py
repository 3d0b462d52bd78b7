"""The response-length cap in front of lm-eval's IFEval checkers (upstream code, unchanged).

Some upstream checkers take time quadratic in the length of pathological text (an unclosed
``[`` run for number_placeholders, long space runs for postscript, ...). The task refuses
responses over ``task.max_response_chars`` before any checker runs; this fuzz test holds the
worst inputs to a fixed time bound.
"""

from __future__ import annotations

import random
import time

import pytest

from mrtpo.tasks.base import Example
from mrtpo.tasks.instructions import InstructionTask

pytest.importorskip("lm_eval", reason="the IFEval checkers come from lm-eval")

N = 64_000
BOUND_S = 5.0  # the cap is O(1); uncapped, the "brackets" case takes 2.2 s at 16k characters and grows quadratically
WORST = {
    "brackets": "[" * N,
    "newlines": "a" + "\n" * N + "b",
    "spaces": "a" + " " * N + "b",
    "mixed": "[ \n" * (N // 3),
}
# Constraints whose upstream checkers are the slow ones on the inputs above.
CONSTRAINTS = [
    ("detectable_content:number_placeholders", {"num_placeholders": 2}),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}),
    ("language:response_language", {"language": "en"}),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 3}),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 3, "capital_relation": "less than"},
    ),
]


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> InstructionTask:
    return InstructionTask(nltk_data_dir=str(tmp_path_factory.mktemp("nltk")))


def _example(is_eval: bool) -> Example:
    cons = [{"id": i, "kwargs": k, "text": None} for i, k in CONSTRAINTS]
    data = {
        "split": "ifeval",
        "source": "ifeval",
        "registry": "ifeval",
        "base": None,
        "template": None,
        "prompt": "Write an essay.",
        "constraints": cons,
        "eval": is_eval,
        "checkers": "official",
    }
    return Example(id="x", messages=[{"role": "user", "content": "Write an essay."}], data=data)


@pytest.mark.parametrize("name", sorted(WORST))
@pytest.mark.parametrize("is_eval", [False, True], ids=["train", "eval-loose"])
def test_worst_inputs_finish_under_a_fixed_bound(task, name, is_eval):
    ex = _example(is_eval)
    t = time.perf_counter()
    score = task.score(ex, WORST[name])
    elapsed = time.perf_counter() - t
    assert elapsed < BOUND_S, f"{name}: {elapsed:.2f}s"
    assert all(score.rewards[f"c{i}"] == 0.0 for i in range(len(CONSTRAINTS)))
    assert score.checks["over_length"] and score.checks["strict"] == [False] * len(CONSTRAINTS)
    assert "task.max_response_chars=16384" in score.reasons["c0"]
    if is_eval:
        assert score.checks["loose"] == [False] * len(CONSTRAINTS)
    m = task.summarize([ex], [score])
    assert m["n_over_length"] == 1.0 and m["prompt_level_strict_acc"] == 0.0


def test_random_long_texts_are_bounded_and_short_ones_are_checked(task):
    rng = random.Random(0)
    ex = _example(False)
    alphabet = "[] \n*#abcP.S"
    for _ in range(5):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(17_000, 70_000)))
        t = time.perf_counter()
        score = task.score(ex, text)
        assert time.perf_counter() - t < BOUND_S and score.checks["over_length"]
    ok = task.score(ex, "One [a] and [b].\n\nP.S. done")
    assert "over_length" not in ok.checks and ok.rewards["c0"] == 1.0 and ok.rewards["c1"] == 1.0


def test_cap_is_configurable_and_validated(tmp_path):
    small = InstructionTask(nltk_data_dir=str(tmp_path), max_response_chars=10)
    assert small.score(_example(False), "x" * 11).checks["over_length"]
    assert InstructionTask(max_response_chars=None).max_response_chars is None
    with pytest.raises(ValueError, match=r"task\.max_response_chars"):
        InstructionTask(max_response_chars=0)
