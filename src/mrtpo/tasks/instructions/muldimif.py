"""MulDimIF evaluation with the authors' own constraint checkers, imported from a folder.

The checkers are on no package index and not copied here: ``task.muldimif.checker_dir`` holds
``evaluation.py`` and the package ``eval/``, whose ``__init__`` imports pandas and openai for
nothing scoring calls; so its 12 modules go into a bare package under a private alias before
``evaluation.py`` runs (docs/tasks/instructions.md, MulDimIF). Scoring is the inner loop of
``evaluation.check`` after its ``</think>`` pre-processing; metrics are the official ``get_score``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mrtpo.tasks.deadline import CheckTimeout, call_with_budget
from mrtpo.tasks.instructions.checkers import Check, prepare_nltk_data
from mrtpo.tasks.instructions.data import read_rows

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
    data = read_rows(path)
    for i, item in enumerate(data):
        missing = {"id", "conversations", "constraints"} - set(item)
        if missing:
            raise ValueError(f"{path}: item {i} lacks {sorted(missing)}")
        for c in item["constraints"]:
            if not (isinstance(c, list) and len(c) == 3):
                raise ValueError(
                    f"{path}: item {item['id']}: constraint {c!r} is not [category, sub, text]"
                )
    return data


def verdicts(
    harness: types.ModuleType,
    constraints: Sequence[Sequence[str]],
    response: str,
    budget_s: float | None = None,
) -> list[Check]:
    """One official verdict per constraint, in order (``evaluation.check``'s inner loop). A
    checker that raises (``RecursionError`` on deep JSON, ...) or runs past ``budget_s`` CPU
    seconds fails that constraint: the response stays in the denominator."""
    out: list[Check] = []
    for category, sub, text in constraints:
        key = f"{category}_{sub}"
        checker = harness.class_mapping[key]  # every key was checked when the data loaded
        try:
            budget = {"seconds": budget_s, "what": f"checker {key}", "clock": "cpu"}
            ok = bool(call_with_budget(checker.check, text, response, **budget))
        except CheckTimeout as exc:
            out.append(Check(False, None, f"{key}: {exc}", timed_out=True))
        except Exception as exc:  # a crash on this text is a constraint it does not meet
            why = f"{key}: checker raised {type(exc).__name__}: {exc}"[:200]
            out.append(Check(False, None, why))
        else:
            out.append(Check(ok, None, None if ok else f"{key}: not followed"))
    return out


def _ratio(text: str) -> float:
    """``"a/b=c"`` (how ``get_score`` reports) -> c."""
    return float(str(text).rsplit("=", 1)[-1])


def official_metrics(harness: types.ModuleType, rows: list[dict[str, Any]]) -> dict[str, float]:
    """``get_score`` on judged rows (``constraints``, ``judges``, ``constraint_pattern``,
    ``difficulty``), its ``"a/b=c"`` strings as numbers; a pattern, category or difficulty it
    leaves out (listed only once a prompt meets all of its constraints there) is 0.0."""
    out = {f"pattern/{row['constraint_pattern']}": 0.0 for row in rows}
    out.update({f"difficulty/{row['difficulty']}": 0.0 for row in rows})
    score = harness.get_score(rows)  # map_constraint rewrites each row's constraints in place
    out["muldimif_overall"] = _ratio(score["Overall"])
    out.update({f"category/{c[0]}": 0.0 for row in rows for c in row["constraints"]})
    for prefix in ("pattern", "category", "category_second", "difficulty"):
        for name, value in score.get(f"constraint_{prefix}_list", {}).items():
            out[f"{prefix}/{name}"] = _ratio(value)
    return out
