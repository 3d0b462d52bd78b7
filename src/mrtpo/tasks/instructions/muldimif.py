"""MulDimIF evaluation with the authors' own constraint checkers, imported from a folder.

The checkers are on no package index and not copied here: they are imported from
``task.muldimif.checker_dir`` (a clone of the authors' repository, or the unchanged copy in
``../shared/vendor/muldimif``): ``evaluation.py`` (``class_mapping``, ``check``, ``get_score``)
and the package ``eval/`` (12 checker modules plus ``utils.py``).

``eval/__init__.py`` ends with ``from .utils import *``, and ``utils.py`` imports pandas and openai
for code scoring never calls. So ``eval`` is registered as a bare package (its ``__init__`` does
not run), the 12 modules are imported into it with their classes exposed, and only then does
``evaluation.py`` run (its ``from eval import *`` finds exactly those). Both live under private
aliases; the global ``eval`` / ``evaluation`` entries are restored after, so nothing is shadowed.
The Python version ``evaluation.py`` prints at import is swallowed.

Scoring is ``evaluation.check``: one ``checker.check(constraint_text, response)`` per constraint,
keyed ``f"{category}_{sub_category}"``, after dropping text up to the last ``</think>`` (and the
newlines after it), as ``evaluation.pre_process`` does. Metrics: the official ``get_score``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import json
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from mrtpo.tasks.deadline import CheckTimeout, call_with_budget
from mrtpo.tasks.instructions.checkers import prepare_nltk_data

CHECKER_MODULES = (
    "Content_Keywords", "Content_Others", "Content_Punctuation", "Format_Json",
    "Format_Markdown", "Format_Others", "Format_Table", "Language_Chinese", "Language_English",
    "Length_Paragraphs", "Length_Sentences", "Length_Words",
)  # fmt: skip
INSTALL_HINT = "pip install 'mrtpo[muldimif]'"
_PKG = "_mrtpo_muldimif_eval"  # private alias of the authors' ``eval`` package
_HARNESS = "_mrtpo_muldimif_evaluation"  # private alias of their ``evaluation.py``


class MulDimIFUnavailable(RuntimeError):
    """The MulDimIF checkers cannot be imported (folder or dependency missing)."""


def strip_think(response: str) -> str:
    """The harness's DeepSeek pre-processing: keep what follows the last ``</think>``."""
    cut = response.rfind("</think>")
    if cut == -1:
        return response
    return response[cut + len("</think>") :].strip("\n")


@functools.cache
def load_harness(checker_dir: str, nltk_dir: str) -> types.ModuleType:
    """The authors' ``evaluation`` module from ``checker_dir`` (cached per folder);
    ``nltk_dir`` (``task.nltk_data_dir``) gives Content_Punctuation the offline Punkt copy."""
    root = Path(checker_dir).expanduser()
    if not (root / "evaluation.py").is_file() or not (root / "eval").is_dir():
        raise MulDimIFUnavailable(
            f"MulDimIF checkers not found at {root}: expected evaluation.py and eval/ there "
            "(a clone of the authors' repository, folder evaluation/MulDimIF of "
            "github.com/sastpg/HIR). Set task.muldimif.checker_dir"
        )
    missing = [m for m in ("nltk", "zhconv") if importlib.util.find_spec(m) is None]
    if missing:
        raise MulDimIFUnavailable(
            f"the MulDimIF checkers need {missing}, which are not installed ({INSTALL_HINT})"
        )

    prepare_nltk_data(nltk_dir)
    saved = {name: sys.modules.get(name) for name in ("eval", "evaluation")}
    pkg = types.ModuleType(_PKG)
    pkg.__path__ = [str(root / "eval")]
    sys.modules[_PKG] = pkg
    try:
        for name in CHECKER_MODULES:
            module = importlib.import_module(f"{_PKG}.{name}")
            setattr(pkg, name, getattr(module, name))
        sys.modules["eval"] = pkg  # what ``from eval import *`` in evaluation.py resolves
        spec = importlib.util.spec_from_file_location(_HARNESS, root / "evaluation.py")
        assert spec is not None and spec.loader is not None
        harness = importlib.util.module_from_spec(spec)
        sys.modules[_HARNESS] = harness
        with contextlib.redirect_stdout(io.StringIO()):
            spec.loader.exec_module(harness)
    except ImportError as exc:
        sys.modules.pop(_PKG, None)
        sys.modules.pop(_HARNESS, None)
        raise MulDimIFUnavailable(
            f"importing the MulDimIF checkers from {root} failed: {exc} ({INSTALL_HINT})"
        ) from exc
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    for attr in ("class_mapping", "check", "get_score"):
        if not hasattr(harness, attr):
            raise MulDimIFUnavailable(
                f"{root / 'evaluation.py'} has no {attr!r}: not the MulDimIF harness this "
                "project reads (task.muldimif.checker_dir)"
            )
    return harness


def load_test(path: str | Path) -> list[dict[str, Any]]:
    """``test.json``: a list of ``{id, conversations, constraints, constraint_pattern, ...}``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"MulDimIF data not found at {p}: set task.eval_files.muldimif")
    data = json.loads(p.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{p}: expected a JSON list of MulDimIF items")
    for i, item in enumerate(data):
        missing = {"id", "conversations", "constraints"} - set(item)
        if missing:
            raise ValueError(f"{p}: item {i} lacks {sorted(missing)}")
        for c in item["constraints"]:
            if not (isinstance(c, list) and len(c) == 3):
                raise ValueError(
                    f"{p}: item {item['id']}: constraint {c!r} is not [category, sub, text]"
                )
    return data


class Verdict(NamedTuple):
    ok: bool
    reason: str | None  # why the constraint failed; None when met
    timed_out: bool = False  # the checker ran past its time budget


def verdicts(
    harness: types.ModuleType,
    constraints: Sequence[Sequence[str]],
    response: str,
    budget_s: float | None = None,
) -> list[Verdict]:
    """One official verdict per constraint, in order (``evaluation.check``'s inner loop),
    with why it failed (None when met). A checker that raises (``RecursionError`` on deep
    JSON, ...) or runs past ``budget_s`` CPU seconds fails that constraint: the response stays
    in the denominator, as one the checker cannot accept.
    """
    out: list[Verdict] = []
    for category, sub, text in constraints:
        key = f"{category}_{sub}"
        checker = harness.class_mapping.get(key)
        if checker is None:
            raise KeyError(f"MulDimIF constraint key {key} has no checker")
        try:
            ok = bool(
                call_with_budget(
                    checker.check,
                    text,
                    response,
                    seconds=budget_s,
                    what=f"checker {key}",
                    clock="cpu",
                )
            )
        except CheckTimeout as exc:
            out.append(Verdict(False, f"{key}: {exc}", timed_out=True))
            continue
        except Exception as exc:  # a crash on this text is a constraint it does not meet
            out.append(Verdict(False, f"{key}: checker raised {type(exc).__name__}: {exc}"[:200]))
            continue
        out.append(Verdict(ok, None if ok else f"{key}: not followed"))
    return out


def _ratio(text: str) -> float:
    """``"a/b=c"`` (how ``get_score`` reports) -> c."""
    return float(str(text).rsplit("=", 1)[-1])


def official_metrics(
    harness: types.ModuleType, items: Sequence[Mapping[str, Any]], judges: Sequence[list[bool]]
) -> dict[str, float]:
    """``get_score`` on the judged items, its ``"a/b=c"`` strings turned into numbers."""
    rows = []
    for item, judged in zip(items, judges, strict=True):
        rows.append(
            {
                "constraints": [list(c) for c in item["constraints"]],
                "judges": [int(j) for j in judged],
                "constraint_pattern": item.get("constraint_pattern", "unknown"),
                "difficulty": item.get("difficulty", "unknown"),
            }
        )
    score = harness.get_score(rows)  # map_constraint rewrites each row's constraints in place
    out = {"muldimif_overall": _ratio(score["Overall"])}
    # get_score lists a category only once a prompt meets all of its constraints in it
    out.update({f"category/{c[0]}": 0.0 for row in rows for c in row["constraints"]})
    for key, prefix in (
        ("constraint_pattern_list", "pattern"),
        ("constraint_category_list", "category"),
        ("constraint_category_second_list", "category_second"),
        ("constraint_difficulty_list", "difficulty"),
    ):
        for name, value in score.get(key, {}).items():
            out[f"{prefix}/{name}"] = _ratio(value)
    return out
