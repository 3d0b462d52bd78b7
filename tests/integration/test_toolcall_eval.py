"""Tool calling end to end: scoring response files through the shared scorer and the CLI,
all of BFCL's single-turn AST categories through the official checker, and a train smoke."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from tests.bfcl_oracle import calls_to_response, corrupt_calls, oracle_calls
from tests.conftest import ROOT

from mrtpo.core.evaluation import read_jsonl, score_responses
from mrtpo.tasks.toolcall import ToolCallTask, bfcl

needs_bfcl = pytest.mark.skipif(
    importlib.util.find_spec("bfcl_eval") is None,
    reason=f"bfcl-eval not installed ({bfcl.INSTALL_HINT})",
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@needs_bfcl
def test_eval_cli_scores_bfcl_responses(tmp_path: Path) -> None:
    """``src/eval.py task=toolcall eval.split=bfcl eval.categories=[...] eval.responses=...``."""
    cases = bfcl.load_cases(["simple_python"])[:6]
    rows = []
    for i, e in enumerate(cases):
        calls = oracle_calls(e)
        text = calls_to_response(calls if i < 4 else corrupt_calls(e, calls))
        rows.append({"id": e.id, "response": text})
    # a second sample of every example (evaluation refuses uneven numbers per example)
    rows += [{"id": e.id, "response": "no tags, no calls"} for e in cases]
    responses = write_jsonl(tmp_path / "preds.jsonl", rows)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "src/eval.py",
            "task=toolcall",
            "eval.split=bfcl",
            "eval.categories=[simple_python]",
            f"eval.responses={responses}",
            f"eval.output={out}",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["bfcl/simple_python/accuracy"] == pytest.approx(4 / 12)
    assert metrics["bfcl/simple_python/n"] == 12
    assert metrics["n_responses"] == 12 and metrics["n_scoring_errors"] == 0
    assert metrics["reward/format"] == pytest.approx(6 / 12)
    results = read_jsonl(out / "results.jsonl")
    assert [r["check/bfcl_valid"] for r in results] == [True] * 4 + [False] * 8
    assert all(r["check/category"] == "simple_python" for r in results)
    assert "bfcl" in results[4]["reasons"] and "format" in results[6]["reasons"]


def test_score_rlla_responses(tmp_path: Path, shared_data: Path) -> None:
    task = ToolCallTask(data_files={"val": str(shared_data / "toolrl_rlla" / "rlla_4k_test.jsonl")})
    examples = task.examples("val")
    rows = [{"id": e.id, "response": e.reference} for e in examples]
    rows[0] = {"id": examples[0].id, "response": "<think> hmm </think>\n<response> no </response>"}
    metrics = score_responses(task, examples, write_jsonl(tmp_path / "r.jsonl", rows), tmp_path)
    calls = [e for e in examples if e.data["reference_calls"]]
    assert examples[0].data["reference_calls"]  # row 0 expects a call
    assert metrics["exact_match"] == pytest.approx((len(calls) - 1) / len(calls))
    assert metrics["reward/format"] == pytest.approx(79 / 80)
    results = read_jsonl(tmp_path / "results.jsonl")
    assert results[0]["reward/correctness"] == -3.0 and "correctness" in results[0]["reasons"]


@needs_bfcl
@pytest.mark.slow
def test_every_bfcl_case_through_the_official_checker(tmp_path: Path) -> None:
    """Acceptance, all 2,501 cases: each possible answer written in our format passes (except
    the documented unmeetable cases); one wrong argument value per case fails."""
    task = ToolCallTask()
    examples = task.eval_examples("bfcl", {"categories": None})
    good, bad, unmeetable = [], [], []
    for e in examples:
        calls = oracle_calls(e)
        if calls is None:
            unmeetable.append(e.id)
            continue
        good.append({"id": e.id, "response": calls_to_response(calls)})
        bad.append({"id": e.id, "response": calls_to_response(corrupt_calls(e, calls))})
    assert sorted(unmeetable) == sorted(bfcl.UNMEETABLE_CASES)
    m_good = score_responses(
        task, examples, write_jsonl(tmp_path / "g.jsonl", good), tmp_path / "g"
    )
    m_bad = score_responses(task, examples, write_jsonl(tmp_path / "b.jsonl", bad), tmp_path / "b")
    per_cat = defaultdict(int)
    for e in examples:
        per_cat[e.data["category"]] += e.id not in bfcl.UNMEETABLE_CASES
    for cat in bfcl.CATEGORIES:
        assert m_good[f"bfcl/{cat}/accuracy"] == 1.0, cat
        assert m_good[f"bfcl/{cat}/n"] == per_cat[cat]
        assert m_bad[f"bfcl/{cat}/accuracy"] == 0.0, cat
    for key in ("bfcl/non_live/summary_ast", "bfcl/live/summary_ast", "bfcl/non_live/simple_ast"):
        assert m_good[key] == 1.0 and m_bad[key] == 0.0
    assert sum(per_cat.values()) == 2501 - len(bfcl.UNMEETABLE_CASES)


@pytest.mark.slow
def test_train_smoke_on_rlla(train_cfg, shared_data: Path) -> None:
    """``python src/train.py task=toolcall method=mrtpo model=tiny trainer.max_steps=2``."""
    from mrtpo.lightning.pipeline import build, metrics_csv

    cfg = train_cfg("task=toolcall", "method=mrtpo", "task.limits.train=32")
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2
    with open(metrics_csv(trainer)) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for r in rows:
        assert -3.0 <= float(r["train/reward/correctness/mean"]) <= 3.0
        assert float(r["train/reward/format/mean"]) in (0.0, 0.25, 0.5, 0.75, 1.0)
