"""BFCL v4 conversion and scoring through BFCL's own AST checker (data shipped in bfcl-eval).

The fast checks here use a sample of every category; ``tests/integration`` runs them all.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.bfcl_oracle import calls_to_response, corrupt_calls, oracle_calls

from mrtpo.tasks.toolcall import ToolCallTask, bfcl
from mrtpo.tasks.toolcall.parsing import parse_tools

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bfcl_eval") is None,
    reason=f"bfcl-eval not installed ({bfcl.INSTALL_HINT})",
)

SAMPLE_PER_CATEGORY = 25


@pytest.fixture(scope="module")
def sample() -> list:
    by_cat = defaultdict(list)
    for e in bfcl.load_cases(None):
        by_cat[e.data["category"]].append(e)
    out = []
    for cases in by_cat.values():
        stride = max(1, len(cases) // SAMPLE_PER_CATEGORY)
        out += cases[::stride][:SAMPLE_PER_CATEGORY]
    return out


def test_categories_and_counts() -> None:
    counts = {c: len(bfcl.read_category(c)) for c in bfcl.CATEGORIES}
    assert counts == {
        "simple_python": 400,
        "simple_java": 100,
        "simple_javascript": 50,
        "multiple": 200,
        "parallel": 200,
        "parallel_multiple": 200,
        "live_simple": 258,
        "live_multiple": 1053,
        "live_parallel": 16,
        "live_parallel_multiple": 24,
    }


def test_possible_answers_pass_and_one_wrong_value_fails(sample: list) -> None:
    """Acceptance: each case's possible answer, written in our format, is accepted by the
    official checker; with one argument value made wrong it is rejected."""
    task = ToolCallTask()
    results = defaultdict(list)
    wrong = defaultdict(list)
    for e in sample:
        before = copy.deepcopy(e.data)
        calls = oracle_calls(e)
        if e.id in bfcl.UNMEETABLE_CASES:
            assert calls is None, e.id
            continue
        assert calls is not None, e.id
        score = task.score(e, calls_to_response(calls))
        assert score.rewards["format"] == 1.0
        results[e.data["category"]].append(score.checks["bfcl_valid"])
        bad = task.score(e, calls_to_response(corrupt_calls(e, calls)))
        wrong[e.data["category"]].append(bad.checks["bfcl_valid"])
        assert not bad.checks["bfcl_valid"] and "bfcl" in bad.reasons
        assert e.data == before  # the checker worked on copies
    assert set(results) == set(bfcl.CATEGORIES)
    assert {c: sum(v) / len(v) for c, v in results.items()} == dict.fromkeys(bfcl.CATEGORIES, 1.0)
    assert {c: sum(v) for c, v in wrong.items()} == dict.fromkeys(bfcl.CATEGORIES, 0)


def test_decode_follows_toolrl() -> None:
    text = (
        "<think> I might write <tool_call> here </think>\n<tool_call>\n"
        '{"name": "f", "parameters": {"a": 1}}\n'
        "not json\n"
        '{"name": "None", "parameters": {}}\n'
        '{"name": "g", "parameters": {}}\n</tool_call>'
    )
    assert bfcl.decode_calls(text) == [{"f": {"a": 1}}, {"g": {}}]
    assert bfcl.decode_calls("<think> x </think>\n<response> no call </response>") == []


def test_garbage_never_raises_and_is_invalid() -> None:
    task = ToolCallTask()
    e = next(x for x in bfcl.load_cases(["simple_java"]) if x.id == "simple_java_0")
    for text in [
        "",
        "<tool_call>",
        '<tool_call>\n{"name": "GeometryPresentation.createPresentation", '
        '"parameters": {"controller": [1], "parent": {"a": 2}}}\n</tool_call>',
    ]:
        s = task.score(e, text)
        assert s.checks["bfcl_valid"] is False and s.reasons["bfcl"]
        assert s.rewards["correctness"] is None


def test_prompt_layout() -> None:
    cases = {e.id: e for e in bfcl.load_cases(["simple_java", "live_simple"])}
    java = cases["simple_java_0"]
    system, user = java.messages[0]["content"], java.messages[1]["content"]
    tools = parse_tools(system)
    assert [t["name"] for t in tools] == ["GeometryPresentation.createPresentation"]
    params = tools[0]["parameters"]
    assert {p["type"] for p in params.values()} == {"string"}  # as BFCL shows Java docs
    assert "Java 8 SDK" in tools[0]["description"]
    assert user.startswith("**Dialogue Records History**\n<user> Help me initialize")
    assert user.endswith(f"{bfcl.USER_SUFFIX} </user>")
    # the raw docs (for the checker) keep their Java types
    assert java.data["functions"][0]["parameters"]["properties"]["controller"]["type"] == "any"
    # a case-level system message is kept after the tool prompt
    dated = cases["live_simple_183-108-0"]
    assert dated.messages[0]["content"].endswith("Please act like the current date is 2024/02/21")


def test_eval_examples_select_categories() -> None:
    task = ToolCallTask()
    ex = task.eval_examples("bfcl", {"categories": ["simple_javascript", "live_parallel"]})
    assert len(ex) == 50 + 16
    assert ex[0].id == "simple_javascript_0"
    assert len(task.examples("live_parallel_multiple")) == 24
    with pytest.raises(ValueError, match=r"eval\.categories"):
        task.eval_examples("bfcl", {"categories": ["simple"]})


def test_summary_averages_match_bfcl_code() -> None:
    """Our aggregates equal those of BFCL's own leaderboard helpers on the same numbers."""
    acc = {c: (i + 1) / 20 for i, c in enumerate(bfcl.CATEGORIES)}
    n = {c: 10 + 7 * i for i, c in enumerate(bfcl.CATEGORIES)}
    verdicts = {
        c: [True] * round(acc[c] * n[c] * 2) + [False] * (2 * n[c] - round(acc[c] * n[c] * 2))
        for c in bfcl.CATEGORIES
    }
    ours = bfcl.summarize(verdicts)
    per_cat = {c: sum(v) / len(v) for c, v in verdicts.items()}
    assert all(ours[f"bfcl/{c}/accuracy"] == per_cat[c] for c in bfcl.CATEGORIES)
    script = f"""
import json, sys, types
m = types.ModuleType("bfcl_eval.constants.model_config"); m.MODEL_CONFIG_MAPPING = {{}}
sys.modules["bfcl_eval.constants.model_config"] = m
from bfcl_eval.eval_checker.eval_runner_helper import (
    calculate_unweighted_accuracy as unw, calculate_weighted_accuracy as w)
acc = json.loads({json.dumps(json.dumps(per_cat))}); cnt = json.loads({json.dumps(json.dumps({c: 2 * n[c] for c in n}))})
d = {{c: {{"accuracy": acc[c], "total_count": cnt[c], "display_accuracy": acc[c]}} for c in acc}}
simple = unw([d["simple_python"], d["simple_java"], d["simple_javascript"]])
non_live = unw([simple, d["multiple"], d["parallel"], d["parallel_multiple"]])
live = w([d["live_simple"], d["live_multiple"], d["live_parallel"], d["live_parallel_multiple"]])
print(json.dumps([simple["accuracy"], non_live["accuracy"], live["accuracy"]]))
"""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # BFCL creates result folders on import
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "BFCL_PROJECT_ROOT": tmp},
        )
    simple, non_live, live = json.loads(out.stdout.strip().splitlines()[-1])
    assert ours["bfcl/non_live/simple_ast"] == pytest.approx(simple)
    assert ours["bfcl/non_live/summary_ast"] == pytest.approx(non_live)
    assert ours["bfcl/live/summary_ast"] == pytest.approx(live)
    # partial selections report no summary (BFCL shows N/A)
    partial = bfcl.summarize({"simple_python": [True], "live_simple": [False]})
    assert not any("summary" in k or "simple_ast" in k for k in partial)


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        bfcl.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bfcl_eval" else real(name, *a),
    )
    with pytest.raises(bfcl.BFCLMissingError, match="pip install --no-deps bfcl-eval"):
        bfcl.load_cases(["simple_python"])


def test_checker_import_leaves_no_stand_in_behind() -> None:
    bfcl.load_ast_checker()
    mod = sys.modules.get("bfcl_eval.constants.model_config")
    assert mod is None or "Stand-in" not in (mod.__doc__ or "")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def typed_cases() -> list:
    """One case per category with varied parameter types (Java/JS converters included)."""
    return [bfcl.load_cases([c])[1] for c in bfcl.CATEGORIES]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_arguments_never_raise(typed_cases: list, data) -> None:
    task = ToolCallTask()
    e = data.draw(st.sampled_from(typed_cases))
    fn = data.draw(st.sampled_from(e.data["functions"]))
    keys = [*fn["parameters"].get("properties", {}), "extra"]
    args = data.draw(st.dictionaries(st.sampled_from(keys), _JSON, max_size=4))
    call = {"name": fn["name"], "parameters": args}
    score = task.score(e, f"<think> x </think>\n<tool_call>\n{json.dumps(call)}\n</tool_call>")
    assert score.checks["bfcl_valid"] in (True, False)
    assert score.rewards["format"] == 1.0
