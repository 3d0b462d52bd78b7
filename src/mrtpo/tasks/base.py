"""The task contract: prompts, rewards, verifier blocks, leave-one-out contexts, metrics.

The trainer never looks inside ``Example.data``; it only calls the methods below. Rewards are
pure functions of (example, response); ``None`` means "does not apply to this sample" (NaN in
the reward tensor), and ``reward_value`` is every task's rule for what a reward may be. A
verifier block is the text its verifier scores against (a reference query, an error message, a
format requirement); replay appends blocks to the prompt to build ``P_all`` and ``P_\\k``.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, ClassVar

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]

# float32 holds the reward tensor: a finite value beyond it would become inf there.
F32_MAX = 3.4028234663852886e38


@dataclass
class Example:
    """One prompt of a task."""

    id: str
    messages: Messages  # the sampling context P0, as chat messages
    data: dict[str, Any] = field(default_factory=dict)  # task-private: references, db, constraints
    reference: str | None = None  # a reference response, for SFT warm starts (None if none)


@dataclass
class Score:
    """What a task says about one (example, response) pair."""

    rewards: dict[str, float | None]  # one entry per reward name; None = does not apply
    blocks: dict[str, str | None] = field(default_factory=dict)  # verifier info Z_k; None: none
    reasons: dict[str, str] = field(default_factory=dict)  # why a reward is 0 / None (logged)
    checks: dict[str, Any] = field(default_factory=dict)  # evaluation-only extras (loose acc, ...)
    error: str | None = None  # why scoring failed (all rewards None) or partly failed
    # reward name -> {metric: number} a reward measured besides its value (the length of the SQL
    # it ran): logged as train/extra/<reward>/<name>, the mean over responses; never a reward.
    extras: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardResult:
    """A reward's value and the extra metrics it measured on the way (``Score.extras``); a
    reward function may return one, or ``{"value": 1.0, "extras": {"sql_len": 42}}``."""

    value: Any
    extras: Mapping[str, Any] = field(default_factory=dict)


def split_reward(returned: Any) -> tuple[Any, Mapping[str, Any] | None, str | None]:
    """(value, extras, problem) of what a reward function returned: a plain value has no
    extras; a ``RewardResult`` or a mapping with a ``value`` key may carry them. ``problem``
    says what is wrong with a mapping of another shape (its value is then None)."""
    if isinstance(returned, RewardResult):
        return returned.value, returned.extras, None
    if not isinstance(returned, Mapping):
        return returned, None, None
    unknown = sorted(str(k) for k in returned if k not in ("value", "extras"))
    if "value" in returned and not unknown:
        return returned["value"], returned.get("extras"), None
    shape = "a mapping without the shape {'value': number, 'extras': {name: number}}"
    return None, None, shape + (f" (unknown key(s) {unknown})" if unknown else " (no 'value')")


def clean_extras(extras: Any) -> tuple[dict[str, float], list[str]]:
    """The numbers of one reward's ``extras`` (by ``reward_value``'s rule, finite, None and
    NaN left out), and what was left out for another reason (a name that is not text, or
    holds '/', a value that is no number)."""
    if extras is None:
        return {}, []
    if not isinstance(extras, Mapping):
        return {}, [f"extras is a {type(extras).__name__}, not a mapping of name -> number"]
    out: dict[str, float] = {}
    problems = []
    for name, value in extras.items():
        if not isinstance(name, str) or not name or "/" in name:
            problems.append(f"extra name {name!r} (a name is text without '/')")
            continue
        f, problem = reward_value(value)
        if problem or (f is not None and not math.isfinite(f)):
            problems.append(f"extra {name!r} is {problem or 'not finite'}")
        elif f is not None:
            out[name] = f
    return out, problems


def reward_value(value: Any) -> tuple[float | None, str | None]:
    """A reward as a float (or None), and what was wrong with it (None: nothing). One rule for
    every type: a real number (bool, int, float, Fraction, Decimal, a numpy or torch scalar)
    that fits the float32 reward tensor. Text is never read as a number; a complex value is
    refused, not cut to its real part; one too large for float32 (``10**400``, ``1e308``, ...)
    is refused with the same reason whatever its type. NaN is None ("does not apply"); a true
    infinity (``inf``, ``Decimal('Infinity')``) is kept, and the step's update is skipped."""
    if value is None:
        return None, None
    if isinstance(value, (str, bytes, bytearray)):
        return None, f"{_kind(value)}, not a number or None"
    if _is_complex(value):
        return None, f"{_kind(value)}, not a real number (a reward has no imaginary part)"
    if isinstance(value, Decimal) and value.is_nan():
        return None, None  # float() refuses a signalling NaN
    try:  # plain numbers, Fraction, Decimal, numpy scalars, 0-d arrays and tensors
        f = float(value)
    except OverflowError:  # an int or a Fraction beyond any float
        return None, _too_large(value)
    except Exception:
        return None, f"{_kind(value)}, not a number or None"
    if math.isnan(f):
        return None, None
    # beyond float32, or a Decimal or longdouble beyond float (then inf): only a value that is
    # itself infinite stays inf
    if abs(f) > F32_MAX and not (math.isinf(f) and _is_infinite(value, f)):
        return None, _too_large(value)
    return f, None


def _is_infinite(value: Any, f: float) -> bool:
    """Whether ``value`` itself is infinite (not a finite number that overflowed to ``f``)."""
    try:
        return bool(value == f)
    except Exception:
        return False


def _is_complex(value: Any) -> bool:
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        return True  # complex, numpy complex scalars
    dtype = getattr(value, "dtype", None)
    torch_says = getattr(dtype, "is_complex", None)  # torch.dtype has it, numpy's has kind
    return torch_says if isinstance(torch_says, bool) else getattr(dtype, "kind", "") == "c"


def _too_large(value: Any) -> str:
    return f"{_kind(value)} too large for a reward (float32 holds up to {F32_MAX:.2g})"


def _kind(value: Any) -> str:
    """``a str ('1.0')``: the type and the start of the value, safe for any object."""
    name = type(value).__name__
    try:
        text = repr(str(value)[:40])
    except Exception:  # an object whose str() fails (or an int too long to print)
        text = "unprintable"
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name} ({text})"


def tag_spans(text: str, tags: Sequence[str]) -> dict[str, list[tuple[int, int]]]:
    """Each tag's first ``<tag> ... </tag>`` in ``text`` as a character span, markers included
    (an unclosed one runs to the end); a tag that does not open is left out."""
    out = {}
    for tag in tags:
        start = text.find(f"<{tag}>")
        if start < 0:
            continue
        end = text.find(f"</{tag}>", start)
        out[tag] = [(start, len(text) if end < 0 else end + len(tag) + 3)]
    return out


def token_segments(
    pieces: Sequence[str], spans: Mapping[str, Sequence[tuple[int, int]]]
) -> dict[str, list[bool]]:
    """Token masks of character ``spans`` over a text made of the tokens' ``pieces`` (their
    decoded strings, in order): a token belongs to a segment when its characters overlap one
    of the segment's spans (a token without characters, such as the end of sequence, to none)."""
    starts = [0, *itertools.accumulate(len(p) for p in pieces)]
    return {
        name: [
            any(s < b + len(p) and b < e for s, e in ranges) if p else False
            for b, p in zip(starts, pieces)
        ]
        for name, ranges in spans.items()
    }


#: (message index, first character, end character) of a stretch of a message's content.
Span = tuple[int, int, int]


@dataclass
class Contexts:
    """The leave-one-out replay contexts of one scored sample (method.md §1)."""

    all: Messages  # P_all
    without: dict[str, Messages]  # reward name -> P_\k (only for rewards that have information)
    none: Messages  # every block (or every in-prompt item) removed; used by the joint ablation
    #: Reward name -> the ``Span``s in ``all`` of the text ``without[name]`` leaves out
    #: (``none_spans``: every item's), whose tokens ``method.context=mask`` hides instead.
    spans: dict[str, list[Span]] = field(default_factory=dict)
    none_spans: list[Span] = field(default_factory=list)


def last_user_index(messages: Messages) -> int:
    """Index of the last user message (a clear error when there is none)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    raise ValueError("cannot append verifier information: the prompt has no user message")


def joined_spans(message: int, start: int, texts: Sequence[str], sep: str) -> list[Span]:
    """Spans of ``texts`` in ``sep.join(texts)`` written from character ``start`` on."""
    starts = itertools.accumulate([len(t) + len(sep) for t in texts], initial=start)
    return [(message, s, s + len(t)) for s, t in zip(starts, texts)]


def append_to_last_user(messages: Messages, text: str) -> Messages:
    """Copy of ``messages`` with ``text`` appended to the last user message (blank-line separated)."""
    out = [dict(m) for m in messages]
    m = out[last_user_index(out)]
    if text:
        m["content"] = f"{m['content']}\n\n{text}"
    return out


class Task(ABC):
    """Base class of every task. Subclasses set ``name`` and ``reward_names``."""

    name: str = "task"
    #: Reward slots, in the order of the reward tensor's K axis.
    reward_names: tuple[str, ...] = ()
    #: Order in which verifier blocks are appended (defaults to ``reward_names``).
    block_order: tuple[str, ...] | None = None
    #: True when each prompt has its own reward set (instruction constraints): SAW refuses it.
    rewards_vary_per_prompt: bool = False
    #: True when the verifier information Z_k is part of the prompt itself (``contexts`` then
    #: leaves item k out of the prompt); False: it comes as blocks (``Score.blocks``).
    info_in_prompt: bool = False
    #: The ``Score.checks`` key that says whether a response fully succeeded (logged as
    #: ``train/success``, and the default target of SFT's stopping rule); None: no such check.
    success_check: str | None = None
    #: Reward name -> (lowest, highest) value it can take; names left out range over [0, 1]
    #: (SAW shifts one reaching below 0 before its coefficient of variation, method.md).
    reward_ranges: ClassVar[Mapping[str, tuple[float, float]]] = {}
    #: Longest verifier block kept, in characters (None: no cap); a longer one is cut, with a
    #: note (``mrtpo.core.scoring``): a runaway block must not cost replay gigabytes.
    max_block_chars: int | None = 16384

    @property
    def reward_labels(self) -> dict[str, str]:
        """Reward name -> the name a person reads in tables and plots (metric keys, checkpoints
        and reports keep ``reward_names``). Default: the names themselves."""
        return {n: n for n in self.reward_names}

    # ---- data -------------------------------------------------------------------------
    @abstractmethod
    def examples(self, split: str) -> Sequence[Example]:
        """The examples of a split (``train``, ``val`` or an evaluation split name)."""

    def eval_examples(self, split: str, options: dict[str, Any]) -> Sequence[Example]:
        """Examples for ``src/eval.py``. ``options`` is the ``eval`` config section (e.g.
        ``categories``); tasks with extra selectors override this."""
        return self.examples(split)

    def check_scorable(self, examples: Sequence[Example]) -> None:
        """Raise when some of ``examples`` cannot be scored on this machine (a checker's
        package or data is missing), before any is scored. Default: every example can be."""
        return None

    # ---- rewards ------------------------------------------------------------------------
    @abstractmethod
    def score(self, example: Example, response: str) -> Score:
        """Rewards, verifier blocks and reasons for one response. Must not raise on bad text."""

    def score_many(self, examples: Sequence[Example], responses: Sequence[str]) -> list[Score]:
        """Score many pairs. Tasks with expensive verifiers override this (process pools)."""
        return [self.safe_score(e, r) for e, r in zip(examples, responses, strict=True)]

    def safe_score(self, example: Example, response: str) -> Score:
        """``score`` with fault isolation: an exception gives every reward ``None``. So does a
        ``SystemExit`` from scoring code (``sys.exit()`` in a verifier must not end a run)."""
        try:
            return self.score(example, response)
        except (Exception, SystemExit) as exc:  # a verifier bug must not kill a long run
            msg = f"{type(exc).__name__}: {exc}"
            log.warning("scoring failed for example %s: %s", example.id, msg)
            return Score(rewards=dict.fromkeys(self.reward_names), error=msg)

    # ---- replay contexts ----------------------------------------------------------------
    def contexts(self, example: Example, score: Score) -> Contexts:
        """Leave-one-out contexts. Default: append the sample's verifier blocks to P0."""
        order = self.block_order or self.reward_names
        blocks = {k: score.blocks.get(k) for k in order if score.blocks.get(k)}

        def join(keys: Sequence[str]) -> Messages:
            return append_to_last_user(example.messages, "\n\n".join(blocks[k] for k in keys))

        keys = list(blocks)
        m = last_user_index(example.messages)
        start = len(example.messages[m]["content"]) + 2  # after the blank line
        spans = joined_spans(m, start, [blocks[k] for k in keys], "\n\n")
        without = {k: join([j for j in keys if j != k]) for k in keys}
        none = [dict(m) for m in example.messages]
        return Contexts(join(keys), without, none, {k: [s] for k, s in zip(keys, spans)}, spans)

    # ---- teacher context (self-distillation) ---------------------------------------------
    def teacher_messages(self, example: Example) -> Messages | None:
        """The context a self-distillation teacher reads a response after (``method=opsd``):
        the sampling prompt, the example's reference as the assistant's earlier answer, then
        the last user message again. None when the example has no reference."""
        if not example.reference:
            return None
        last_user = next((m for m in reversed(example.messages) if m.get("role") == "user"), None)
        if last_user is None:
            raise ValueError(
                f"example {example.id}: the prompt has no user message to ask the teacher again"
            )
        answer = {"role": "assistant", "content": example.reference}
        return [*(dict(m) for m in example.messages), answer, dict(last_user)]

    # ---- diagnostics --------------------------------------------------------------------
    def segments(self, response: str) -> dict[str, list[tuple[int, int]]] | None:
        """Named parts of a response as character spans ``[start, end)`` (e.g. reasoning and
        answer): the step logs the share of the reallocated credit's energy on each
        (``train/replay/energy_share/<name>``). None (the default): the task declares none."""
        return None

    # ---- evaluation -----------------------------------------------------------------------
    def summarize(self, examples: Sequence[Example], scores: Sequence[Score]) -> dict[str, float]:
        """Aggregate metrics of scored responses (evaluation). Default: mean of each reward."""
        out: dict[str, float] = {}
        for name in self.reward_names:
            vals = [v for s in scores if (v := s.rewards.get(name)) is not None]
            if vals:
                out[f"reward/{name}"] = sum(vals) / len(vals)
        return out
