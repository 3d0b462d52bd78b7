"""A synthetic multi-constraint task: the CPU test bed and the toy-replication setting.

Each prompt asks for a short word sequence under K checked constraints, each decided by a
different part of the response (first word, last word, a word that must / must not appear, the
word count). Constraints are stated in the prompt, so ``P_\\k`` is the prompt without constraint
k. Generated from a seed: no data files. References exist for SFT; ``reference_success < 1``
breaks some on purpose, the headroom the toy's RL runs need (docs/replication.md). With
``model=toy`` every word is one token (``decisive_words``).

Off by default (prompts, references and rewards then unchanged): ``closing_mark`` turns one
constraint into ``mark`` (end with ``!``, ``?`` or ``.``: a reward decided by one or two tokens,
the toy's format reward; ``mark_success`` / ``mark_break``: how references break it);
``free_tokens`` (docs/replication_long.md) opens every response with ``<think> w1 ... wn
</think>`` (``FILLER`` words the checkers never read); without that part there is no answer and
every constraint scores 0, with the reason.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from mrtpo.tasks.base import Contexts, Example, Messages, Score, Task, joined_spans

# The toy tokenizer's vocabulary is built from this list in this order (core/models.py).
WORDS = [
    "apple", "river", "stone", "cloud", "music", "garden", "light", "forest", "ocean", "winter",
    "summer", "bright", "quiet", "happy", "green", "blue", "red", "yellow", "small", "large",
]  # fmt: skip

# Order in which reference corruption touches constraints: length first, then the middle.
_CORRUPT_ORDER = {"count": 0, "include": 1, "exclude": 2, "first": 3, "last": 4, "mark": 5}

#: Closing marks of the optional ``mark`` constraint; each is one token of the toy tokenizer.
MARKS = ("!", "?", ".")
MARK_BREAKS = ("none_or_other", "none")

BASE_PROMPT = "Write a short sequence of lowercase words separated by spaces."

#: Filler words of the optional free part (``free_tokens``): neither a task word nor a word of
#: the prompt, and each one token (after a space) of the toy tokenizer as it is (``model=toy``).
FILLER = (
    "and", "or", "to", "in", "on", "for", "is", "it",
    "this", "that", "at", "from", "fast", "slow", "warm", "cold",
)  # fmt: skip
#: The markers around the free part, and the prompt's sentence asking for it.
OPEN, CLOSE = "<think>", "</think>"
THINK_PROMPT = f"Write {OPEN} {CLOSE} first."
#: Reason given for every constraint of a response without an answer part.
NO_ANSWER = f"no answer part: the response must open with {OPEN} and close it with {CLOSE}"

# Which constraint types a prompt carries, for each supported K (slot order = reward order):
# the first K of this list (K = 1: include_1 alone).
_KINDS = ("first", "last", "include_1", "count", "exclude_1", "include_2", "exclude_2", "include_3")
LAYOUTS: dict[int, tuple[str, ...]] = {1: ("include_1",)} | {k: _KINDS[:k] for k in range(2, 9)}


@dataclass(frozen=True)
class Constraint:
    kind: str  # reward name: first, last, include_1, exclude_1, count, ...
    value: str  # a word, or a count as text

    def sentence(self) -> str:
        base = self.kind.split("_")[0]
        return {
            "first": f"Start with the word {self.value}.",
            "last": f"End with the word {self.value}.",
            "include": f"Include the word {self.value}.",
            "exclude": f"Do not use the word {self.value}.",
            "count": f"Use exactly {self.value} words.",
            "mark": f"Add the mark {self.value} after the words.",
        }[base]

    def check(self, words: list[str], text: str = "") -> tuple[bool, str]:
        """Whether ``words`` (the response's words) or, for ``mark``, ``text`` (the response)
        meet the constraint, and why not."""
        base = self.kind.split("_")[0]
        if base == "mark":  # the last visible character, nothing else
            end = text.rstrip()[-1:]
            ok, why = end == self.value, f"ends with {end or 'nothing'!r}, not {self.value!r}"
        elif base in ("first", "last"):
            got = (words[0] if base == "first" else words[-1]) if words else "missing"
            ok, why = bool(words) and got == self.value, f"{base} word is {got!r}"
        elif base in ("include", "exclude"):
            ok = (self.value in words) == (base == "include")
            why = f"{self.value!r} {'missing' if base == 'include' else 'used'}"
        else:
            ok, why = len(words) == int(self.value), f"{len(words)} words instead of {self.value}"
        return ok, "" if ok else why


def with_mark(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The layout with its last ``include`` constraint (or, with none, its last constraint)
    replaced by ``mark``, in the same slot: K stays K, and the word count (which tells the
    policy where to stop, hence where the last word goes) is kept where the layout has it."""
    slots = [j for j, k in enumerate(kinds) if k.startswith("include")] or [len(kinds) - 1]
    i = slots[-1]
    return (*kinds[:i], "mark", *kinds[i + 1 :])


def response_words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def render(constraints: Sequence[Constraint], think: bool = False) -> str:
    head = [BASE_PROMPT, THINK_PROMPT] if think else [BASE_PROMPT]
    return " ".join([*head, *(c.sentence() for c in constraints)])


def free_range(free_tokens) -> tuple[int, int] | None:
    """``task.free_tokens`` as (fewest, most) filler words; None when off."""
    if free_tokens is None:
        return None
    vals = [free_tokens] if isinstance(free_tokens, int) else list(free_tokens)
    ok = len(vals) in (1, 2) and all(isinstance(v, int) and not isinstance(v, bool) for v in vals)
    if not ok or min(vals) < 0 or vals[0] > vals[-1]:
        raise ValueError(
            f"task.free_tokens={free_tokens!r}: expected null (no free part), a count of "
            "filler words >= 0, or a range [fewest, most] of them"
        )
    return vals[0], vals[-1]


def split_free(response: str) -> tuple[str, str] | None:
    """``(free part, answer part)``: from the opening ``<think>`` (leading spaces aside)
    through the first ``</think>``, and everything after it. None when the response does not
    open with ``<think>`` or never closes it."""
    start = len(response) - len(response.lstrip())
    end = response.find(CLOSE, start + len(OPEN)) if response.startswith(OPEN, start) else -1
    if end < 0:
        return None
    cut = end + len(CLOSE)
    return response[:cut], response[cut:]


class SyntheticTask(Task):
    """``task=synthetic``: K word constraints per prompt, one binary reward each."""

    name = "synthetic"
    info_in_prompt = True  # the constraints are sentences of the prompt
    success_check = "success"  # every constraint met

    def __init__(
        self,
        num_constraints: int = 4,
        num_train: int = 2000,
        num_val: int = 64,
        seed: int = 0,
        min_words: int = 3,
        max_words: int = 7,
        system_prompt: str | None = None,
        reference_success: float = 1.0,
        closing_mark: bool = False,
        free_tokens: int | Sequence[int] | None = None,
        mark_success: float | None = None,
        mark_break: str = "none_or_other",
    ) -> None:
        if num_constraints not in LAYOUTS:
            raise ValueError(
                f"task.num_constraints={num_constraints} is not supported; use one of "
                f"{sorted(LAYOUTS)}"
            )
        self.kinds = LAYOUTS[num_constraints]
        self.closing_mark = bool(closing_mark)
        if self.closing_mark:
            self.kinds = with_mark(self.kinds)
        self.reward_names = tuple(self.kinds)
        self.num_train, self.num_val, self.seed = num_train, num_val, seed
        self.min_words, self.max_words = min_words, max_words
        self.system_prompt = system_prompt
        if not 0.0 < reference_success <= 1.0:
            raise ValueError(f"task.reference_success must be in (0, 1], got {reference_success}")
        self.free = free_range(free_tokens)
        if mark_success is not None and not self.closing_mark:
            raise ValueError("task.mark_success needs task.closing_mark=true (no mark)")
        if mark_success is not None and not 0.0 <= mark_success <= 1.0:
            raise ValueError(f"task.mark_success must be in [0, 1], got {mark_success}")
        # Each constraint of a reference breaks independently with probability
        # 1 - reference_success^(1/K): the share meeting all is the same for every K. With
        # mark_success, mark has its own rate and the others share reference_success.
        self.reference_success = float(reference_success)
        self.mark_noise = None if mark_success is None else 1.0 - float(mark_success)
        shared = max(len(self.kinds) - (mark_success is not None), 1)
        self.reference_noise = 1.0 - self.reference_success ** (1.0 / shared)
        # How a noisy reference breaks `mark`: no mark or one of the other two at random
        # ("none_or_other"), or no mark at all ("none": a policy then learns to leave the mark
        # out instead of learning to avoid the asked one, which needs reading the prompt).
        if mark_break not in MARK_BREAKS:
            raise ValueError(f"task.mark_break={mark_break!r}; use one of {list(MARK_BREAKS)}")
        self.mark_break = mark_break
        self._cache: dict[str, list[Example]] = {}

    # ---- data ---------------------------------------------------------------------------
    def examples(self, split: str) -> Sequence[Example]:
        sizes = {"train": (self.num_train, 0), "val": (self.num_val, 1), "test": (self.num_val, 2)}
        if split not in sizes:
            raise ValueError(f"synthetic task has splits {sorted(sizes)}, not {split!r}")
        if split not in self._cache:
            n, offset = sizes[split]
            rng = random.Random(f"{self.seed}-{offset}")
            noise = random.Random(f"{self.seed}-{offset}-noise")
            made = [self._make(f"{split}-{i}", rng, noise) for i in range(n)]
            if self.free is not None:  # references behind a free part of filler words
                free = random.Random(f"{self.seed}-{offset}-free")  # prompts stay as without
                for e in made:
                    words = [free.choice(FILLER) for _ in range(free.randint(*self.free))]
                    e.reference = " ".join([OPEN, *words, CLOSE, e.reference])
            self._cache[split] = made
        return self._cache[split]

    def _make(self, uid: str, rng: random.Random, noise: random.Random) -> Example:
        words = WORDS[:]
        rng.shuffle(words)
        needs = {k: words.pop() for k in self.kinds if k not in ("count", "mark")}
        n_required = sum(1 for k in needs if not k.startswith("exclude"))
        count = rng.randint(max(self.min_words, n_required), max(self.max_words, n_required))
        if "mark" in self.kinds:  # drawn only when on: the other prompts stay as they were
            needs["mark"] = rng.choice(MARKS)
        cons = [Constraint(k, str(count) if k == "count" else needs[k]) for k in self.kinds]
        order = list(range(len(cons)))
        rng.shuffle(order)  # sentences in random order: the policy must read them
        ref = self._reference(cons, count if "count" in self.kinds else None, rng, words)
        if self.reference_noise > 0:
            ref = self._corrupt(ref, cons, words, noise)
        msgs = self._messages([cons[i] for i in order])
        return Example(uid, msgs, {"constraints": cons, "order": order}, ref)

    def _messages(self, constraints: Sequence[Constraint]) -> Messages:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": render(constraints, self.free is not None)}]

    def _reference(self, cons, count, rng, spare) -> str:
        by = {c.kind: c.value for c in cons if c.kind != "mark"}
        middle = [v for k, v in by.items() if k.startswith("include")]
        banned = {v for k, v in by.items() if k.startswith("exclude")}
        fillers = [w for w in spare if w not in banned]
        ends = ("first" in by) + ("last" in by)
        n = count
        if n is None:
            n = max(len(middle) + ends, rng.randint(self.min_words, self.max_words))
        while len(middle) < n - ends:
            middle.append(rng.choice(fillers))
        rng.shuffle(middle)
        head = [by["first"]] if "first" in by else []
        tail = [by["last"]] if "last" in by else []
        marks = [c.value for c in cons if c.kind == "mark"]
        return " ".join(head + middle + tail) + (marks[0] if marks else "")

    def _corrupt(self, ref: str, cons, fillers, rng: random.Random) -> str:
        """Break each constraint of a reference with probability ``reference_noise``, each in
        its own part of the response, so that the violations stay independent."""
        mark = next((c.value for c in cons if c.kind == "mark"), None)
        if mark is not None:
            ref = ref[: -len(mark)]  # words first; the mark is put back (or broken) at the end
        words = ref.split()
        by = {c.kind: c.value for c in cons if c.kind != "mark"}
        lo, hi = int("first" in by), int("last" in by)  # words held by first / last
        taken = set(by.values())
        for kind in sorted(by, key=lambda k: _CORRUPT_ORDER[k.split("_")[0]]):
            if rng.random() >= self.reference_noise:
                continue
            base, value = kind.split("_")[0], by[kind]
            spots = [i for i in range(lo, len(words) - hi) if words[i] not in taken]  # fillers
            if base == "count":  # one word fewer, or one more
                if spots and rng.random() < 0.5:
                    words.pop(rng.choice(spots))
                else:
                    words.insert(rng.randint(lo, len(words) - hi), rng.choice(fillers))
            elif base == "include":
                words = [rng.choice(fillers) if w == value else w for w in words]
            elif base == "exclude":
                if spots:
                    words[rng.choice(spots)] = value
                else:
                    words.insert(len(words) - hi, value)
            elif base == "first" and words:
                words[0] = rng.choice(fillers)
            elif base == "last" and words:
                words[-1] = rng.choice(fillers)
        mark_noise = self.reference_noise if self.mark_noise is None else self.mark_noise
        if mark is not None and rng.random() < mark_noise:
            others = [] if self.mark_break == "none" else [m for m in MARKS if m != mark]
            mark = rng.choice(["", *others]) if others else ""  # none, or another
        return " ".join(words) + (mark or "")

    # ---- rewards ------------------------------------------------------------------------
    def answer_part(self, response: str) -> str | None:
        """What the checkers read: the whole response, or with a free part (``free_tokens``)
        what follows its ``</think>`` (None: the response has no answer part)."""
        if self.free is None:
            return response
        parts = split_free(response)
        return None if parts is None else parts[1]

    def score(self, example: Example, response: str) -> Score:
        answer = self.answer_part(response)
        words = response_words(answer or "")
        rewards: dict[str, float | None] = {}
        reasons: dict[str, str] = {}
        for c in example.data["constraints"]:
            ok, why = (False, NO_ANSWER) if answer is None else c.check(words, answer)
            rewards[c.kind] = float(ok)
            if why:
                reasons[c.kind] = why
        checks = {"success": all(v == 1.0 for v in rewards.values())}
        if self.mark_noise is not None:  # the constraints other than the few-token one
            checks["success_others"] = all(v == 1.0 for k, v in rewards.items() if k != "mark")
        if self.free is not None:
            checks["answer_part"] = answer is not None
        return Score(rewards=rewards, reasons=reasons, checks=checks)

    # ---- replay contexts: the information is in the prompt ------------------------------
    def contexts(self, example: Example, score: Score) -> Contexts:
        cons = example.data["constraints"]
        shown = [cons[i] for i in example.data["order"]]
        messages = [dict(m) for m in example.messages]
        head = len(render([], self.free is not None)) + 1  # where ``render`` puts the sentences
        spans = joined_spans(len(messages) - 1, head, [c.sentence() for c in shown], " ")
        without = {c.kind: self._messages([x for x in shown if x is not c]) for c in shown}
        by_kind = {c.kind: [span] for c, span in zip(shown, spans)}
        return Contexts(messages, without, self._messages([]), by_kind, spans)

    # ---- analysis: where each checker looks ----------------------------------------------
    def decisive_words(self, example: Example, response: str) -> dict[str, list[int]]:
        """For each constraint, the indices of the response words its check turns on, to see
        whether replay relevance lands where the verifier looks (docs/replication.md): that
        word (first/last), every occurrence (include/exclude), or ``[len(words)]``, the end of
        the response, for count and mark (``mrtpo.evaluate.analysis.relevance`` adds the mark's
        token). Indices count every word, free part included; only answer words are decisive."""
        answer = self.answer_part(response)
        if answer is None:
            return {c.kind: [] for c in example.data["constraints"]}
        skip = len(response_words(response[: len(response) - len(answer)]))
        words = response_words(answer)
        out: dict[str, list[int]] = {}
        for c in example.data["constraints"]:
            base = c.kind.split("_")[0]
            if base in ("first", "last"):
                out[c.kind] = ([0] if base == "first" else [len(words) - 1]) if words else []
            elif base in ("include", "exclude"):
                out[c.kind] = [i for i, w in enumerate(words) if w == c.value]
            else:  # count, mark: the end of the response
                out[c.kind] = [len(words)]
        return {k: [skip + i for i in v] for k, v in out.items()}

    def segments(self, response: str) -> dict[str, list[tuple[int, int]]]:
        """``free`` (the free part up to its closing tag), ``close`` (the ``</think>`` tag),
        ``answer`` (what the checkers read, its mark aside) and ``mark`` (the closing mark,
        with ``closing_mark`` on), as character spans; a response whose free part never closes
        is all ``free``."""
        out: dict[str, list[tuple[int, int]]] = {}
        start = 0
        if self.free is not None:
            parts = split_free(response)
            if parts is None:
                return {"free": [(0, len(response))]}
            start = len(parts[0])
            out["free"] = [(0, start - len(CLOSE))]
            out["close"] = [(start - len(CLOSE), start)]
        end = len(response.rstrip())
        if self.closing_mark and end > start and response[end - 1] in MARKS:
            out["mark"] = [(end - 1, end)]
            end -= 1
        out["answer"] = [(start, end)]
        return out

    def summarize(self, examples, scores) -> dict[str, float]:
        out = super().summarize(examples, scores)
        if scores:
            for key in ("success", "success_others", "answer_part"):
                if key == "success" or key in scores[0].checks:
                    out[key] = sum(bool(s.checks.get(key)) for s in scores) / len(scores)
        return out
