"""The one scorer evaluation and validation share: each response scored by the task's own
``score`` (as training rewards are); ``evaluate_examples`` is the common core."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mrtpo.tasks.base import Example, Score, Task
from mrtpo.tasks.custom.data import decode_utf8

log = logging.getLogger(__name__)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), "an array" if isinstance(value, list) else type(value).__name__
    )


def _lone_surrogate(value: Any, where: str = "") -> str | None:
    """Where ``value`` holds a string that is not valid Unicode text (JSON lets a line escape
    half of a surrogate pair, ``"\\ud800"``; such a string cannot be written as UTF-8)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{where or 'the value'} holds U+{ord(value[exc.start]):04X}"
        return None
    is_list = isinstance(value, list)
    items = enumerate(value) if is_list else value.items() if isinstance(value, dict) else ()
    for key, child in items:
        if isinstance(key, str) and _lone_surrogate(key):
            return f"a key of {where or 'the object'} holds a lone surrogate"
        name = f"{where}[{key}]" if is_list else f"{where}.{key}" if where else str(key)
        bad = _lone_surrogate(child, name)
        if bad:
            return bad if where else f"field {bad}"
    return None


def read_jsonl(path: str | Path, objects: bool = True) -> list[Any]:
    """Read a JSONL file; a bad line (not UTF-8, not JSON, not an object with ``objects``, a lone
    escaped surrogate) raises ``ValueError`` naming file and line. Blank lines and a BOM pass."""
    rows = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            line = decode_utf8(raw, str(path), i)
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: malformed JSON line ({exc.msg})") from exc
            if objects and not isinstance(value, dict):
                raise ValueError(
                    f"{path}:{i}: expected a JSON object, got {_kind(value)} ({line.strip()[:40]})"
                )
            bad = _lone_surrogate(value)
            if bad:
                raise ValueError(
                    f"{path}:{i}: {bad}, an escaped lone surrogate: not valid Unicode text"
                )
            rows.append(value)
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


def _json_line(row: dict[str, Any]) -> bytes:
    try:
        return (json.dumps(row, ensure_ascii=False, default=str) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # text that is not valid Unicode: keep it, escaped
        return (json.dumps(row, ensure_ascii=True, default=str) + "\n").encode("ascii")


def _write_atomic(path: Path, data: bytes) -> Path:
    """``data`` into a fsynced temporary file beside ``path``; the caller renames it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


#: The files ``write_results`` writes into its output folder.
OUTPUT_FILES = ("results.jsonl", "metrics.json")


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_outputs(output: str | Path, inputs: dict[str, Any]) -> None:
    """Refuse an output folder where writing would replace one of ``inputs`` (config key ->
    path, e.g. ``{"eval.responses": preds}``): nothing the user points at is written to."""
    out = Path(output)
    for key, given in inputs.items():
        if not given:
            continue
        for name in OUTPUT_FILES:
            if _same_file(out / name, Path(str(given))):
                raise ValueError(
                    f"{key}={given} would be overwritten: eval.output={out} writes its {name} "
                    "there. Choose another eval.output folder (nothing was written)"
                )


def write_results(
    output: str | Path,
    metrics: dict[str, Any],
    rows: list[dict[str, Any]],
    scored: dict[str, Any] | None = None,
    inputs: dict[str, Any] | None = None,
) -> Path:
    """Write ``results.jsonl`` and ``metrics.json`` into ``output``: both or neither (temporary
    files renamed, ``metrics.json`` last, holding the results' SHA-256 and ``scored``)."""
    out = Path(output)
    check_outputs(out, inputs or {})
    out.mkdir(parents=True, exist_ok=True)
    results = b"".join(_json_line(row) for row in rows)
    clean: dict[str, Any] = {
        k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()
    }
    clean["scored"] = {**(scored or {}), "results_sha256": hashlib.sha256(results).hexdigest()}
    meta = (json.dumps(clean, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8")
    tmps: list[Path] = []
    try:
        tmps.append(_write_atomic(out / "results.jsonl", results))
        tmps.append(_write_atomic(out / "metrics.json", meta))
        os.replace(tmps[0], out / "results.jsonl")
        os.replace(tmps[1], out / "metrics.json")
        tmps = []
    finally:
        for t in tmps:
            t.unlink(missing_ok=True)
    return out


def _match_lines(
    lines: list[dict[str, Any]],
    by_id: dict[str, Example],
    path: str | Path,
    beyond_limit: set[str],
) -> tuple[list[tuple[int, Example, str]], int]:
    """(line number, example, response text) per line of an example kept; and the count of
    lines skipped because their example is beyond ``eval.limit``."""
    matched, skipped = [], 0
    for i, line in enumerate(lines, 1):
        for key in ("id", "response"):
            if key not in line:
                raise ValueError(f"{path}:{i}: missing field '{key}'")
        key = str(line["id"])
        if key in beyond_limit:
            skipped += 1
            continue
        ex = by_id.get(key)
        if ex is None:
            raise ValueError(
                f"{path}:{i}: id {line['id']!r} is not an example of this split "
                f"({len(by_id) + len(beyond_limit)} ids, e.g. {next(iter(by_id), None)!r}); "
                "check eval.split"
            )
        resp = line["response"]
        matched.append((i, ex, resp if isinstance(resp, str) else json.dumps(resp)))
    return matched, skipped


def _samples_per_example(
    lines: list[dict[str, Any]], matched: list[tuple[int, Example, str]], path: str | Path
) -> int:
    """The number of lines each covered example has; refuse uneven numbers and repeated
    ``(id, sample)`` pairs. Metrics average over lines, so an example with more lines than
    the others would weigh more."""
    where: dict[str, list[int]] = {}
    seen: dict[tuple[str, Any], int] = {}
    for i, ex, _ in matched:
        where.setdefault(str(ex.id), []).append(i)
        sample = lines[i - 1].get("sample")
        if sample is not None:
            first = seen.setdefault((str(ex.id), sample), i)
            if first != i:
                raise ValueError(
                    f"{path}:{i}: id {ex.id!r} sample {sample!r} repeats line {first}; "
                    "remove the duplicate line"
                )
    counts = {k: len(v) for k, v in where.items()}
    if len(set(counts.values())) > 1:
        most = max(counts, key=counts.get)
        least = min(counts, key=counts.get)
        raise ValueError(
            f"{path}: uneven numbers of responses per example: id {most!r} has "
            f"{counts[most]} lines (repeated at {path}:{where[most][1]}), id {least!r} has "
            f"{counts[least]}. Metrics average over lines, so the repeated example would "
            "weigh more: remove repeated lines, or give every example the same number of "
            "samples"
        )
    return next(iter(counts.values()), 0)


def score_responses(
    task: Task,
    examples: Sequence[Example],
    responses_file: str | Path,
    output: str | Path,
    require_complete: bool = False,
    scored: dict[str, Any] | None = None,
    beyond_limit: Sequence[str] = (),
    limit: int | None = None,
) -> dict[str, float]:
    """Score a JSONL of ``{"id", "response"}`` lines against ``examples`` (matched by id).

    An id may repeat (n samples per prompt) if every covered example has as many; metrics average
    all lines. ``beyond_limit`` lines (left out by ``eval.limit``) are skipped with a warning. An
    empty file is an error; partial coverage warns and records ``coverage`` (an error with
    ``require_complete``). ``responses_file`` is never written to.
    """
    check_outputs(output, {"eval.responses": responses_file})
    by_id = {str(e.id): e for e in examples}
    lines = read_jsonl(responses_file)
    if not lines:
        raise ValueError(
            f"{responses_file}: no responses (the file is empty); expected one "
            f'{{"id": ..., "response": ...}} line per example ({len(by_id)} examples)'
        )
    matched, skipped = _match_lines(lines, by_id, responses_file, set(map(str, beyond_limit)))
    if skipped:
        log.warning(
            f"{responses_file}: {skipped} line(s) answer examples beyond the first {limit} kept "
            f"by eval.limit={limit}; they are not scored"
        )
    per_example = _samples_per_example(lines, matched, responses_file)
    covered = {str(ex.id) for _, ex, _ in matched}
    coverage = _coverage(covered, by_id, responses_file, require_complete)
    exs = [ex for _, ex, _ in matched]
    task.check_scorable(exs)  # only the examples this file answers must be scorable here
    metrics, rows = evaluate_examples(task, exs, [t for _, _, t in matched])
    metrics["coverage"] = coverage
    info = {
        **(scored or {}),
        "responses": str(responses_file),
        "examples": len(by_id),
        "examples_covered": len(covered),
        "responses_scored": len(matched),
        "responses_skipped_by_limit": skipped,
        "samples_per_example": per_example,
        "coverage": coverage,
    }
    write_results(output, metrics, rows, info, inputs={"eval.responses": responses_file})
    return metrics


def _coverage(
    covered: set[str], by_id: dict[str, Example], path: str | Path, require_complete: bool
) -> float:
    """Covered examples / examples; warns (or, with ``require_complete``, fails) below 1."""
    coverage = len(covered) / max(1, len(by_id))
    if len(covered) < len(by_id):
        missing = [k for k in by_id if k not in covered]
        msg = (
            f"{path} covers {len(covered)} of {len(by_id)} examples "
            f"({100 * coverage:.1f}%; missing e.g. {missing[:3]})"
        )
        if require_complete:
            raise ValueError(
                f"{msg}; eval.require_complete=true needs a response for every example"
            )
        log.warning(
            f"{msg}: the metrics are over the covered examples only (coverage={coverage:.4f} in "
            "metrics.json; eval.require_complete=true makes this an error)"
        )
    return coverage
