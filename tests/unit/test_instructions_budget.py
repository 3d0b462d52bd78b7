"""A time budget per call of the official instruction checkers (issue 25, item 19).

Under the 16,384-character cap some upstream checkers still take seconds (lm-eval's
``number_placeholders`` on a run of ``[``, ``number_bullet_lists`` on newlines; MulDimIF's
``Length_Sentences`` on ordinary text without ``.!?``, such as Chinese prose). They stay
unchanged; ``mrtpo.tasks.deadline`` interrupts a call that runs past
``task.checker_timeout_s`` and the constraint fails with that reason. These tests set a small
budget so that the slow inputs (seconds) trip it by a wide margin, and never assert how long
anything took, except through hang guards sized for a machine far slower than this one.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from mrtpo.tasks.base import Example
from mrtpo.tasks.deadline import CheckTimeout, call_with_budget
from mrtpo.tasks.instructions import InstructionTask
from mrtpo.tasks.instructions.judge import JudgeError, parse_verdicts

CAP = 16_384
SMALL_BUDGET_S = 0.25  # each slow case below takes seconds at the cap (2.5 s to 13 s measured)
HANG_GUARD_S = 300.0
MAX_SLOWDOWN = 24  # linear costs ~8x, quadratic 64x (the fuzz tests' ratio)


def _quadratic_regex(n: int) -> int:
    return len(re.findall(r"\[.*?\]", "[" * n))  # lm-eval's number_placeholders pattern


def _timer_is_clear() -> bool:
    return signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


# ---- the deadline itself -----------------------------------------------------------------


def test_a_slow_regex_is_interrupted_and_the_process_state_restored():
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.perf_counter()
    with pytest.raises(CheckTimeout, match=r"the checker ran past its time budget of 0\.05 s"):
        call_with_budget(_quadratic_regex, 200_000, seconds=0.05, what="the checker")
    assert time.perf_counter() - t0 < HANG_GUARD_S  # unbounded, this takes minutes
    assert _timer_is_clear() and signal.getsignal(signal.SIGALRM) is before
    assert call_with_budget(_quadratic_regex, 10, seconds=5.0, what="x") == 0
    assert _timer_is_clear() and signal.getsignal(signal.SIGALRM) is before


def test_a_checker_that_catches_exception_cannot_swallow_the_deadline():
    def stubborn() -> str:
        try:
            _quadratic_regex(200_000)
        except Exception:  # what many checkers do around their parsing
            return "swallowed"
        return "finished"

    with pytest.raises(CheckTimeout):
        call_with_budget(stubborn, seconds=0.05, what="stubborn")


def test_checker_errors_pass_through_and_none_means_no_budget():
    def boom() -> None:
        raise ValueError("bad text")

    with pytest.raises(ValueError, match="bad text"):
        call_with_budget(boom, seconds=1.0, what="boom")
    assert _timer_is_clear()
    assert call_with_budget(lambda: 7, seconds=None, what="x") == 7


def test_off_the_main_thread_the_call_runs_unbudgeted_and_says_so(caplog, monkeypatch):
    from mrtpo.tasks import deadline

    monkeypatch.setattr(deadline, "_WARNED", set())  # logged once per process otherwise
    caplog.set_level(logging.WARNING, logger="mrtpo.tasks.deadline")
    out: list[object] = []
    th = threading.Thread(
        target=lambda: out.append(call_with_budget(len, "abc", seconds=0.01, what="x"))
    )
    th.start()
    th.join(HANG_GUARD_S)
    assert out == [3]
    assert any("outside the main thread" in r.getMessage() for r in caplog.records)


# ---- IFEval checkers (lm-eval, unchanged) ---------------------------------------------------


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> InstructionTask:
    pytest.importorskip("lm_eval", reason="the IFEval checkers come from lm-eval")
    return InstructionTask(
        nltk_data_dir=str(tmp_path_factory.mktemp("nltk")), checker_timeout_s=SMALL_BUDGET_S
    )


def _example(constraints, is_eval: bool) -> Example:
    cons = [{"id": i, "kwargs": k, "text": None} for i, k in constraints]
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
    return Example(id="slow", messages=[{"role": "user", "content": "Write an essay."}], data=data)


SLOW = [
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[" * CAP),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "a" + "\n" * (CAP - 2) + "b"),
]


@pytest.mark.parametrize("is_eval", [False, True], ids=["train", "eval-loose"])
@pytest.mark.parametrize(("iid", "kwargs", "text"), SLOW, ids=[s[0] for s in SLOW])
def test_a_slow_official_checker_fails_its_constraint_with_the_reason(
    task, caplog, iid, kwargs, text, is_eval
):
    caplog.set_level(logging.WARNING, logger="mrtpo.tasks.instructions.task")
    ex = _example([(iid, kwargs), ("punctuation:no_comma", {})], is_eval)
    t0 = time.perf_counter()
    score = task.score(ex, text)
    assert time.perf_counter() - t0 < HANG_GUARD_S
    assert score.rewards["c0"] == 0.0 and score.checks["strict"][0] is False
    assert (
        f"{iid}: the ifeval checker of '{iid}' ran past its time budget of 0.25 s"
        in (score.reasons["c0"])
    )
    assert score.checks["timeouts"] == 1
    assert score.rewards["c1"] == 1.0  # the fast checker of the same response still ran
    if is_eval:
        assert score.checks["loose"] == [False, True]  # no loose retries after a timeout
    m = task.summarize([ex], [score])
    assert m["n_checker_timeouts"] == 1.0 and m["n_scored"] == 1.0


def test_the_budget_bounds_how_the_score_grows_with_the_text(task):
    """Eight times the text may cost at most ``MAX_SLOWDOWN`` times more (as in the fuzz
    tests' linear-time checks): unbounded, ``number_placeholders`` grows 64-fold; under the
    budget the long text costs about one budget."""
    ex = _example([SLOW[0][:2]], False)

    def best_of_3(n: int) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            task.score(ex, "[" * n)
            times.append(time.perf_counter() - t0)
        return min(times)

    small, large = best_of_3(CAP // 8), best_of_3(CAP)
    assert large < MAX_SLOWDOWN * small, f"{large / small:.0f}x ({small:.3f}s -> {large:.3f}s)"


def test_the_first_timeout_is_logged_with_the_key(tmp_path, caplog):
    pytest.importorskip("lm_eval", reason="the IFEval checkers come from lm-eval")
    fresh = InstructionTask(nltk_data_dir=str(tmp_path), checker_timeout_s=SMALL_BUDGET_S)
    caplog.set_level(logging.WARNING, logger="mrtpo.tasks.instructions.task")
    ex = _example([SLOW[0][:2]], False)
    fresh.score(ex, SLOW[0][2])
    fresh.score(ex, SLOW[0][2])
    logged = [r.getMessage() for r in caplog.records if "task.checker_timeout_s" in r.getMessage()]
    assert len(logged) == 1 and "task.checker_timeout_s=0.25" in logged[0]
    assert fresh.n_timeouts == 2


def test_ordinary_responses_are_checked_as_before_under_the_default_budget(tmp_path):
    pytest.importorskip("lm_eval", reason="the IFEval checkers come from lm-eval")
    default = InstructionTask(nltk_data_dir=str(tmp_path))
    assert default.checker_timeout_s == 2.0
    ex = _example([SLOW[0][:2], ("punctuation:no_comma", {})], True)
    score = default.score(ex, "One [a] and [b] here. No commas at all.")
    assert score.rewards == {**dict.fromkeys(default.reward_names), "c0": 1.0, "c1": 1.0}
    assert "timeouts" not in score.checks and score.checks["loose"] == [True, True]
    assert InstructionTask(checker_timeout_s=None).checker_timeout_s is None
    with pytest.raises(ValueError, match=r"task\.checker_timeout_s"):
        InstructionTask(checker_timeout_s=0)


# ---- MulDimIF checkers (the authors' folder, unchanged) --------------------------------------


def test_muldimif_length_sentences_on_long_chinese_text_fails_within_the_budget(
    shared_data: Path, tmp_path: Path
):
    pytest.importorskip("zhconv", reason="the MulDimIF checkers need zhconv (mrtpo[muldimif])")
    checker_dir = shared_data.parent / "vendor" / "muldimif"
    if not (checker_dir / "evaluation.py").is_file():
        pytest.skip(f"MulDimIF checkers not found at {checker_dir}")
    md = InstructionTask(
        nltk_data_dir=str(tmp_path),
        eval_files={"muldimif": str(shared_data / "muldimif" / "test.json")},
        muldimif={"checker_dir": str(checker_dir)},
        checker_timeout_s=SMALL_BUDGET_S,
    )
    ex = next(
        e
        for e in md.examples("muldimif")
        if [c["id"] for c in e.data["constraints"]] == ["Length_Sentences"]
    )
    prose = ("今天天气很好，我们去公园散步吧。" * 2_000)[:CAP]  # no ".!?": 13 s unbounded here
    t0 = time.perf_counter()
    score = md.score(ex, prose)
    assert time.perf_counter() - t0 < HANG_GUARD_S
    assert score.error is None and score.rewards["c0"] == 0.0
    assert (
        "Length_Sentences: checker Length_Sentences ran past its time budget"
        in (score.reasons["c0"])
    )
    assert score.checks["timeouts"] == 1
    assert md.summarize([ex], [score])["n_checker_timeouts"] == 1.0


# ---- the AdvancedIF judge's reply parser -------------------------------------------------------


@pytest.mark.parametrize(
    "reply",
    [
        '{"verdicts": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "[" * 50_000 + "true" + "]" * 50_000,
    ],
    ids=["nested-object", "nested-list"],
)
def test_a_deeply_nested_judge_reply_is_unusable_not_a_crash(reply):
    with pytest.raises(JudgeError, match="not a list of 1 booleans"):
        parse_verdicts(reply, 1)


def test_the_judge_parser_finds_what_the_greedy_regex_found():
    import random

    from mrtpo.tasks.instructions.judge import _json_spans

    rng = random.Random(0)
    for _ in range(2_000):
        text = "".join(rng.choice("{}[]a") for _ in range(rng.randint(0, 24)))
        assert _json_spans(text) == re.findall(r"\{.*\}|\[.*\]", text, flags=re.DOTALL), text
    assert parse_verdicts('Here: {"verdicts": [true, false]} done', 2) == [True, False]
    assert parse_verdicts("Sure.\n" + json.dumps([False]) + "\nDone.", 1) == [False]
