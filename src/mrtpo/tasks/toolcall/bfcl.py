"""BFCL v4 single-turn evaluation (AST categories), scored by BFCL's own checker.

Data: the case and ``possible_answer/`` files inside the ``bfcl-eval`` package (no download).
Prompt: the RLLA system prompt listing the case's functions after BFCL's language-specific doc
processing (Java/JavaScript types become "string" with a note), plus the case's own system
message; the user turn in RLLA's layout. Decoding is ToolRL's BFCL handler (``decode_calls``);
the checker is ``ast_checker`` with the raw function docs, as BFCL's runner calls it, on deep
copies (it normalizes strings in place). Aggregates are BFCL's leaderboard code (``summarize``;
a summary needs all its categories, BFCL shows "N/A" otherwise). See docs/tasks/toolcall.md.

``bfcl-eval`` is installed with ``--no-deps`` (its full dependency set would pin
``numpy==1.26.4`` and a dozen API clients), and only its checker is imported:
``ast_checker.py`` imports ``bfcl_eval.constants.model_config``, which imports every model
handler, to read one field, ``MODEL_CONFIG_MAPPING[model].underscore_to_dot`` (did a provider
turn "." into "_"); our model sees the original names, so it is always ``False``.
``load_ast_checker`` puts a stand-in for that module into ``sys.modules`` only during the import.
No other part of ``bfcl_eval`` is imported (notably not ``constants.eval_config``, which creates
folders inside site-packages on import).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import types
from collections import defaultdict
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

from mrtpo.tasks.base import Example, Messages
from mrtpo.tasks.toolcall.parsing import system_prompt

BFCL_VERSION = "2026.3.23"
INSTALL_HINT = (
    f"pip install --no-deps bfcl-eval=={BFCL_VERSION}  (the --no-deps route keeps numpy 2.x; "
    "the package's full dependency set pins numpy==1.26.4 and many API clients, none of "
    "which the AST checker needs)"
)
#: The model name we pass to the checker; only used to look up the stand-in config below.
CHECKER_MODEL_NAME = "mrtpo"

_STANDIN = "bfcl_eval.constants.model_config"


class BFCLMissingError(ImportError):
    """``bfcl-eval`` is not installed; the message says how to install it."""


def bfcl_package_dir() -> Path:
    """Folder of the installed ``bfcl_eval`` package (raises a clear error when absent)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BFCLMissingError(
            "BFCL evaluation (task=toolcall eval.split=bfcl) needs the bfcl-eval package, which "
            f"is not installed. Install it with:\n  {INSTALL_HINT}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def load_ast_checker() -> tuple[Any, Any]:
    """``ast_checker`` (imported with a temporary stand-in for ``constants.model_config``) and
    the ``Language`` enum it takes."""
    bfcl_package_dir()
    previous = sys.modules.get(_STANDIN)
    standin = types.ModuleType(_STANDIN)
    standin.__doc__ = "Stand-in installed by mrtpo.tasks.toolcall.bfcl (import only)."
    # every model name answers underscore_to_dot=False
    standin.MODEL_CONFIG_MAPPING = defaultdict(  # type: ignore[attr-defined]
        lambda: types.SimpleNamespace(underscore_to_dot=False)
    )
    sys.modules[_STANDIN] = standin
    try:  # a module imported before is returned as it is
        mod = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
    finally:
        if previous is None:
            sys.modules.pop(_STANDIN, None)
        else:
            sys.modules[_STANDIN] = previous
    enums = importlib.import_module("bfcl_eval.constants.enums")
    return mod.ast_checker, enums.Language


SIMPLE = ("simple_python", "simple_java", "simple_javascript")
NON_LIVE = (*SIMPLE, "multiple", "parallel", "parallel_multiple")
LIVE = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
CATEGORIES = NON_LIVE + LIVE
_GROUPS = {"non_live": NON_LIVE, "live": LIVE}
VERSION_PREFIX = "BFCL_v4"

#: Appended to the user's request (ToolRL's BFCL prompt asks the same: act or say why not).
USER_SUFFIX = (
    "If none of the tools fits, or a required parameter is missing, tell me so in your "
    "response without calling a tool. Otherwise, make the tool call(s) this request needs "
    "in this turn."
)

_HINTS = {
    "python": " Note that the provided function is in Python 3 syntax.",
    "java": " Note that the provided function is in Java 8 SDK syntax.",
    "javascript": " Note that the provided function is in JavaScript syntax.",
}


def language_of(category: str) -> str:
    """The checker language of a category (BFCL: by the category's name)."""
    return {"simple_java": "java", "simple_javascript": "javascript"}.get(category, "python")


def check_categories(categories: Iterable[str] | str | None) -> list[str]:
    """Validated category list (``None`` or ``"all"``: all ten); errors name the config key."""
    if categories is None:
        return list(CATEGORIES)
    cats = [categories] if isinstance(categories, str) else list(categories)
    if "all" in cats:
        return list(CATEGORIES)
    expanded: list[str] = []
    for c in cats:
        if c not in CATEGORIES and c not in _GROUPS:
            raise ValueError(
                f"unknown BFCL category {c!r} in eval.categories (or task.bfcl_categories); "
                f"valid: {', '.join(CATEGORIES)} (or the groups 'non_live', 'live', 'all')"
            )
        expanded += _GROUPS.get(c, (c,))
    return list(dict.fromkeys(expanded))


def _read_jsonl(path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_category(category: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(case, possible answer) pairs of one category, aligned by position as BFCL does."""
    data = bfcl_package_dir() / "data"
    cases = _read_jsonl(data / f"{VERSION_PREFIX}_{category}.json")
    answers = _read_jsonl(data / "possible_answer" / f"{VERSION_PREFIX}_{category}.json")
    if len(cases) != len(answers):
        raise ValueError(f"BFCL {category}: {len(cases)} cases but {len(answers)} answers")
    return list(zip(cases, answers, strict=True))


def prompt_functions(functions: list[dict[str, Any]], category: str) -> list[dict[str, Any]]:
    """Function docs as BFCL shows them to a model: a language note on every description;
    for Java/JavaScript every parameter typed "string" with a note on its real type."""
    lang = language_of(category)
    out = copy.deepcopy(functions)
    for fn in out:
        fn["description"] = fn.get("description", "") + _HINTS[lang]
        if lang == "python":
            continue
        word = "Java" if lang == "java" else "JavaScript"
        for prop in fn.get("parameters", {}).get("properties", {}).values():
            t = prop.get("type")
            desc = prop.get("description", "")
            what = (
                f"parameter can be of any type of {word} object"
                if t == "any"
                else f"is {word} {t} type parameter"
            )
            desc += f" This {what} in string representation."
            if t in ("ArrayList", "Array", "array"):
                item = prop.pop("items", {}).get("type")
                desc += (
                    f" The list elements are of type {item}; they are not in string representation."
                )
            if lang == "javascript" and t == "dict" and "properties" in prop:
                desc += (
                    " The dictionary entries have the following schema; they are not in string "
                    f"representation. {json.dumps(prop.pop('properties'))}"
                )
            prop["description"] = desc
            prop["type"] = "string"
    return out


def case_messages(case: dict[str, Any], category: str) -> Messages:
    """The chat prompt of a single-turn BFCL case in the RLLA layout."""
    functions = prompt_functions(case["function"], category)
    tools = [
        {
            "name": f["name"],
            "description": f.get("description", ""),
            "parameters": f.get("parameters", {}).get("properties", {}),
        }
        for f in functions
    ]
    system = system_prompt(tools)
    turn = case["question"][0]
    extra_system = [m["content"] for m in turn if m["role"] == "system"]
    if extra_system:  # e.g. "act as if today is ...": needed to answer, so kept
        system += "\n\n" + "\n\n".join(extra_system)
    request = "\n".join(m["content"].strip() for m in turn if m["role"] == "user")
    user = f"**Dialogue Records History**\n<user> {request}\n{USER_SUFFIX} </user>"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def load_cases(categories: Iterable[str] | str | None = None) -> list[Example]:
    """BFCL examples of the given categories (ids are BFCL's, e.g. ``simple_python_0``)."""
    return [
        Example(
            id=case["id"],
            messages=case_messages(case, cat),
            data={
                "source": "bfcl",
                "category": cat,
                "functions": case["function"],
                "possible_answer": answer["ground_truth"],
                "tags": ("tool_call",),
            },
        )
        for cat in check_categories(categories)
        for case, answer in read_category(cat)
    ]


# ---- decoding and checking -------------------------------------------------------------------
def decode_calls(response: str) -> list[Any]:
    """Model text -> BFCL's call list ``[{name: {arg: value}}]``, as ToolRL's decoder: the last
    ``<tool_call>`` block, one JSON object per line, unreadable lines and calls named "None"
    skipped."""
    if "<tool_call>" not in response:
        return []
    block = response.split("<tool_call>")[-1].split("</tool_call>")[0].strip()
    decoded: list[Any] = []
    for line in block.split("\n"):
        try:
            call = json.loads(line)
            name = call["name"]
            if name.strip().lower() == "none":
                continue
            decoded.append({name: call["parameters"]})
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue  # an unreadable line is skipped, as ToolRL's BFCL handler does
    return decoded


def check_calls(
    functions: list[dict[str, Any]],
    decoded: list[Any],
    possible_answer: list[dict[str, Any]],
    category: str,
) -> dict[str, Any]:
    """BFCL's verdict ``{"valid", "error", "error_type"}`` for decoded calls of one case."""
    # BFCL's output-shape test: a list of one-key dicts whose value is an argument dict
    if not isinstance(decoded, list) or not all(
        isinstance(c, dict) and len(c) == 1 and isinstance(next(iter(c.values())), dict)
        for c in decoded
    ):
        kind = "ast_decoder:decoder_wrong_output_format"
        why = "decoded output is not a list of {name: {arguments}} calls"
        return {"valid": False, "error": [why], "error_type": kind}
    ast_checker, languages = load_ast_checker()
    try:
        res = ast_checker(
            copy.deepcopy(functions),
            copy.deepcopy(decoded),
            copy.deepcopy(possible_answer),
            getattr(languages, language_of(category).upper()),
            category,
            CHECKER_MODEL_NAME,
        )
    except Exception as exc:  # the checker's converters can raise on odd values
        error = f"the BFCL checker raised {type(exc).__name__}: {exc}"
        return {"valid": False, "error": [error], "error_type": "checker_exception"}
    return {"valid": bool(res.get("valid")), **{k: v for k, v in res.items() if k != "valid"}}


def check_response(example: Example, response: str) -> dict[str, Any]:
    """Decode ``response`` and run the official checker on it."""
    d = example.data
    return check_calls(d["functions"], decode_calls(response), d["possible_answer"], d["category"])


# ---- aggregation -------------------------------------------------------------------------------
def summarize(results: dict[str, list[bool]]) -> dict[str, float]:
    """Per-category accuracy and BFCL's summaries, from per-case verdicts: Non-Live simple =
    unweighted mean of the three simple categories; Non-Live AST = unweighted mean of (simple,
    multiple, parallel, parallel_multiple); Live AST = case-weighted mean of the Live ones."""
    out: dict[str, float] = {}
    acc: dict[str, tuple[float, int]] = {}
    for cat in CATEGORIES:
        v = results.get(cat)
        if v:
            acc[cat] = (sum(v) / len(v), len(v))
            out[f"bfcl/{cat}/accuracy"] = acc[cat][0]
            out[f"bfcl/{cat}/n"] = float(len(v))
    if all(c in acc for c in SIMPLE):
        simple_acc = sum(acc[c][0] for c in SIMPLE) / len(SIMPLE)
        out["bfcl/non_live/simple_ast"] = simple_acc
        if all(c in acc for c in NON_LIVE):
            parts = [simple_acc] + [acc[c][0] for c in NON_LIVE[len(SIMPLE) :]]
            out["bfcl/non_live/summary_ast"] = sum(parts) / len(parts)
    if all(c in acc for c in LIVE):
        total = sum(acc[c][1] for c in LIVE)
        out["bfcl/live/summary_ast"] = sum(acc[c][0] * acc[c][1] for c in LIVE) / total
    return out


# ---- cases no output can pass ----------------------------------------------------------------
#: Cases whose possible answer no output can satisfy under BFCL's own checker (data defects
#: in bfcl-eval 2026.3.23), found by trying every combination of listed options. The oracle
#: check (tests/bfcl_oracle.py) excludes exactly these; a model can never score on them either.
UNMEETABLE_CASES: dict[str, str] = {
    "simple_java_36": "ArrayList<any> elements always convert to strings; the answer expects 42 and true",
    "simple_java_64": "HashMap answer value is a bare string, so the checker compares it per character",
    "simple_java_65": "ArrayList<any> elements always convert to strings; the answer expects true",
    "live_simple_106-63-0": "answer omits required parameters (e.g. auto_loan_payment_start)",
    "live_simple_112-68-0": "answer omits required parameters (e.g. acc_routing_start)",
    "live_multiple_862-181-3": "answer uses journey_start_time, which the function does not declare",
    "live_multiple_964-207-0": "answer uses 'question' but the function requires 'statement'",
}
