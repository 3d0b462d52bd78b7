"""Instruction-following records, the prompt template and the file loaders.

A training record is a base request plus constraints, each an (instruction id, checker
arguments, sentence stating it) triple. Its prompt is built by ``render_prompt``, and
``P_\\k`` for replay is the same template with constraint k's sentence left out. Generated
prompts use one template (the request, a blank line, one sentence per line), so ``P_\\k``
differs from the prompt by that sentence alone. HIR-16K rows name their own template
(``extra_info.q_type``, one of HiR's six); we rebuild both contexts with it, as the paper
does (with the numbered-list template, later items are renumbered).

Benchmark records (IFEval, IFBench) keep their prompts verbatim: their constraints are
woven into the prose, so they have no sentences to remove (they are never trained on).

HIR-16K is read in the format its authors train from (verl rows): ``data_source`` names
the subset (``type1``/``ifeval``: IFEval-style constraints, ``type2``/``ifbench``:
IFBench-style, ``type3``/``muldimif``); ``reward_model.ground_truth`` holds
``instruction_id_list`` and ``kwargs`` (a dict or its JSON text); ``extra_info`` holds the
base request (``question``) and one sentence per constraint (``criteria``).
"""

from __future__ import annotations

import csv
import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HIR_SUBSETS = {
    "type1": "ifeval",
    "ifeval": "ifeval",
    "type2": "ifbench",
    "ifbench": "ifbench",
    "type3": "muldimif",
    "muldimif": "muldimif",
}


@dataclass(frozen=True)
class Constraint:
    id: str  # instruction id in its registry, e.g. "punctuation:no_comma"
    kwargs: Mapping[str, Any]  # checker arguments
    text: str | None = None  # the sentence that states it (None: woven into benchmark prose)


@dataclass
class Record:
    uid: str
    prompt: str  # the full user message (P0)
    constraints: list[Constraint]
    registry: str  # "ifeval" or "ifbench": whose checkers score it
    base: str | None = None  # the request without constraints (None for benchmark prompts)
    source: str = ""  # generated | hir | ifeval | ifbench | advancedif
    template: str = "type6"  # how base and sentences are joined (see render_prompt)
    meta: dict[str, Any] = field(default_factory=dict)


def _with_stop(sentence: str) -> str:
    return sentence + (" " if sentence[-1:] in ",.?!" else ". ")


def render_prompt(base: str, sentences: Sequence[str], template: str = "type6") -> str:
    """Base request + constraint sentences, by one of HiR's six concatenation templates.

    ``type6`` (the default, used for generated prompts): a blank line, then one sentence
    per line. ``type1``/``type2``: sentences run on as prose after a space / a newline;
    ``type3``: a numbered rule list; ``type4``: a dashed list; ``type5``: sentences first,
    then the request. With no sentences the prompt is the base request alone.
    """
    if not sentences:
        return base
    if template in ("type1", "type2", "type5"):
        prose = "".join(_with_stop(s) for s in sentences).strip()
        if template == "type5":
            return f"{prose}\n\n{base}"
        sep = " " if template == "type1" else "\n"
        return f"{base}{sep}{prose}"
    if template == "type3":
        rules = "".join(f"{i + 1}. {s}\n" for i, s in enumerate(sentences))
        return f"{base}\n\n" + f"The output must follow the following rules:\n{rules}".strip()
    if template == "type4":
        return f"{base}\n\n" + "".join(f"- {s}\n" for s in sentences).strip()
    if template == "type6":
        return f"{base}\n\n" + "".join(f"{s}\n" for s in sentences).strip()
    raise ValueError(f"unknown prompt template {template!r}: expected {TEMPLATES}")


TEMPLATES = ("type1", "type2", "type3", "type4", "type5", "type6")


def constraint_record(
    uid: str,
    base: str,
    constraints: Sequence[Constraint],
    registry: str,
    source: str,
    template: str = "type6",
) -> Record:
    cons = [Constraint(c.id, dict(c.kwargs), c.text) for c in constraints]
    if any(not (c.text or "").strip() for c in cons):
        raise ValueError(f"record {uid}: every constraint needs a sentence")
    prompt = render_prompt(base, [c.text or "" for c in cons], template)
    return Record(uid, prompt, cons, registry, base=base, source=source, template=template)


# ---- files --------------------------------------------------------------------------------
def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .parquet, .jsonl, .json (list, or a dict holding one) or .csv file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if suffix == ".jsonl":
        rows = []
        with open(p, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{p}:{i}: malformed JSON line ({exc.msg})") from exc
        return rows
    if suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise ValueError(f"{p}: expected a list of records (or a dict holding one)")
            data = lists[0]
        return list(data)
    if suffix == ".csv":
        csv.field_size_limit(1 << 30)
        with open(p, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    raise ValueError(f"{p}: unsupported file type {suffix!r} (parquet, jsonl, json or csv)")


def _as_obj(value: Any) -> Any:
    """JSON text -> object; anything else unchanged (parquet keeps some columns as text)."""
    if isinstance(value, str) and value[:1] in "[{":
        return json.loads(value)
    return value


def load_benchmark(path: str | Path, registry: str) -> list[Record]:
    """IFEval / IFBench rows: ``key``, ``prompt``, ``instruction_id_list``, ``kwargs``."""
    out = []
    for i, row in enumerate(read_rows(path)):
        missing = {"key", "prompt", "instruction_id_list", "kwargs"} - set(row)
        if missing:
            raise ValueError(f"{path}: row {i} lacks {sorted(missing)}")
        ids, kwargs = row["instruction_id_list"], row["kwargs"]
        if len(ids) != len(kwargs):
            raise ValueError(f"{path}: row {i} has {len(ids)} ids but {len(kwargs)} kwargs")
        cons = [Constraint(iid, dict(kw or {})) for iid, kw in zip(ids, kwargs)]
        out.append(Record(str(row["key"]), row["prompt"], cons, registry, source=registry, meta={}))
    return out


def hir_record(row: Mapping[str, Any], index: int) -> tuple[str, Record | str]:
    """One HIR-16K row -> (subset, record) or (subset, reason it was skipped)."""
    source = str(row.get("data_source", ""))
    subset = HIR_SUBSETS.get(source, source or "unknown")
    gt = _as_obj((_as_obj(row.get("reward_model")) or {}).get("ground_truth"))
    extra = _as_obj(row.get("extra_info")) or {}
    if not isinstance(gt, Mapping) or "instruction_id_list" not in gt:
        return subset, "no reward_model.ground_truth.instruction_id_list"
    question, criteria = extra.get("question"), extra.get("criteria")
    if not isinstance(question, str) or criteria is None:
        return subset, "no extra_info.question / extra_info.criteria"
    ids = list(gt["instruction_id_list"])
    kwargs = [(_as_obj(k) or {}) for k in (_as_obj(gt.get("kwargs")) or [{}] * len(ids))]
    criteria = list(_as_obj(criteria))
    if not (len(ids) == len(kwargs) == len(criteria)) or not ids:
        return subset, "instruction ids, kwargs and criteria differ in length"
    if any(not isinstance(c, str) or not c.strip() for c in criteria):
        return subset, "empty constraint sentence"
    cons = [Constraint(str(i), dict(k), c) for i, k, c in zip(ids, kwargs, criteria)]
    template = str(extra.get("q_type") or "type6")
    if template not in TEMPLATES:
        return subset, f"unknown extra_info.q_type {template!r}"
    uid = f"hir-{extra.get('index', index)}-{index}"
    rec = constraint_record(uid, question, cons, subset, "hir", template)
    stored = _as_obj(row.get("prompt"))
    if isinstance(stored, list) and stored and isinstance(stored[-1], Mapping):
        rec.meta["stored_prompt_matches"] = stored[-1].get("content") == rec.prompt
    return subset, rec


def load_hir(path: str | Path, subsets: Iterable[str]) -> tuple[list[Record], Counter]:
    """HIR-16K rows of the wanted subsets; the Counter says what was skipped and why."""
    wanted = {HIR_SUBSETS.get(s, s) for s in subsets}
    records: list[Record] = []
    skipped: Counter = Counter()
    for i, row in enumerate(read_rows(path)):
        subset, rec = hir_record(row, i)
        if subset not in wanted:
            skipped[f"subset {subset} not selected"] += 1
        elif isinstance(rec, str):
            skipped[rec] += 1
        else:
            records.append(rec)
    return records, skipped
