"""Scoring a batch with fault isolation: one bad response costs only its own rewards
(docs/reliability.md). An undeclared reward name is a task bug and stops the run at the first
step; ``KeyboardInterrupt`` stops it too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from mrtpo.tasks.base import Example, Score, Task, clean_extras, reward_value

log = logging.getLogger(__name__)


class UndeclaredReward(KeyError):
    pass


def clean_score(
    score: object,
    names: Sequence[str],
    task_name: str = "task",
    max_block_chars: int | None = None,
) -> Score:
    """A ``Score`` whose rewards are floats (finite or +-inf) or ``None``, one per name, and
    whose blocks are at most ``max_block_chars`` long (None: any length)."""
    if not isinstance(score, Score):
        return Score(
            rewards=dict.fromkeys(names),
            error=f"score() returned {type(score).__name__}, not a Score",
        )
    if not isinstance(score.rewards, dict):
        score.error = _join(score.error, f"Score.rewards is {type(score.rewards).__name__}")
        score.rewards = dict.fromkeys(names)
        return score
    extra = sorted(set(score.rewards) - set(names))
    if extra:
        raise UndeclaredReward(
            f"task {task_name} returned reward(s) {extra} that it does not declare; its "
            f"reward_names are {list(names)} (a typo in the task's reward function?)"
        )
    problems = []
    for k in names:
        if k not in score.rewards:
            problems.append(f"reward {k!r} missing")
            score.rewards[k] = None
            continue
        f, problem = reward_value(score.rewards[k])
        if problem:
            problems.append(f"reward {k!r} is {problem}")
        score.rewards[k] = f
    if problems:
        score.error = _join(score.error, "; ".join(problems))
    if max_block_chars is not None and isinstance(score.blocks, dict):
        _cap_blocks(score, max_block_chars, task_name)
    _clean_score_extras(score, names, task_name)
    return score


_EXTRA_WARNED: set[tuple[str, str]] = set()  # (task, what) of extras left out, logged once


def _clean_score_extras(score: Score, names: Sequence[str], task_name: str) -> None:
    """``score.extras`` as reward name -> {metric: finite float}. An extra that cannot be
    logged is left out with a warning (once per task and problem); the rewards stand."""
    raw = getattr(score, "extras", None) or {}
    problems: list[str] = []
    cleaned: dict[str, dict[str, float]] = {}
    if not isinstance(raw, dict):
        problems.append(f"Score.extras is a {type(raw).__name__}, not reward name -> mapping")
        raw = {}
    for reward, extras in raw.items():
        if reward not in names:
            problems.append(f"extras of {reward!r}, which is not one of its rewards {list(names)}")
            continue
        values, bad = clean_extras(extras)
        problems += [f"reward {reward!r}: {p}" for p in bad]
        if values:
            cleaned[reward] = values
    score.extras = cleaned
    for p in problems:
        if (task_name, p) not in _EXTRA_WARNED:
            _EXTRA_WARNED.add((task_name, p))
            log.warning(
                "task %s: left out of the logged extras: %s (not logged again)", task_name, p
            )


_CAPPED: set[tuple[str, str]] = set()  # (task, reward) whose cut block was logged


def _cap_blocks(score: Score, limit: int, task_name: str) -> None:
    for k, text in score.blocks.items():
        if not isinstance(text, str) or len(text) <= limit:
            continue
        note = f"\n[block cut to {limit} of its {len(text)} characters (task.max_block_chars)]"
        score.blocks[k] = text[: max(limit - len(note), 0)] + note
        if (task_name, k) not in _CAPPED:
            _CAPPED.add((task_name, k))
            log.warning(
                f"task {task_name}: the verifier block of reward {k!r} has {len(text)} characters; "
                f"cut to task.max_block_chars={limit} (the block's text says so); further cuts of "
                "it are not logged"
            )


def _join(a: str | None, b: str) -> str:
    return f"{a}; {b}" if a else b


def score_batch(
    task: Task, examples: Sequence[Example], texts: Sequence[str], faults
) -> list[Score]:
    """``task.score_many`` with fault isolation, then ``clean_score`` on each result."""
    try:
        scores = task.score_many(examples, texts)
        scores = list(scores) if scores is not None else []
        if len(scores) != len(texts):
            raise RuntimeError(f"returned {len(scores)} scores for {len(texts)} responses")
    except KeyboardInterrupt as exc:
        if not getattr(exc, "mrtpo_logged", False):
            log.error(
                "KeyboardInterrupt while task %s scored a batch: the run stops (Ctrl-C, or "
                "the task's scoring code raised it)",
                task.name,
            )
        raise
    except (Exception, SystemExit) as exc:
        faults.count("score_many_fallbacks")
        log.warning(
            f"task {task.name}: score_many failed ({type(exc).__name__}: {exc}); scoring the "
            f"{len(texts)} responses one at a time"
        )
        scores = [task.safe_score(e, t) for e, t in zip(examples, texts, strict=True)]
    cap = getattr(task, "max_block_chars", None)
    return [clean_score(s, task.reward_names, task.name, cap) for s in scores]
