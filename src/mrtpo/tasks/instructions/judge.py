"""AdvancedIF: rubric verdicts from an LLM judge at an OpenAI-compatible endpoint (optional).

AdvancedIF has no programmatic checkers: experts wrote rubrics per conversation and a judge
model decides each. One request per response (conversation, response, numbered rubrics), a
JSON list of booleans back; nothing runs unless ``eval.split=advancedif`` and
``eval.judge_url`` are set. Rows (the public CSV or a JSONL
export) carry ``conversation_history`` (messages or their JSON) and ``prompt_metadata.rubrics``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from mrtpo.tasks.base import Messages
from mrtpo.tasks.instructions.data import Constraint, Record, read_rows

JUDGE_SYSTEM = (
    "You grade whether an assistant's final reply satisfies each item of a rubric. Judge "
    "every item on its own, strictly, from the reply's text only. Answer with JSON only: "
    '{"verdicts": [true, false, ...]} with one boolean per rubric item, in order.'
)


class JudgeError(RuntimeError):
    """The judge could not be reached or gave an unusable answer (not the policy's fault)."""


@dataclass
class RubricJudge:
    url: str  # OpenAI-compatible base URL (".../v1") or the full ".../chat/completions"
    model: str
    api_key_env: str | None = "OPENAI_API_KEY"  # environment variable holding the key, if any
    timeout_s: float = 120.0
    # ask the server for JSON that matches the verdict schema (OpenAI's response_format
    # json_schema, which vLLM serves with structured decoding): a small judge then cannot
    # answer in any other shape
    structured: bool = False

    @property
    def endpoint(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/chat/completions") else f"{url}/chat/completions"

    def request_body(self, conversation: Messages, response: str, rubrics: Sequence[str]) -> dict:
        convo = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in conversation)
        items = "\n".join(f"{i + 1}. {r}" for i, r in enumerate(rubrics))
        user = (
            f"Conversation so far:\n{convo}\n\nAssistant's final reply:\n{response}\n\n"
            f"Rubric ({len(rubrics)} items):\n{items}"
        )
        messages = [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.structured:  # OpenAI's response_format for exactly len(rubrics) booleans
            n = len(rubrics)
            verdicts = {"type": "array", "items": {"type": "boolean"}, "minItems": n, "maxItems": n}
            schema = {
                "type": "object",
                "properties": {"verdicts": verdicts},
                "required": ["verdicts"],
                "additionalProperties": False,
            }
            named = {"name": "verdicts", "schema": schema}
            body["response_format"] = {"type": "json_schema", "json_schema": named}
        return body

    def verdicts(self, conversation: Messages, response: str, rubrics: Sequence[str]) -> list[bool]:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = self.request_body(conversation, response, rubrics)
        try:
            r = requests.post(self.endpoint, json=body, headers=headers, timeout=self.timeout_s)
            if not r.ok:  # the server refused the request
                raise JudgeError(
                    f"judge at {self.endpoint} refused the request (HTTP {r.status_code}): "
                    f"{r.text[:300]}"
                )
            payload = r.json()
            text = payload["choices"][0]["message"]["content"]
        except (requests.RequestException, KeyError, IndexError, TypeError, ValueError) as exc:
            raise JudgeError(f"judge request to {self.endpoint} failed: {exc}") from exc
        if not isinstance(text, str):  # e.g. a refusal with content null
            raise JudgeError(f"judge at {self.endpoint} gave no verdict text: {payload!r:.200}")
        return parse_verdicts(text, len(rubrics))


def parse_verdicts(text: str, n: int) -> list[bool]:
    """The booleans of a judge reply: ``{"verdicts": [...]}`` or a bare JSON list. Tried in
    order: the whole reply, then each span ``_json_spans`` finds. JSON nested too deeply to
    parse is not an answer."""
    for candidate in (text, *_json_spans(text)):
        try:
            obj = json.loads(candidate)
        except (json.JSONDecodeError, TypeError, RecursionError):
            continue
        if isinstance(obj, Mapping):
            obj = obj.get("verdicts")
        if isinstance(obj, list) and len(obj) == n and all(isinstance(v, bool) for v in obj):
            return list(obj)
    raise JudgeError(f"judge reply is not a list of {n} booleans: {text[:200]!r}")


def _json_spans(text: str) -> list[str]:
    """The spans ``re.findall(r"\\{.*\\}|\\[.*\\]", text, re.DOTALL)`` returns, without
    its quadratic backtracking on many openers with no closer: each span runs from an opener
    to the last closer of its kind, and the search goes on after that closer."""
    last = {"{": text.rfind("}"), "[": text.rfind("]")}
    spans, i = [], 0
    while True:  # at most twice: past a kind's last closer, no opener of that kind matches
        found = [j for j in (text.find("{", i), text.find("[", i)) if -1 < j < last[text[j]]]
        if not found:
            return spans
        end = last[text[min(found)]]
        spans.append(text[min(found) : end + 1])
        i = end + 1


def judge_from_options(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> RubricJudge:
    """The judge for ``eval.split=advancedif``; a clear error when no URL is configured."""
    url = options.get("judge_url") or defaults.get("url")
    if not url:
        raise ValueError(
            "AdvancedIF is scored by an LLM judge: set eval.judge_url=http://HOST:PORT/v1 "
            "(an OpenAI-compatible endpoint) and optionally eval.judge_model=NAME"
        )
    model = options.get("judge_model") or defaults.get("model")
    if not model:
        raise ValueError("AdvancedIF judge: set eval.judge_model (or task.judge.model)")
    opts = (defaults.get("api_key_env", "OPENAI_API_KEY"), float(defaults.get("timeout_s", 120.0)))
    return RubricJudge(str(url), str(model), *opts, bool(defaults.get("structured")))


def load_advancedif(path: str | Path) -> list[Record]:
    """AdvancedIF rows -> records whose constraints are rubric items (checked by the judge)."""
    out = []
    for i, row in enumerate(read_rows(path)):
        convo = row.get("conversation_history")
        meta = row.get("prompt_metadata")
        convo = json.loads(convo) if isinstance(convo, str) else convo
        meta = json.loads(meta) if isinstance(meta, str) else (meta or {})
        rubrics = meta.get("rubrics") if isinstance(meta, Mapping) else None
        rubrics = json.loads(rubrics) if isinstance(rubrics, str) else rubrics
        if not isinstance(convo, list) or not convo or not rubrics:
            raise ValueError(
                f"{path}: row {i} needs conversation_history and prompt_metadata.rubrics"
            )
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in convo]
        cons = [Constraint("rubric", {}, str(r)) for r in rubrics]
        uid = str(row.get("id") or row.get("prompt_id") or i)
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        rec = Record(uid, last_user, cons, registry="judge", source="advancedif")
        rec.meta = {"messages": messages, "task": row.get("benchmark_name") or row.get("task")}
        out.append(rec)
    return out
