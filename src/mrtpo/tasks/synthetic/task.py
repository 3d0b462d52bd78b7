"""A synthetic multi-constraint task: the CPU test bed and the toy-replication setting.

Each prompt asks for a short sequence of words under K programmatically checked
constraints, each decided by a different part of the response: the first word, the last
word, a word that must appear, a word that must not, the word count. Constraints are stated
in the prompt, so (as for instruction following) ``P_\\k`` is the prompt rebuilt without
constraint k. Generated from a seed: no data files. Reference responses exist for SFT.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from mrtpo.tasks.base import Contexts, Example, Messages, Score, Task

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "music",
    "garden",
    "light",
    "forest",
    "ocean",
    "winter",
    "summer",
    "bright",
    "quiet",
    "happy",
    "green",
    "blue",
    "red",
    "yellow",
    "small",
    "large",
]

BASE_PROMPT = "Write a short sequence of lowercase words separated by spaces."

# Which constraint types a prompt carries, for each supported K (slot order = reward order).
LAYOUTS: dict[int, tuple[str, ...]] = {
    1: ("include_1",),
    2: ("first", "last"),
    3: ("first", "last", "include_1"),
    4: ("first", "last", "include_1", "count"),
    5: ("first", "last", "include_1", "count", "exclude_1"),
    6: ("first", "last", "include_1", "count", "exclude_1", "include_2"),
    7: ("first", "last", "include_1", "count", "exclude_1", "include_2", "exclude_2"),
    8: ("first", "last", "include_1", "count", "exclude_1", "include_2", "exclude_2", "include_3"),
}


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
        }[base]

    def check(self, words: list[str]) -> tuple[bool, str]:
        base = self.kind.split("_")[0]
        if base == "first":
            ok = bool(words) and words[0] == self.value
            return ok, "" if ok else f"first word is {words[0] if words else 'missing'!r}"
        if base == "last":
            ok = bool(words) and words[-1] == self.value
            return ok, "" if ok else f"last word is {words[-1] if words else 'missing'!r}"
        if base == "include":
            ok = self.value in words
            return ok, "" if ok else f"{self.value!r} missing"
        if base == "exclude":
            ok = self.value not in words
            return ok, "" if ok else f"{self.value!r} used"
        ok = len(words) == int(self.value)
        return ok, "" if ok else f"{len(words)} words instead of {self.value}"


def response_words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def render(constraints: Sequence[Constraint]) -> str:
    return " ".join([BASE_PROMPT, *(c.sentence() for c in constraints)])


class SyntheticTask(Task):
    """``task=synthetic``: K word constraints per prompt, one binary reward each."""

    name = "synthetic"

    def __init__(
        self,
        num_constraints: int = 4,
        num_train: int = 2000,
        num_val: int = 64,
        seed: int = 0,
        min_words: int = 3,
        max_words: int = 7,
        system_prompt: str | None = None,
    ) -> None:
        if num_constraints not in LAYOUTS:
            raise ValueError(
                f"task.num_constraints={num_constraints} is not supported; use one of "
                f"{sorted(LAYOUTS)}"
            )
        self.kinds = LAYOUTS[num_constraints]
        self.reward_names = tuple(self.kinds)
        self.num_train, self.num_val, self.seed = num_train, num_val, seed
        self.min_words, self.max_words = min_words, max_words
        self.system_prompt = system_prompt
        self._cache: dict[str, list[Example]] = {}

    # ---- data ---------------------------------------------------------------------------
    def examples(self, split: str) -> Sequence[Example]:
        sizes = {"train": (self.num_train, 0), "val": (self.num_val, 1), "test": (self.num_val, 2)}
        if split not in sizes:
            raise ValueError(f"synthetic task has splits {sorted(sizes)}, not {split!r}")
        if split not in self._cache:
            n, offset = sizes[split]
            rng = random.Random(f"{self.seed}-{offset}")
            self._cache[split] = [self._make(f"{split}-{i}", rng) for i in range(n)]
        return self._cache[split]

    def _make(self, uid: str, rng: random.Random) -> Example:
        words = WORDS[:]
        rng.shuffle(words)
        needs = {k: words.pop() for k in self.kinds if k.split("_")[0] != "count"}
        n_required = sum(1 for k in needs if not k.startswith("exclude"))
        count = rng.randint(max(self.min_words, n_required), max(self.max_words, n_required))
        cons = [Constraint(k, str(count) if k == "count" else needs[k]) for k in self.kinds]
        order = list(range(len(cons)))
        rng.shuffle(order)  # sentences in random order: the policy must read them
        ref = self._reference(cons, count if "count" in self.kinds else None, rng, words)
        data = {"constraints": cons, "order": order}
        return Example(
            id=uid, messages=self._messages([cons[i] for i in order]), data=data, reference=ref
        )

    def _messages(self, constraints: Sequence[Constraint]) -> Messages:
        msgs: Messages = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": render(constraints)})
        return msgs

    def _reference(self, cons, count, rng, spare) -> str:
        by = {c.kind: c.value for c in cons}
        middle = [v for k, v in by.items() if k.startswith("include")]
        banned = {v for k, v in by.items() if k.startswith("exclude")}
        fillers = [w for w in spare if w not in banned]
        n_fixed = len(middle) + ("first" in by) + ("last" in by)
        n = (
            count
            if count is not None
            else max(n_fixed, rng.randint(self.min_words, self.max_words))
        )
        while len(middle) < n - ("first" in by) - ("last" in by):
            middle.append(rng.choice(fillers))
        rng.shuffle(middle)
        return " ".join(
            ([by["first"]] if "first" in by else [])
            + middle
            + ([by["last"]] if "last" in by else [])
        )

    # ---- rewards ------------------------------------------------------------------------
    def score(self, example: Example, response: str) -> Score:
        words = response_words(response)
        rewards: dict[str, float | None] = {}
        reasons: dict[str, str] = {}
        for c in example.data["constraints"]:
            ok, why = c.check(words)
            rewards[c.kind] = float(ok)
            if why:
                reasons[c.kind] = why
        return Score(
            rewards=rewards,
            reasons=reasons,
            checks={"success": all(v == 1.0 for v in rewards.values())},
        )

    # ---- replay contexts: the information is in the prompt ------------------------------
    def contexts(self, example: Example, score: Score) -> Contexts:
        cons = example.data["constraints"]
        shown = [cons[i] for i in example.data["order"]]
        return Contexts(
            all=[dict(m) for m in example.messages],
            without={c.kind: self._messages([x for x in shown if x is not c]) for c in shown},
            none=self._messages([]),
        )

    def summarize(self, examples, scores) -> dict[str, float]:
        out = super().summarize(examples, scores)
        if scores:
            out["success"] = sum(bool(s.checks.get("success")) for s in scores) / len(scores)
        return out
