"""Scoring of model responses for evaluation: the one scorer that eval and validation share.

``score_responses`` reads ``{"id", "response"}`` lines, scores each with the task's own
``score`` (the same function that computes training rewards) and writes ``metrics.json``
and ``results.jsonl``. ``evaluate_examples`` is the common core used by generation-mode
evaluation and by training-time validation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mrtpo.tasks.base import Example, Score, Task


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL file; a malformed line raises with the file and line number."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: malformed JSON line ({exc.msg})") from exc
    return rows


def result_row(example: Example, response: str, score: Score, sample: int = 0) -> dict[str, Any]:
    row: dict[str, Any] = {"id": example.id, "sample": sample}
    row.update({f"reward/{k}": v for k, v in score.rewards.items()})
    row.update({f"check/{k}": v for k, v in score.checks.items()})
    if score.reasons:
        row["reasons"] = score.reasons
    if score.error:
        row["error"] = score.error
    row["response"] = response
    return row


def evaluate_examples(
    task: Task, examples: Sequence[Example], responses: Sequence[str]
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Score ``responses[i]`` against ``examples[i]``; return (metrics, per-response rows)."""
    scores = task.score_many(examples, responses)
    metrics = task.summarize(examples, scores)
    metrics["n_responses"] = float(len(scores))
    metrics["n_scoring_errors"] = float(sum(s.error is not None for s in scores))
    rows = [result_row(e, r, s) for e, r, s in zip(examples, responses, scores, strict=True)]
    return metrics, rows


def write_results(output: str | Path, metrics: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
    (out / "metrics.json").write_text(json.dumps(clean, indent=2, sort_keys=True) + "\n")
    with open(out / "results.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return out


def score_responses(
    task: Task, examples: Sequence[Example], responses_file: str | Path, output: str | Path
) -> dict[str, float]:
    """Score a JSONL of ``{"id", "response"}`` lines against ``examples`` (matched by id).

    Several lines may share an id (several samples per prompt); metrics are then averaged
    over all lines, as the benchmarks do for n samples per prompt.
    """
    by_id = {str(e.id): e for e in examples}
    lines = read_jsonl(responses_file)
    matched: list[Example] = []
    texts: list[str] = []
    for i, line in enumerate(lines, 1):
        for key in ("id", "response"):
            if key not in line:
                raise ValueError(f"{responses_file}:{i}: missing field '{key}'")
        ex = by_id.get(str(line["id"]))
        if ex is None:
            raise ValueError(
                f"{responses_file}:{i}: id {line['id']!r} is not an example of this split "
                f"({len(by_id)} ids, e.g. {next(iter(by_id), None)!r}); check eval.split"
            )
        matched.append(ex)
        resp = line["response"]
        texts.append(resp if isinstance(resp, str) else json.dumps(resp))
    metrics, rows = evaluate_examples(task, matched, texts)
    write_results(output, metrics, rows)
    return metrics
