"""Oracle answers to BFCL cases, for the pipeline checks of the toolcall tests: calls built from
a case's possible answer that BFCL's own checker accepts (``oracle_calls``), and a corrupted
variant it rejects (``corrupt_calls``). Moved here from ``mrtpo.tasks.toolcall.bfcl``: only
tests use them."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

from mrtpo.tasks.base import Example
from mrtpo.tasks.toolcall.bfcl import check_calls, language_of
from mrtpo.tasks.toolcall.parsing import call_lines

_OMIT = object()
_MAX_COMBOS = 4096


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
    """Each key's first option, leaving out the keys BFCL lets be left out ("" among options)."""
    return {
        k: opts[0] if isinstance(opts, list) else opts
        for k, opts in option.items()
        if not (isinstance(opts, list) and "" in opts)
    }


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
        puts = " ".join(f'put("{k}", {_literal(v)});' for k, v in value.items())
        return f"new HashMap<>() {{{{ {puts} }}}}"
    return _literal(value) if isinstance(value, bool) else str(value)


def _js_source(value: Any, schema: dict[str, Any]) -> str:
    t = schema.get("type")
    if t == "Boolean":
        return "true" if value else "false"
    if t == "Bigint":
        return f"{value}n"
    if (t == "array" and isinstance(value, list)) or (t == "dict" and isinstance(value, dict)):
        return _literal(value)
    return str(value)


def _literal(v: Any) -> str:
    """``v`` as a Java/JavaScript literal: booleans lower-case, strings double-quoted."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_literal(x)}" for k, x in v.items()) + "}"
    return str(v)


def _as_written(value: Any, schema: dict[str, Any], lang: str) -> Any:
    """How a model would write ``value`` in our JSON call: Java/JS values as source text."""
    render = {"java": _java_source, "javascript": _js_source}.get(lang)
    return render(value, schema) if render else value


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
        fn = next(f for f in d["functions"] if f["name"] == name)
        props = fn["parameters"].get("properties", {})
        required = set(fn["parameters"].get("required", []))
        keys = list(params)
        per_param = [_param_candidates(params[k], props.get(k, {}), k in required) for k in keys]
        found = None
        for combo in itertools.islice(itertools.product(*per_param), _MAX_COMBOS):
            values = {k: v for k, v in zip(keys, combo, strict=True) if v is not _OMIT}
            args = {k: _as_written(v, props.get(k, {}), lang) for k, v in values.items()}
            verdict = check_calls([fn], [{name: args}], [answer], "simple_" + lang)
            if verdict["valid"]:
                found = {"name": name, "parameters": args, "_values": values}
                break
        if found is None:
            return None
        calls.append(found)
    return calls


def calls_to_response(calls: Sequence[dict[str, Any]], think: str = "Oracle answer.") -> str:
    """A well-formed response in our format making ``calls``."""
    return f"<think> {think} </think>\n<tool_call>\n{call_lines(calls)}\n</tool_call>"


#: A wrong value of the same JSON type, by type (anything else becomes "wrong").
_WRONG = {
    bool: lambda v: not v,
    int: lambda v: v + 7919,
    float: lambda v: v + 7919.5,
    str: lambda v: v + "_wrong",
    list: lambda v: [*v, v[0] if v else "wrong"],
    dict: lambda v: {**v, "zz_wrong_key": 1},
}


def corrupt_calls(example: Example, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``calls`` with one argument value of the first call made wrong (or, when that call has
    no arguments, one unexpected argument added)."""
    d = example.data
    lang = language_of(d["category"])
    out = copy.deepcopy(calls)
    first = out[0]
    values = first.get("_values", {})
    if not values:
        first["parameters"]["zz_unexpected_arg"] = 1
        return out
    k = next(iter(values))
    fn = next(f for f in d["functions"] if f["name"] == first["name"])
    schema = fn["parameters"].get("properties", {}).get(k, {})
    wrong = _WRONG.get(type(values[k]), lambda v: "wrong")(values[k])
    first["parameters"][k] = _as_written(wrong, schema, lang)
    return out
