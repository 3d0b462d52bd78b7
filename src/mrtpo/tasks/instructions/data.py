"""Instruction-following records, the prompt template and the file loaders.

A training record is a request plus constraints, each (instruction id, checker arguments,
sentence stating it); ``render_prompt`` joins them by one of HiR's six templates (generated
prompts: ``type6``; HIR-16K rows name theirs), and ``P_\\k`` is the same template without
constraint k's sentence. Benchmark prompts (IFEval, IFBench) stay verbatim: nothing to remove.
HIR-16K's two layouts, ``released`` and ``verl``, are told apart by their fields
(``HIR_LAYOUTS``; docs/tasks/instructions.md, Data).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrtpo.tasks.custom.data import FILE_FORMATS
from mrtpo.tasks.custom.data import read_rows as custom_rows

log = logging.getLogger(__name__)

# HIR-16K's subset names (``type1`` ... ``type4``) and ours, each to ours.
_TYPES = {"type1": "ifeval", "type2": "ifbench", "type3": "muldimif", "type4": "mixed"}
HIR_SUBSETS = {k: v for t, v in _TYPES.items() for k in (t, v)}
# Subsets whose constraints the installed checkers score (the paper's "first two subsets").
TRAINABLE_SUBSETS = ("ifeval", "ifbench")
HIR_LAYOUTS = {
    "released": ("id", "source", "prompt", "criteria", "ground_truth"),
    "verl": ("data_source", "reward_model", "extra_info"),
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
    template: str | None = "type6"  # how base and sentences are joined (see render_prompt)
    meta: dict[str, Any] = field(default_factory=dict)


def render_prompt(base: str, sentences: Sequence[str], template: str = "type6") -> str:
    """Base request + constraint sentences, by one of HiR's six concatenation templates:
    ``type6`` (the default, used for generated prompts) a blank line, then one sentence per
    line; ``type1``/``type2`` prose after a space / a newline; ``type3`` a numbered rule
    list; ``type4`` a dashed list; ``type5`` sentences first. No sentences: the base alone."""
    if not sentences:
        return base
    if template in ("type1", "type2", "type5"):
        prose = "".join(s + (" " if s[-1:] in ",.?!" else ". ") for s in sentences).strip()
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


def sentence_spans(
    prompt: str, base: str, sentences: Sequence[str], template: str = "type6"
) -> list[tuple[int, int] | None]:
    """(first, end) character of each constraint sentence in ``prompt`` as ``render_prompt``
    wrote it (in the prose templates with the full stop it added), found in order after the
    base request (before it for ``type5``); None for a sentence not found."""
    cursor = len(base) if template != "type5" and prompt.startswith(base) else 0
    out: list[tuple[int, int] | None] = []
    for text in sentences:
        at = prompt.find(text, cursor) if text else -1
        if at < 0:
            out.append(None)
            continue
        end = at + len(text)
        prose = template in ("type1", "type2", "type5")
        if prose and text[-1:] not in ",.?!" and prompt[end : end + 1] == ".":
            end += 1
        out.append((at, end))
        cursor = end
    return out


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
    """Rows of a .parquet, .jsonl, .json (list, or a dict holding one) or .csv file (the
    custom task's reader: every error names the file and, where there is one, the line)."""
    p = Path(path)
    fmt = FILE_FORMATS.get(p.suffix.lower())  # a missing file: FileNotFoundError, naming it
    if fmt is None:
        raise ValueError(f"{p}: unsupported file type {p.suffix!r} (parquet, jsonl, json or csv)")
    return custom_rows(str(p), fmt, split=None, name=None, key="data file")


def _as_obj(value: Any) -> Any:
    """JSON text -> object; anything else unchanged (parquet keeps some columns as text)."""
    return json.loads(value) if isinstance(value, str) and value[:1] in "[{" else value


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


def hir_layout(row: Mapping[str, Any], where: str = "") -> str:
    """``released`` or ``verl``; anything else fails naming the fields found."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: a HIR-16K row must be a JSON object, got {type(row).__name__}")
    for name, fields in HIR_LAYOUTS.items():
        if all(f in row for f in fields if f != "id"):
            return name
    accepted = "; ".join(f"{n}: {', '.join(f)}" for n, f in HIR_LAYOUTS.items())
    raise ValueError(
        f"{where}: unknown HIR-16K layout: the row has fields {sorted(row)}; accepted layouts "
        f"are {accepted} (task.data.path)"
    )


def _ifeval_like(
    gt: Any, criteria: Any, subset: str
) -> tuple[list[Constraint], None] | tuple[None, str]:
    """``instruction_id_list`` + ``kwargs`` + sentences -> constraints, or why not."""
    if not isinstance(gt, Mapping) or "instruction_id_list" not in gt:
        if subset == "muldimif":
            return None, "MulDimIF-style constraint table (no IFEval/IFBench checker)"
        if isinstance(gt, Mapping) and "checker" in gt:
            return None, "rule/LLM checker entries (embedded code is never executed)"
        return None, "no ground_truth.instruction_id_list"
    ids = list(gt["instruction_id_list"])
    kwargs = [(_as_obj(k) or {}) for k in (_as_obj(gt.get("kwargs")) or [{}] * len(ids))]
    criteria = list(_as_obj(criteria) or [])
    if not (len(ids) == len(kwargs) == len(criteria)) or not ids:
        return None, "instruction ids, kwargs and criteria differ in length"
    if any(not isinstance(c, str) or not c.strip() for c in criteria):
        return None, "empty constraint sentence"
    if any(not isinstance(k, Mapping) for k in kwargs):
        return None, "a kwargs entry is not an object"
    return [Constraint(str(i), dict(k), c) for i, k, c in zip(ids, kwargs, criteria)], None


def hir_record(
    row: Mapping[str, Any], index: int, template: str = "type6"
) -> tuple[str, Record | str]:
    """One HIR-16K row (either layout) -> (subset, record) or (subset, reason it was skipped);
    ``template`` renders rows that name none (the released file)."""
    layout = hir_layout(row, f"row {index}")
    if layout == "released":
        source = str(row.get("source", ""))
        gt = _as_obj(row.get("ground_truth"))
        question, criteria, q_type = row.get("prompt"), row.get("criteria"), None
        raw_id = row.get("id", index)
    else:
        source = str(row.get("data_source", ""))
        gt = _as_obj((_as_obj(row.get("reward_model")) or {}).get("ground_truth"))
        extra = _as_obj(row.get("extra_info")) or {}
        question, criteria, q_type = (extra.get(k) for k in ("question", "criteria", "q_type"))
        raw_id = extra.get("index", index)
    subset = HIR_SUBSETS.get(source, source or "unknown")
    if not isinstance(question, str) or not question.strip() or criteria is None:
        where = "prompt / criteria" if layout == "released" else "extra_info.question / criteria"
        return subset, f"no {where}"
    cons, why = _ifeval_like(gt, criteria, subset)
    if cons is None:
        return subset, str(why)
    chosen = str(q_type or template)
    if chosen not in TEMPLATES:
        key = "extra_info.q_type" if q_type else "task.data.template"
        return subset, f"unknown {key} {chosen!r}"
    uid = f"hir-{raw_id}" if layout == "released" else f"hir-{raw_id}-{index}"
    rec = constraint_record(uid, question, cons, subset, "hir", chosen)
    rec.meta["layout"] = layout
    stored = _as_obj(row.get("prompt")) if layout == "verl" else None
    if isinstance(stored, list) and stored and isinstance(stored[-1], Mapping):
        rec.meta["stored_prompt_matches"] = stored[-1].get("content") == rec.prompt
    return subset, rec


def load_hir(
    path: str | Path, subsets: Iterable[str], template: str = "type6"
) -> tuple[list[Record], Counter]:
    """HIR-16K rows of the wanted subsets; the Counter says what was skipped and why."""
    wanted = {HIR_SUBSETS.get(s, s) for s in subsets}
    records: list[Record] = []
    skipped: Counter = Counter()
    for i, row in enumerate(read_rows(path)):
        try:
            subset, rec = hir_record(row, i, template)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        if subset not in wanted:
            skipped[f"subset {subset} not selected"] += 1
        elif isinstance(rec, str):
            skipped[rec] += 1
        else:
            records.append(rec)
    return records, skipped
