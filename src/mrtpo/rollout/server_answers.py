"""What a vLLM server's answers must hold before the run uses them.

A server is another program, and what it returns becomes token ids that index the policy's
embedding and log-probs that weight the loss. Each answer is checked for its shape, token
ids inside the vocabulary, the samples and tokens asked for, and finite log-probs <= 0, one
per token; a failed check raises ``BadAnswer``, which the engine words as one line.
"""

from __future__ import annotations

import math
from typing import Any

from mrtpo.rollout.base import Generation

#: a log-prob above 0 by at most this is rounding in the server's log-softmax, not an error
LOGP_SLACK = 1e-4


class BadAnswer(Exception):
    """A server's answer that the run cannot use; its message says why."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_object(answer: Any) -> dict:
    """``answer`` when it is a JSON object; else ``BadAnswer`` saying what came instead."""
    if isinstance(answer, dict):
        return answer
    if isinstance(answer, str):
        raise BadAnswer(f"a body that is not JSON ({_shown(answer)})")
    kind = "nothing" if answer is None else f"a JSON {type(answer).__name__}"
    raise BadAnswer(f"{kind} ({_shown(answer)}) where a JSON object belongs")


def field(answer: Any, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    """``answer[key]``, which must be a ``kind``; else ``BadAnswer`` naming the field."""
    obj = as_object(answer)
    where = f"{where}: " if where else ""
    if key not in obj:
        raise BadAnswer(f"{where}no field {key!r} (it has {sorted(obj)[:8]})")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise BadAnswer(f"{where}field {key!r} is {_shown(value)}")
    return value


def token_ids(values: list, vocab: int | None, where: str) -> list[int]:
    """Integer token ids inside ``[0, vocab)`` (``vocab`` None: any id >= 0)."""
    for t in values:
        if not isinstance(t, int) or isinstance(t, bool):
            raise BadAnswer(f"{where}: token id {_shown(t)} is not an integer")
        if t < 0 or (vocab is not None and t >= vocab):
            bound = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise BadAnswer(f"{where}: token id {t} is outside the policy's vocabulary {bound}")
    return list(values)


def logprob_values(entries: list, where: str) -> list[float]:
    """The ``logprob`` of each entry: finite numbers at most 0 (``LOGP_SLACK``)."""
    out = []
    for i, e in enumerate(entries):
        lp = field(e, "logprob", (int, float), f"{where}, log-prob {i}")
        if not math.isfinite(lp) or lp > LOGP_SLACK:
            raise BadAnswer(
                f"{where}: log-prob {lp!r} at token {i} (a log-probability is finite and <= 0)"
            )
        out.append(float(lp))
    return out


def _version(text: Any) -> int | None:
    try:
        return int(str(text))
    except ValueError:
        return None


def generation(choice: Any, max_tokens: int, vocab: int | None, logprobs: bool, where: str,
               version: int) -> Generation:  # fmt: skip
    """One sample of a ``/inference/v1/generate`` answer, checked."""
    ids = token_ids(field(choice, "token_ids", list, where), vocab, where)
    if len(ids) > max_tokens:
        raise BadAnswer(f"{where}: {len(ids)} tokens for max_tokens={max_tokens}")
    lps = None
    if logprobs:
        content = field(field(choice, "logprobs", dict, where), "content", list, where)
        lps = logprob_values(content, where)
        if len(lps) != len(ids):
            raise BadAnswer(f"{where}: {len(lps)} log-probs for {len(ids)} tokens")
    spans = choice.get("weight_versions") or []
    if not isinstance(spans, list):
        raise BadAnswer(f"{where}: field 'weight_versions' is {_shown(spans)}")
    known = [v for v in (_version(as_object(s).get("version")) for s in spans) if v is not None]
    finished = choice.get("finish_reason") == "stop"
    return Generation(ids, finished, lps, min(known) if known else version)


def generations(answer: Any, n: int, max_tokens: int, vocab: int | None, logprobs: bool,
                version: int) -> list[Generation]:  # fmt: skip
    """The ``n`` samples of one ``/inference/v1/generate`` answer, in their index order;
    ``version``: the weight version of samples whose answer names none."""
    choices = field(answer, "choices", list)
    if len(choices) != n:
        raise BadAnswer(f"{len(choices)} samples where n={n} were asked")
    index = [field(c, "index", int, f"sample {i}") if "index" in as_object(c) else 0
             for i, c in enumerate(choices)]  # fmt: skip
    order = sorted(range(n), key=lambda i: index[i])
    return [
        generation(choices[i], max_tokens, vocab, logprobs, f"sample {i}", version) for i in order
    ]


def served_model(answer: Any) -> str:
    """The folder or name a ``/v1/models`` answer serves (its first model)."""
    data = field(answer, "data", list)
    if not data:
        raise BadAnswer("field 'data' lists no model")
    first = as_object(data[0])
    name = first.get("root") or first.get("id")
    if not isinstance(name, str) or not name:
        raise BadAnswer(f"the first model has no 'root' or 'id' ({_shown(first)})")
    return name


def top_logprobs(answer: Any, k: int) -> dict[int, float]:
    """Token id -> log-prob of the first token's top ``k`` in a one-sample answer."""
    choices = field(answer, "choices", list)
    if len(choices) != 1:
        raise BadAnswer(f"{len(choices)} samples where n=1 was asked")
    content = field(field(choices[0], "logprobs", dict, "sample 0"), "content", list, "sample 0")
    if not content:
        raise BadAnswer("sample 0: no log-probs")
    top = field(content[0], "top_logprobs", list, "sample 0")
    if len(top) < min(k, 2):
        raise BadAnswer(f"sample 0: {len(top)} top log-probs where {k} were asked")
    ids = [field(e, "token_id", int, "sample 0") for e in top]
    return dict(zip(ids, logprob_values(top, "sample 0"), strict=True))
