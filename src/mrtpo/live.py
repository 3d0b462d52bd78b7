"""Python objects handed to a job in memory (``mrtpo.Trainer``), never through the config.

The config names each by a token, so it and its records stay plain text: a function by the
import string ``mrtpo.live.<token>``, a dataset by the path ``mrtpo-live:<token>``. A loaded
model goes through ``session``: ``pipeline.build`` takes it instead of loading
``model.name_or_path`` and leaves the trained policy there. Objects live only in this process
(``mrtpo.Trainer`` runs one). This module imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

PREFIX = "mrtpo-live:"  # a dataset's task.data.path
_OBJECTS: dict[str, Any] = {}


def put(obj: Any, kind: str) -> str:
    """Keep ``obj`` under a new token ``<kind>_<hex>`` and return the token."""
    token = f"{kind}_{secrets.token_hex(4)}"
    _OBJECTS[token] = obj
    return token


def drop(tokens: list[str]) -> None:
    for t in tokens:
        _OBJECTS.pop(t, None)


def __getattr__(name: str) -> Any:  # ``mrtpo.live.<token>``, as an import string resolves it
    if name in _OBJECTS:
        return _OBJECTS[name]
    if re.fullmatch(r"(reward|block)_[0-9a-f]{8}", name):  # a token of a run that has ended
        raise ImportError(
            f"mrtpo.live.{name} was a function given to mrtpo.Trainer, which exists only in "
            "the process that trained with it: name the function by its import string "
            "(task.rewards=[mymodule.my_reward], docs/extending.md)"
        )
    raise AttributeError(f"module 'mrtpo.live' has no attribute {name!r}")


def is_rows(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def rows(path: str, key: str) -> list[dict[str, Any]]:
    """The rows kept under ``path`` (``mrtpo-live:<token>``), each a fresh dict."""
    held = _OBJECTS.get(path[len(PREFIX) :])
    if held is None:
        raise ValueError(
            f"{key}={path} was a dataset given to mrtpo.Trainer, which exists only in the "
            "process that trained with it: give a file of prompts (task.data.path=prompts.jsonl)"
        )
    return [dict(r) for r in held]


@dataclass
class Session:
    """One run's model objects: what it was given and what it trained."""

    model: Any = None  # a loaded model to train instead of loading model.name_or_path
    tokenizer: Any = None
    prepare: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None  # (model, tok, cfg)
    callbacks: list[Any] = field(default_factory=list)  # Lightning callbacks for the run
    handed: bool = False
    policy: Any = None  # the policy and tokenizer the run built (and trained, in place)
    built_tokenizer: Any = None


_SESSION: Session | None = None
# One session per process at a time: the job's code reads the session from this module, so a
# second run at once (another thread) would swap the first one's model and tokenizer.
_ONE_AT_A_TIME = threading.Lock()


@contextlib.contextmanager
def session(s: Session) -> Iterator[Session]:
    """``s`` is the session for the run inside; a second one meanwhile is refused."""
    global _SESSION
    if not _ONE_AT_A_TIME.acquire(blocking=False):
        raise RuntimeError(
            "another mrtpo.Trainer.train() is running in this process; run one at a time "
            "(or each in its own process)"
        )
    try:
        _SESSION = s
        yield s
    finally:
        _SESSION = None
        _ONE_AT_A_TIME.release()


def current() -> Session | None:
    return _SESSION


def load_model(cfg: Any, load: Callable[[Any], tuple[Any, Any]]) -> tuple[Any, Any]:
    """``load(cfg)``, or the session's given model (prepared) for its first build (a warm
    start's); the session keeps the last build's policy."""
    s = _SESSION
    if s is None:
        return load(cfg)
    if s.model is not None and not s.handed:
        s.handed = True
        policy, tokenizer = s.model, s.tokenizer
        if s.prepare is not None:
            policy, tokenizer = s.prepare(policy, tokenizer, cfg)
    else:
        policy, tokenizer = load(cfg)
    s.policy, s.built_tokenizer = policy, tokenizer
    return policy, tokenizer


def callbacks() -> list[Any]:
    """The Lightning callbacks given to this session's run (none outside a session)."""
    return list(_SESSION.callbacks) if _SESSION is not None else []
