"""Evaluate-responses mode on the official IFEval / IFBench prompts (no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrtpo.core.evaluation import read_jsonl, score_responses
from mrtpo.tasks.instructions import InstructionTask, checkers

WORDS_310 = " ".join(["steady"] * 310)
LOWER = (
    "the old castle stood on the hill above the village and the people who lived there "
    "told stories about it every winter evening by the fire "
)

# (IFEval key, response, expected strict verdict per instruction, expected loose verdicts)
CASES = [
    # punctuation:no_comma, detectable_format:number_highlighted_sections (3), number_words >= 300
    (1000, f"{WORDS_310} *one* *two* *three*", [True, True, True], [True, True, True]),
    (1000, f"{WORDS_310}, *one* *two* *three*", [False, True, True], [False, True, True]),
    (1000, "*one*, short", [False, False, False], [False, False, False]),
    # length_constraints:number_paragraphs (2, *** dividers), detectable_content:postscript P.P.S
    (143, "First part.\n***\nSecond part.\nP.P.S see you", [True, True], [True, True]),
    (143, "First part.\n***\nSecond part.", [True, False], [True, False]),
    (143, "Only one part.\nP.P.S later", [False, True], [False, True]),
    # startend:quotation, keywords:frequency (knock >= 2), keywords:existence (cat)
    (142, '"Knock knock. Who is there? The cat."', [True, True, True], [True, True, True]),
    (142, 'Sure:\n"Knock knock. The cat."', [False, True, True], [True, True, True]),
    # every example gets the same number of responses (evaluation refuses uneven counts)
    (142, '"Knock, knock. The dog."', [True, True, False], [True, True, False]),
    # change_case:english_lowercase, keywords:frequency (story >= 2)
    (1153, f"{LOWER}and each story was a better story", [True, True], [True, True]),
    (1153, f"The {LOWER}and one story", [False, False], [False, False]),
    (1153, f"{LOWER}and no tale twice", [True, False], [True, False]),
]


@pytest.fixture(scope="module")
def task(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> InstructionTask:
    return InstructionTask(
        nltk_data_dir=str(tmp_path_factory.mktemp("nltk_data")),
        eval_files={
            "ifeval": str(shared_data / "ifeval" / "input_data.jsonl"),
            "ifbench": str(shared_data / "ifbench" / "IFBench_test.jsonl"),
        },
        unavailable_checkers="skip",
    )


def test_ifeval_split_is_the_official_541_prompts(task):
    examples = task.examples("ifeval")
    assert len(examples) == 541
    ex = {e.id: e for e in examples}["1000"]
    assert ex.messages[0]["content"].startswith("Write a 300+ word summary")
    assert ex.data["constraints"][0]["id"] == "punctuation:no_comma"
    assert task.examples("val") is examples  # validation runs on IFEval by default
    ctx = task.contexts(ex, task.score(ex, "x"))
    assert ctx.without == {} and ctx.all == ex.messages  # never trained on: no replay contexts


def test_constructed_responses_give_the_expected_verdicts(task, tmp_path: Path):
    lines = [{"id": str(key), "response": text} for key, text, _, _ in CASES]
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps(line) + "\n" for line in lines))
    metrics = score_responses(task, task.examples("ifeval"), responses, tmp_path / "out")

    rows = read_jsonl(tmp_path / "out" / "results.jsonl")
    assert len(rows) == len(CASES)
    for row, (key, _, strict, loose) in zip(rows, CASES):
        assert row["id"] == str(key)
        assert row["check/strict"] == strict, (key, row.get("reasons"))
        assert row["check/loose"] == loose, key
        for i, ok in enumerate(strict):
            assert row[f"reward/c{i}"] == (1.0 if ok else 0.0)
            assert (f"c{i}" in row.get("reasons", {})) == (not ok)
        assert row[f"reward/c{len(strict)}"] is None

    n = len(CASES)
    assert metrics["prompt_level_strict_acc"] == pytest.approx(sum(all(c[2]) for c in CASES) / n)
    assert metrics["prompt_level_loose_acc"] == pytest.approx(sum(all(c[3]) for c in CASES) / n)
    flat = [ok for c in CASES for ok in c[2]]
    assert metrics["inst_level_strict_acc"] == pytest.approx(sum(flat) / len(flat))
    assert metrics["n_prompts"] == 4 and metrics["n_scoring_errors"] == 0
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["inst_strict/punctuation:no_comma"] == pytest.approx(1 / 3)


def test_ifbench_responses(task, tmp_path: Path):
    pytest.importorskip("if_verifiable", reason="IFBench checkers need if-verifiable")
    examples = task.examples("ifbench")
    assert len(examples) + task.skipped.get("ifbench", 0) == 294
    # key 0: count:keywords_multiple (kaleidoscope x1, nebula x2, whisper x3, labyrinth x5,
    # paradox x7, exactly)
    good = " ".join(
        ["kaleidoscope"] + ["nebula"] * 2 + ["whisper"] * 3 + ["labyrinth"] * 5 + ["paradox"] * 7
    )
    lines = [{"id": "0", "response": good}, {"id": "0", "response": good + " paradox"}]
    responses = tmp_path / "r.jsonl"
    responses.write_text("".join(json.dumps(line) + "\n" for line in lines))
    metrics = score_responses(task, examples, responses, tmp_path / "out")
    rows = read_jsonl(tmp_path / "out" / "results.jsonl")
    assert [r["check/strict"] for r in rows] == [[True], [False]]
    assert metrics["prompt_level_strict_acc"] == 0.5
    if task.skipped.get("ifbench"):
        assert metrics["n_prompts_skipped"] == task.skipped["ifbench"]


# ---- IFBench prompts whose checkers need NLTK data that is not installed (issue 29 item 1) --
NEEDS_STOPWORDS = "171"  # ratio:stop_words only
NEEDS_TAGGER = "257"  # words:start_verb only


@pytest.fixture(scope="module")
def strict_task(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> InstructionTask:
    """unavailable_checkers=error (the default); skips when every IFBench checker can run."""
    pytest.importorskip("if_verifiable", reason="IFBench checkers need if-verifiable")
    import nltk

    try:
        nltk.data.find("corpora/stopwords")
        pytest.skip("NLTK stopwords are installed here: every IFBench checker runs")
    except LookupError:
        pass
    return InstructionTask(
        nltk_data_dir=str(tmp_path_factory.mktemp("nltk_data")),
        eval_files={"ifbench": str(shared_data / "ifbench" / "IFBench_test.jsonl")},
    )


def _lines(path: Path, ids: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "response": "An answer."}) + "\n" for i in ids))
    return path


def test_ifbench_responses_that_avoid_the_unavailable_checkers_are_scored(strict_task, tmp_path):
    # the whole split cannot be used here (training / validation would refuse it)...
    with pytest.raises(checkers.CheckerUnavailable, match=r"18 of 294 prompts"):
        strict_task.examples("ifbench")
    # ...but a predictions file that covers none of those 18 prompts is scored
    preds = _lines(tmp_path / "preds.jsonl", ["0", "1", "2"])
    examples = strict_task.eval_examples("ifbench", {"responses": str(preds)})
    assert len(examples) == 294
    metrics = score_responses(strict_task, examples, preds, tmp_path / "out")
    assert metrics["n_prompts"] == 3 and metrics["n_scoring_errors"] == 0
    assert "n_prompts_skipped" not in metrics


def test_ifbench_responses_that_need_them_name_the_prompts_and_the_install(strict_task, tmp_path):
    preds = _lines(tmp_path / "preds.jsonl", ["0", NEEDS_STOPWORDS, NEEDS_TAGGER])
    examples = strict_task.eval_examples("ifbench", {"responses": str(preds)})
    with pytest.raises(checkers.CheckerUnavailable) as err:
        score_responses(strict_task, examples, preds, tmp_path / "out")
    msg = str(err.value)
    assert "2 of the 3 prompts evaluated (ids ['171', '257'])" in msg
    assert "'ratio:stop_words', 'words:start_verb'" in msg
    assert "nltk.downloader" in msg and "task.nltk_data_dir" in msg
    assert "task.unavailable_checkers=skip" in msg
    assert not (tmp_path / "out").exists()  # nothing scored, nothing written


def test_ifbench_generation_checks_only_the_prompts_within_the_limit(strict_task):
    # generate mode scores the first eval.limit prompts; the first unavailable one is key 133
    assert len(strict_task.eval_examples("ifbench", {"limit": 100})) == 294
    with pytest.raises(checkers.CheckerUnavailable, match=r"5 of the 150 prompts evaluated"):
        strict_task.eval_examples("ifbench", {"limit": 150})


def test_eval_job_scores_an_ifbench_file_that_avoids_them(strict_task, shared_data, tmp_path):
    """Through the evaluation job of src/eval.py (responses mode needs no model)."""
    from mrtpo.evaluate.job import run
    from mrtpo.run.config import compose

    preds = _lines(tmp_path / "preds.jsonl", ["0", "5"])
    overrides = [
        "task=ifeval",
        "eval.split=ifbench",
        f"eval.responses={preds}",
        f"eval.output={tmp_path / 'out'}",
        f"paths.data_dir={shared_data}",
        f"task.nltk_data_dir={strict_task.nltk_data_dir}",
    ]
    metrics = run(compose("eval.yaml", overrides), overrides=overrides)
    assert metrics["n_prompts"] == 2
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["scored"]["examples"] == 294
