"""MulDimIF: eval.split=muldimif against the authors' own ``check`` (called here as the oracle).

Needs the public test split (../shared/data/muldimif/test.json) and an unchanged copy of the
authors' checkers (../shared/vendor/muldimif); each test skips when they are absent.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mrtpo.core.evaluation import read_jsonl, score_responses
from mrtpo.tasks.instructions import InstructionTask
from mrtpo.tasks.instructions.muldimif import load_harness, strip_think

pytest.importorskip("zhconv", reason="the MulDimIF checkers need zhconv (mrtpo[muldimif])")
ROOT = Path(__file__).resolve().parents[2]

# Texts that satisfy some constraint families and break others, so verdicts are mixed.
RESPONSES = [
    "# Overview\n\n## Details\n\n| Name | Value |\n|---|---|\n| a | 1 |\n| b | 2 |\n\n"
    "> A quote.\n\nThe Answer Is Short. It Ends Here.",
    '{"report": {"element": {"id": 1, "name": "x"}}}',
    "THE RESPONSE IS WRITTEN IN CAPITAL LETTERS ONLY. IT HAS TWO SENTENCES!",
    "今天天气很好。我们去公园散步吧！",
    "- first point, with some words\n- second point; more words\n\nA closing line without "
    "capitals and a final question?",
    "<think>I should plan.</think>\n\nA plain answer of several words that ends with a period.",
    "",
]


def _paths(shared_data: Path) -> tuple[Path, Path]:
    checker_dir = shared_data.parent / "vendor" / "muldimif"
    if not (checker_dir / "evaluation.py").is_file():
        pytest.skip(f"MulDimIF checkers not found at {checker_dir}")
    return shared_data / "muldimif" / "test.json", checker_dir


def _pick(items: list[dict], budget: int = 300) -> list[dict]:
    """Items covering every constraint key at least once, topped up to ~budget constraints."""
    chosen, seen = [], set()
    for it in items:
        keys = {f"{c[0]}_{c[1]}" for c in it["constraints"]}
        if keys - seen:
            chosen.append(it)
            seen |= keys
    for it in items:
        if sum(len(c["constraints"]) for c in chosen) >= budget:
            break
        if it not in chosen:
            chosen.append(it)
    return chosen


@pytest.fixture(scope="module")
def setup(shared_data: Path, tmp_path_factory: pytest.TempPathFactory):
    test_json, checker_dir = _paths(shared_data)
    nltk_dir = str(tmp_path_factory.mktemp("nltk_data"))
    task = InstructionTask(
        nltk_data_dir=nltk_dir,
        eval_files={"muldimif": str(test_json)},
        muldimif={"checker_dir": str(checker_dir)},
    )
    items = json.loads(test_json.read_text(encoding="utf-8"))
    return task, items, checker_dir, nltk_dir


def test_split_is_the_1200_prompts_with_4180_constraints(setup):
    task, items, _, _ = setup
    examples = task.examples("muldimif")
    assert len(examples) == 1200 and [e.id for e in examples] == [str(i["id"]) for i in items]
    assert sum(len(e.data["constraints"]) for e in examples) == 4180
    assert len({c["id"] for e in examples for c in e.data["constraints"]}) == 36
    assert examples[0].messages == items[0]["conversations"]


def test_verdicts_equal_the_official_check(setup, tmp_path: Path):
    task, items, checker_dir, nltk_dir = setup
    picked = _pick(items)
    n_constraints = sum(len(it["constraints"]) for it in picked)
    keys = {f"{c[0]}_{c[1]}" for it in picked for c in it["constraints"]}
    assert n_constraints >= 300 and len(keys) == 36
    responses = {str(it["id"]): RESPONSES[i % len(RESPONSES)] for i, it in enumerate(picked)}
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        "".join(
            json.dumps({"id": k, "response": v}, ensure_ascii=False) + "\n"
            for k, v in responses.items()
        ),
        encoding="utf-8",
    )
    metrics = score_responses(task, task.examples("muldimif"), preds, tmp_path / "out")
    rows = {r["id"]: r for r in read_jsonl(tmp_path / "out" / "results.jsonl")}

    # The oracle: the authors' own check() on their own data structure, the response set as
    # the last turn after their pre-processing of reasoning text.
    harness = load_harness(str(checker_dir), nltk_dir)
    data = []
    for it in picked:
        d = copy.deepcopy(it)
        d["conversations"].append(
            {"role": "assistant", "content": strip_think(responses[str(it["id"])])}
        )
        data.append(d)
    judged = harness.check(data)
    flat_ours, flat_official = [], []
    for d in judged:
        ours = [int(v) for v in rows[str(d["id"])]["check/strict"]]
        assert ours == d["judges"], d["id"]
        assert rows[str(d["id"])]["check/prompt_strict"] == all(d["judges"])
        flat_ours += ours
        flat_official += d["judges"]
    assert 0 < sum(flat_official) < len(flat_official)  # the cases are not all-pass / all-fail
    n = len(judged)
    assert metrics["accuracy"] == pytest.approx(sum(all(d["judges"]) for d in judged) / n)
    assert metrics["constraint_accuracy"] == pytest.approx(sum(flat_official) / len(flat_official))
    assert metrics["muldimif_overall"] == pytest.approx(metrics["accuracy"])
    assert {"pattern/Listing", "pattern/Incorporation", "pattern/Example"} <= set(metrics)
    official = harness.get_score(copy.deepcopy(judged))
    for name, text in official["constraint_category_second_list"].items():
        assert metrics[f"category_second/{name}"] == pytest.approx(float(text.rsplit("=", 1)[1]))


def test_a_checker_crash_is_a_failed_constraint_not_a_dropped_response(setup):
    """Issue 25 item 11: a RecursionError in Format_Json dropped the response from the
    denominator (2/19 instead of 2/20)."""
    task, _, checker_dir, nltk_dir = setup
    examples = task.examples("muldimif")
    json_ex = next(
        e for e in examples if any(c["id"] == "Format_Json" for c in e.data["constraints"])
    )
    others = [e for e in examples if e is not json_ex][:19]
    deep = "[" * 3_000 + "]" * 3_000  # under task.max_response_chars
    harness = load_harness(str(checker_dir), nltk_dir)
    k = next(i for i, c in enumerate(json_ex.data["constraints"]) if c["id"] == "Format_Json")
    with pytest.raises(RecursionError):  # the authors' checker, unchanged, crashes on it
        harness.class_mapping["Format_Json"].check(json_ex.data["constraints"][k]["text"], deep)

    crashed = task.score(json_ex, deep)
    assert crashed.error is None and crashed.rewards[f"c{k}"] == 0.0
    assert crashed.checks["strict"][k] is False and crashed.checks["prompt_strict"] is False
    assert "Format_Json: checker raised RecursionError" in crashed.reasons[f"c{k}"]
    scores = [task.score(e, "Short answer.") for e in others] + [crashed]
    metrics = task.summarize([*others, json_ex], scores)
    assert metrics["n_scored"] == 20.0  # the crashed response stays in the denominator
    met = sum(s.checks["prompt_strict"] for s in scores)
    assert metrics["accuracy"] == pytest.approx(met / 20)


def test_think_is_stripped_as_the_harness_does():
    assert strip_think("<think>x</think>\n\nAnswer") == "Answer"
    assert strip_think("a</think>b</think>\nc") == "c"
    assert strip_think("no reasoning") == "no reasoning"


def test_missing_checker_folder_names_the_key(tmp_path: Path):
    task = InstructionTask(muldimif={"checker_dir": str(tmp_path / "absent")})
    with pytest.raises(RuntimeError, match=r"task\.muldimif\.checker_dir"):
        task.examples("muldimif")


def test_cli_writes_accuracy_to_metrics_json(shared_data: Path, tmp_path: Path):
    _paths(shared_data)
    items = json.loads((shared_data / "muldimif" / "test.json").read_text(encoding="utf-8"))
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        "".join(
            json.dumps({"id": it["id"], "response": "Short answer."}) + "\n" for it in items[:20]
        )
    )
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "src" / "eval.py"),
        "task=ifeval",
        "eval.split=muldimif",
        f"eval.responses={preds}",
        f"eval.output={out}",
        f"paths.data_dir={shared_data}",
        f"paths.cache_dir={tmp_path / 'cache'}",
        f"paths.output_dir={tmp_path}",
        f"paths.log_dir={tmp_path / 'logs'}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["n_prompts"] == 20.0
    assert "accuracy" in proc.stdout
