"""BFCL v4 single-turn evaluation (AST categories), scored by BFCL's own checker.

Data: the case and ``possible_answer/`` files inside the ``bfcl-eval`` package (no download).
Categories (BFCL's names): Non-Live ``simple_python``, ``simple_java``, ``simple_javascript``,
``multiple``, ``parallel``, ``parallel_multiple``; Live ``live_simple``, ``live_multiple``,
``live_parallel``, ``live_parallel_multiple``.

Prompt: the RLLA system prompt listing the case's functions in the training layout (after BFCL's
language-specific doc processing, Java/JavaScript types become "string" with a note, as BFCL
does for every model), plus any system message of the case; the user turn in RLLA's layout.

Decoding is ToolRL's BFCL handler: the last ``<tool_call>`` block, one JSON object per line,
unparsable lines skipped, calls named "None" dropped; each call becomes ``{name: {argument:
value}}``. The checker is ``ast_checker`` with the raw function docs, as BFCL's runner calls it,
on deep copies (it normalizes strings in place).

Aggregates are BFCL's leaderboard code: Non-Live simple = unweighted mean of the three simple
categories; Non-Live AST = unweighted mean of (simple, multiple, parallel, parallel_multiple);
Live AST = case-weighted mean of the four Live ones. A summary needs all its categories (BFCL
shows "N/A" otherwise).
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterable, Sequence
from typing import Any

from mrtpo.tasks.base import Example, Messages
from mrtpo.tasks.toolcall.bfcl_compat import (
    CHECKER_MODEL_NAME,
    bfcl_package_dir,
    load_ast_checker,
)
from mrtpo.tasks.toolcall.parsing import SYSTEM_TEMPLATE, render_tools

NON_LIVE = (
    "simple_python",
    "simple_java",
    "simple_javascript",
    "multiple",
    "parallel",
    "parallel_multiple",
)
LIVE = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
CATEGORIES = NON_LIVE + LIVE
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
    if category == "simple_java":
        return "java"
    if category == "simple_javascript":
        return "javascript"
    return "python"


def check_categories(categories: Iterable[str] | str | None) -> list[str]:
    """Validated category list (``None`` or ``"all"``: all ten); errors name the config key."""
    if categories is None or categories == "all":
        return list(CATEGORIES)
    if isinstance(categories, str):
        categories = [categories]
    cats = list(categories)
    if "all" in cats:
        return list(CATEGORIES)
    expanded: list[str] = []
    for c in cats:
        if c == "non_live":
            expanded += NON_LIVE
        elif c == "live":
            expanded += LIVE
        elif c in CATEGORIES:
            expanded.append(c)
        else:
            raise ValueError(
                f"unknown BFCL category {c!r} in eval.categories (or task.bfcl_categories); "
                f"valid: {', '.join(CATEGORIES)} (or the groups 'non_live', 'live', 'all')"
            )
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
            if t == "any":
                desc += (
                    f" This parameter can be of any type of {word} object in string representation."
                )
            else:
                desc += f" This is {word} {t} type parameter in string representation."
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
    system = SYSTEM_TEMPLATE.replace("{tools}", render_tools(tools))
    turn = case["question"][0]
    extra_system = [m["content"] for m in turn if m["role"] == "system"]
    if extra_system:  # e.g. "act as if today is ...": needed to answer, so kept
        system += "\n\n" + "\n\n".join(extra_system)
    request = "\n".join(m["content"].strip() for m in turn if m["role"] == "user")
    user = f"**Dialogue Records History**\n<user> {request}\n{USER_SUFFIX} </user>"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def load_cases(categories: Iterable[str] | str | None = None) -> list[Example]:
    """BFCL examples of the given categories (ids are BFCL's, e.g. ``simple_python_0``)."""
    out: list[Example] = []
    for cat in check_categories(categories):
        for case, answer in read_category(cat):
            out.append(
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
            )
    return out


# ---- decoding and checking -------------------------------------------------------------------
def decode_calls(response: str) -> list[Any]:
    """Model text -> BFCL's call list ``[{name: {arg: value}}]`` (ToolRL's decoder)."""
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


def is_call_list(decoded: Any) -> bool:
    """BFCL's output-shape test: a list of one-key dicts whose value is an argument dict."""
    return isinstance(decoded, list) and all(
        isinstance(c, dict) and len(c) == 1 and isinstance(next(iter(c.values())), dict)
        for c in decoded
    )


def check_calls(
    functions: list[dict[str, Any]],
    decoded: list[Any],
    possible_answer: list[dict[str, Any]],
    category: str,
) -> dict[str, Any]:
    """BFCL's verdict ``{"valid", "error", "error_type"}`` for decoded calls of one case."""
    if not is_call_list(decoded):
        return {
            "valid": False,
            "error": ["decoded output is not a list of {name: {arguments}} calls"],
            "error_type": "ast_decoder:decoder_wrong_output_format",
        }
    checker = load_ast_checker()
    lang = getattr(checker.Language, language_of(category).upper())
    try:
        res = checker.ast_checker(
            copy.deepcopy(functions),
            copy.deepcopy(decoded),
            copy.deepcopy(possible_answer),
            lang,
            category,
            CHECKER_MODEL_NAME,
        )
    except Exception as exc:  # the checker's converters can raise on odd values
        return {
            "valid": False,
            "error": [f"the BFCL checker raised {type(exc).__name__}: {exc}"],
            "error_type": "checker_exception",
        }
    return {"valid": bool(res.get("valid")), **{k: v for k, v in res.items() if k != "valid"}}


def check_response(example: Example, response: str) -> dict[str, Any]:
    """Decode ``response`` and run the official checker on it."""
    d = example.data
    return check_calls(d["functions"], decode_calls(response), d["possible_answer"], d["category"])


# ---- aggregation -------------------------------------------------------------------------------
def summarize(results: dict[str, list[bool]]) -> dict[str, float]:
    """Per-category accuracy and BFCL's summary averages, from per-case verdicts."""
    out: dict[str, float] = {}
    acc: dict[str, tuple[float, int]] = {}
    for cat in CATEGORIES:
        v = results.get(cat)
        if v:
            acc[cat] = (sum(v) / len(v), len(v))
            out[f"bfcl/{cat}/accuracy"] = acc[cat][0]
            out[f"bfcl/{cat}/n"] = float(len(v))
    simple = ("simple_python", "simple_java", "simple_javascript")
    if all(c in acc for c in simple):
        simple_acc = sum(acc[c][0] for c in simple) / 3
        out["bfcl/non_live/simple_ast"] = simple_acc
        if all(c in acc for c in NON_LIVE):
            parts = [simple_acc] + [acc[c][0] for c in NON_LIVE[3:]]
            out["bfcl/non_live/summary_ast"] = sum(parts) / len(parts)
    if all(c in acc for c in LIVE):
        total = sum(acc[c][1] for c in LIVE)
        out["bfcl/live/summary_ast"] = sum(acc[c][0] * acc[c][1] for c in LIVE) / total
    return out


# ---- oracle answers (pipeline checks) ------------------------------------------------------------
#: Cases whose possible answer no output can satisfy under BFCL's own checker (data defects
#: in bfcl-eval 2026.3.23), found by trying every combination of listed options. The oracle
#: check excludes exactly these; a model can never score on them either.
UNMEETABLE_CASES: dict[str, str] = {
    "simple_java_36": "ArrayList<any> elements always convert to strings; the answer expects 42 and true",
    "simple_java_64": "HashMap answer value is a bare string, so the checker compares it per character",
    "simple_java_65": "ArrayList<any> elements always convert to strings; the answer expects true",
    "live_simple_106-63-0": "answer omits required parameters (e.g. auto_loan_payment_start)",
    "live_simple_112-68-0": "answer omits required parameters (e.g. acc_routing_start)",
    "live_multiple_862-181-3": "answer uses journey_start_time, which the function does not declare",
    "live_multiple_964-207-0": "answer uses 'question' but the function requires 'statement'",
}
_OMIT = object()
_MAX_COMBOS = 4096


def _find_function(functions: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for f in functions:
        if f["name"] == name:
            return f
    raise KeyError(name)


def _materialize(option: Any, schema: dict[str, Any]) -> Any:
    """A concrete value from one possible-answer option (dict options hold per-key lists)."""
    t = schema.get("type")
    item_t = (schema.get("items") or {}).get("type")
    if isinstance(option, dict) and t in ("dict", "HashMap", "object"):
        return _first_dict(option)
    if isinstance(option, list) and item_t in ("dict", "object"):
        return [_first_dict(o) if isinstance(o, dict) else o for o in option]
    return option


def _first_dict(option: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, opts in option.items():
        if not isinstance(opts, list):
            out[k] = opts
            continue
        if "" in opts:
            continue  # BFCL: "" marks a key that may be left out
        out[k] = opts[0]
    return out


def _java_source(value: Any, schema: dict[str, Any]) -> str:
    t = schema.get("type")
    item_t = (schema.get("items") or {}).get("type")
    if t == "boolean":
        return "true" if value else "false"
    if t == "long":
        return f"{value}L"
    if t == "float":
        return f"{value}f"
    if t == "double":
        return repr(float(value))
    if t in ("integer", "byte", "short"):
        return str(value)
    if t == "Array" and isinstance(value, list):
        elems = ", ".join(_java_source(v, {"type": item_t}) for v in value)
        return f"new {item_t or 'Object'}[]{{{elems}}}"
    if t == "ArrayList" and isinstance(value, list):
        if not value:
            return "new ArrayList<>()"
        elems = ", ".join(
            f'"{v}"' if item_t == "String" else _java_source(v, {"type": item_t}) for v in value
        )
        return f"new ArrayList<>(Arrays.asList({elems}))"
    if t == "HashMap" and isinstance(value, dict):
        puts = " ".join(f'put("{k}", {_java_literal(v)});' for k, v in value.items())
        return f"new HashMap<>() {{{{ {puts} }}}}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _java_literal(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)


def _js_source(value: Any, schema: dict[str, Any]) -> str:
    t = schema.get("type")
    if t == "Boolean":
        return "true" if value else "false"
    if t == "Bigint":
        return f"{value}n"
    if t == "array" and isinstance(value, list):
        return "[" + ", ".join(_js_literal(v) for v in value) + "]"
    if t == "dict" and isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_js_literal(v)}" for k, v in value.items()) + "}"
    return str(value)


def _js_literal(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(_js_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_js_literal(x)}" for k, x in v.items()) + "}"
    return str(v)


def _as_written(value: Any, schema: dict[str, Any], lang: str) -> Any:
    """How a model would write ``value`` in our JSON call: Java/JS values as source text."""
    if lang == "java":
        return _java_source(value, schema)
    if lang == "javascript":
        return _js_source(value, schema)
    return value


def _param_candidates(options: list[Any], schema: dict[str, Any], required: bool) -> list[Any]:
    cands: list[Any] = []
    if "" in options and not required:
        cands.append(_OMIT)
    cands += [_materialize(o, schema) for o in options if o != ""]
    if "" in options:
        cands.append("")
    return cands or [_OMIT]


def oracle_calls(example: Example) -> list[dict[str, Any]] | None:
    """Calls (our JSON layout) from a case's possible answer that BFCL's checker accepts.

    Per parameter, in order: left out when allowed, then each listed option (at most 4,096
    combinations per call); the first accepted combination wins, ``None`` if none does (a case
    that cannot be met as written). ``_values`` holds the values before Java/JS rendering, for
    ``corrupt_calls`` (``calls_to_response`` leaves it out).
    """
    d = example.data
    lang = language_of(d["category"])
    calls: list[dict[str, Any]] = []
    for answer in d["possible_answer"]:
        (name, params), *_ = answer.items()
        fn = _find_function(d["functions"], name)
        props = fn["parameters"].get("properties", {})
        required = set(fn["parameters"].get("required", []))
        keys = list(params)
        per_param = [_param_candidates(params[k], props.get(k, {}), k in required) for k in keys]
        found = None
        for combo in itertools.islice(itertools.product(*per_param), _MAX_COMBOS):
            args = {
                k: _as_written(v, props.get(k, {}), lang)
                for k, v in zip(keys, combo, strict=True)
                if v is not _OMIT
            }
            verdict = check_calls([fn], [{name: args}], [answer], "simple_" + lang)
            if verdict["valid"]:
                values = {k: v for k, v in zip(keys, combo, strict=True) if v is not _OMIT}
                found = {"name": name, "parameters": args, "_values": values}
                break
        if found is None:
            return None
        calls.append(found)
    return calls


def calls_to_response(calls: Sequence[dict[str, Any]], think: str = "Oracle answer.") -> str:
    """A well-formed response in our format making ``calls``."""
    lines = "\n".join(
        json.dumps({"name": c["name"], "parameters": c["parameters"]}, ensure_ascii=False)
        for c in calls
    )
    return f"<think> {think} </think>\n<tool_call>\n{lines}\n</tool_call>"


def _wrong(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 7919
    if isinstance(value, float):
        return value + 7919.5
    if isinstance(value, str):
        return value + "_wrong"
    if isinstance(value, list):
        return [*value, value[0] if value else "wrong"]
    if isinstance(value, dict):
        return {**value, "zz_wrong_key": 1}
    return "wrong"


def corrupt_calls(example: Example, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``calls`` with one argument value of the first call made wrong (or, when that call has
    no arguments, one unexpected argument added)."""
    d = example.data
    lang = language_of(d["category"])
    out = copy.deepcopy(calls)
    first = out[0]
    values = first.get("_values", {})
    present = list(values)
    if not present:
        first["parameters"]["zz_unexpected_arg"] = 1
        return out
    k = present[0]
    fn = _find_function(d["functions"], first["name"])
    schema = fn["parameters"].get("properties", {}).get(k, {})
    first["parameters"][k] = _as_written(_wrong(values[k]), schema, lang)
    return out
