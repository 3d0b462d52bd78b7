"""An offline training set: IFEval-registry constraints composed onto plain writing requests.

Demos and tests train on prompts made from a seed: a built-in writing request (written for
this project) and 5–13 IFEval instructions whose arguments and sentence come from the
library's own ``build_description`` (seeded), so every constraint is exactly what its checker
verifies. Incompatible pairs are never combined (``conflict_table``, ``_words``; which and why:
docs/tasks/instructions.md, Data).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from mrtpo.tasks.instructions.checkers import Registry, seeded_random
from mrtpo.tasks.instructions.data import Constraint, Record, constraint_record

# Instructions left out of generated prompts, and why.
EXCLUDED = {
    "combination:repeat_prompt": "asks to echo the request; conflicts with almost everything",
    "combination:two_responses": "conflicts with almost every other instruction",
    "detectable_format:constrained_response": "conflicts with every other instruction",
    "detectable_format:json_format": "conflicts with all but two instructions",
}
# The section marker ("Section"/"SECTION") is case-sensitive: no all-lower/upper rule with it.
EXTRA_CONFLICTS = (
    ("change_case:english_lowercase", "detectable_format:multiple_sections"),
    ("change_case:english_capital", "detectable_format:multiple_sections"),
)
_WORD_ARGS = ("keywords", "keyword", "forbidden_words", "first_word")

BASE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a typical morning at a busy city bakery.",
    "Explain how a bicycle gear system works to someone who has never ridden one.",
    "Write a blog post about the pleasures of learning to cook at home.",
    "Give advice to a student who is about to start their first part-time job.",
    "Write a product description for a reusable water bottle made from bamboo.",
    "Describe the life cycle of a monarch butterfly.",
    "Write a letter to a neighbour inviting them to a community garden project.",
    "Explain why the sky changes colour at sunset.",
    "Write a review of an imaginary science-fiction film set on a floating city.",
    "Summarize the main arguments for and against working from home.",
    "Write a speech for the opening of a new public library.",
    "Describe a walk through a forest in late autumn.",
    "Explain the basic rules of chess to a beginner.",
    "Write a travel guide entry for a small fishing village.",
    "Write a diary entry from the point of view of a cat on a rainy day.",
    "Explain how vaccines help the immune system.",
    "Give tips for keeping houseplants healthy during winter.",
    "Write a short biography of a fictional inventor from the nineteenth century.",
    "Describe how to plan a budget for a family holiday.",
    "Write a newsletter article announcing a local charity fun run.",
    "Explain the difference between weather and climate.",
    "Write a story about two friends who build a raft.",
    "Describe the sounds and smells of a night market.",
    "Write a persuasive essay about why schools should teach music.",
    "Explain how a library organizes its books.",
    "Write an email to a colleague proposing a new weekly team meeting format.",
    "Describe the history of a made-up board game and how it is played.",
    "Write a poem about the first snowfall of the year.",
    "Explain how recycling plastic bottles works, step by step.",
    "Write a dialogue between a baker and a customer who wants a very unusual cake.",
    "Describe what a day in the life of a deep-sea researcher might look like.",
    "Give a beginner's guide to growing tomatoes on a balcony.",
    "Write a short mystery story set on an overnight train.",
    "Explain why sleep matters for memory.",
    "Write a welcome message for new members of a hiking club.",
    "Describe the design of an ideal playground for a small town.",
    "Write a fable about a tortoise who wants to fly.",
    "Explain how a rainbow forms.",
    "Write a cover letter for a job at a bookshop.",
)


def conflict_table(reg: Registry) -> dict[str, set[str]]:
    table = {k: set(v) for k, v in reg.conflicts.items()}
    for a, b in EXTRA_CONFLICTS:
        table.setdefault(a, {a}).add(b)
        table.setdefault(b, {b}).add(a)
    return table


def _words(kwargs: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    for key in _WORD_ARGS:
        value = kwargs.get(key)
        if isinstance(value, str):
            out.add(value.lower())
        elif isinstance(value, list | tuple):
            out.update(str(v).lower() for v in value)
    return out


def sample_constraint(
    reg: Registry, instruction_id: str, rng: random.Random, tries: int = 20
) -> Constraint | None:
    """Arguments drawn by the library, kept only if rebuilding from them draws nothing else at
    random (an "nth paragraph" beyond the count is drawn again), so they are what is checked."""
    cls = reg.instructions[instruction_id]
    for _ in range(tries):
        with seeded_random(rng.getrandbits(64)):
            first = cls(instruction_id)
            first.build_description()
            args = dict(first.get_instruction_args() or {})
        again = cls(instruction_id)
        with seeded_random(0):
            before = random.getstate()
            text = again.build_description(**args)
            drew = random.getstate() != before
        if not drew and dict(again.get_instruction_args() or {}) == args:
            return Constraint(instruction_id, args, text)
    return None


def generate_records(
    reg: Registry,
    n: int,
    seed: int = 0,
    min_constraints: int = 5,
    max_constraints: int = 13,
    base_prompts: Sequence[str] = BASE_PROMPTS,
) -> list[Record]:
    """``n`` prompts with 5–13 compatible constraints each; the same seed gives the same set."""
    if not 1 <= min_constraints <= max_constraints:
        raise ValueError(
            f"task.generator: need 1 <= min_constraints ({min_constraints}) <= "
            f"max_constraints ({max_constraints})"
        )
    pool = sorted(i for i in reg.instructions if i not in EXCLUDED)
    conflicts = conflict_table(reg)
    records = []
    for i in range(n):
        rng = random.Random(f"ifgen-{seed}-{i}")
        want = rng.randint(min_constraints, max_constraints)
        base = rng.choice(list(base_prompts))
        best: list[Constraint] = []
        for _ in range(50):  # random greedy maximal sets; keep the first that is big enough
            best = max(best, _compose(reg, pool, conflicts, want, rng), key=len)  # first if tied
            if len(best) >= want:
                break
        if len(best) < min_constraints:
            raise ValueError(
                f"task.generator: could not fit {min_constraints} compatible constraints; "
                "lower task.generator.min_constraints"
            )
        rng.shuffle(best)  # sentence order carries no information
        records.append(constraint_record(f"gen-{seed}-{i}", base, best, "ifeval", "generated"))
    return records


def _compose(
    reg: Registry,
    pool: Sequence[str],
    conflicts: dict[str, set[str]],
    want: int,
    rng: random.Random,
) -> list[Constraint]:
    order = list(pool)
    rng.shuffle(order)
    chosen: list[Constraint] = []
    words: set[str] = set()
    for iid in order:
        if len(chosen) == want:
            break
        if any(iid in conflicts.get(c.id, {c.id}) for c in chosen):  # the table is symmetric
            continue
        for _ in range(5):  # redraw arguments whose words clash with earlier constraints
            con = sample_constraint(reg, iid, rng)
            if con is not None and not (_words(dict(con.kwargs)) & words):
                chosen.append(con)
                words |= _words(dict(con.kwargs))
                break
    return chosen
