"""Prompt token counts kept between jobs: the data phase's length filter tokenizes each
prompt once per tokenizer, not once per job (a text-to-SQL job spent ~55 s on it, again in
every job of a sweep).

Counts are keyed by the prompt's messages, one file per tokenizer identity (vocabulary, rules,
chat template) under ``<paths.cache_dir>/prompt_lengths/``, never beside the user's data. A
damaged or unwritable file is one warning and the counts are redone. A file only grows (delete
the folder to reclaim it); jobs writing it at once may lose each other's new entries (counted
again next time): no count is ever wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mrtpo.safe_files import UnsafePath, no_follow, write_atomic

log = logging.getLogger(__name__)

VERSION = 1
FOLDER = "prompt_lengths"


def tokenizer_key(tokenizer: Any) -> str:
    """What the counts depend on besides the prompt: the tokenizer's vocabulary and rules,
    and the chat template that renders the prompt."""
    h = hashlib.sha256(f"v{VERSION}:{type(tokenizer).__name__}".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        rules = backend.to_str() if backend is not None else None
    except Exception:  # a backend that cannot serialize itself: its vocabulary below
        rules = None
    if rules is None:
        rules = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    h.update(rules.encode("utf-8"))
    h.update(str(getattr(tokenizer, "chat_template", None)).encode("utf-8"))
    special = getattr(tokenizer, "special_tokens_map", {}) or {}
    h.update(json.dumps(special, sort_keys=True, default=str).encode("utf-8"))
    h.update(json.dumps(_options(tokenizer), sort_keys=True).encode("utf-8"))
    return h.hexdigest()[:32]


# init_kwargs that say where and how the files were read, not how text is split
_HOW_LOADED = frozenset(
    {"name_or_path", "is_local", "local_files_only", "revision", "subfolder", "token",
     "use_auth_token", "trust_remote_code", "force_download", "proxies", "user_agent"}
)  # fmt: skip


def _options(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's init options (``do_lower_case``, ...), which a slow tokenizer's
    vocabulary does not show: those JSON can write, less file and folder names (the same
    tokenizer copied elsewhere keeps its key)."""
    out = {}
    for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items():
        if k in _HOW_LOADED or k.startswith("_") or k.endswith(("_file", "_dir", "_path")):
            continue
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


def prompt_key(messages: Any) -> str:
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _read(path: Path) -> dict[str, int]:
    try:  # never through a link, and a FIFO is refused instead of waited on for ever
        with open(path, encoding="utf-8", opener=no_follow) as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # UnsafePath is a ValueError
        log.warning("data: prompt-length cache %s unreadable (%s); counting again", path, exc)
        return {}
    counts = data.get("lengths") if isinstance(data, dict) else None
    if counts is None or data.get("version") != VERSION or not isinstance(counts, dict):
        return {}
    return {k: v for k, v in counts.items() if isinstance(v, int) and v >= 0}


def _write(path: Path, counts: dict[str, int]) -> None:
    """Atomically (another job of a sweep may read or write it at the same time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_read(path), **counts}  # what another job added meanwhile stays
        write_atomic(path, json.dumps({"version": VERSION, "lengths": merged}))
    except (OSError, UnsafePath) as exc:  # UnsafePath: a link or FIFO there, left alone
        log.warning("data: prompt-length cache %s not written (%s)", path, exc)


def cached_lengths(
    messages: Sequence[Any],
    count: Callable[[list[Any]], list[int]],
    tokenizer: Any,
    cache_dir: str | Path | None,
    what: str = "prompts",
    chunk: int = 1024,
) -> tuple[list[int], int]:
    """Token counts of ``messages`` and how many ``count`` worked out here; the rest come from
    the cache in ``cache_dir`` (None: none). Progress is logged per ``chunk``."""
    keys = [prompt_key(m) for m in messages]
    path = Path(cache_dir) / FOLDER / f"{tokenizer_key(tokenizer)}.json" if cache_dir else None
    known = _read(path) if path is not None else {}
    todo = [i for i, k in enumerate(keys) if k not in known]
    if path is not None and len(todo) < len(keys):
        log.info("data: %d of %d %s' token counts from the cache %s",
                 len(keys) - len(todo), len(keys), what, path)  # fmt: skip
    new: dict[str, int] = {}
    for s in range(0, len(todo), chunk):
        part = todo[s : s + chunk]
        for i, n in zip(part, count([messages[i] for i in part]), strict=True):
            new[keys[i]] = int(n)
        if len(todo) > chunk:
            log.info("data: counting %s' tokens: %d/%d", what, s + len(part), len(todo))
    if path is not None and new:
        _write(path, new)
    lengths = {**known, **new}
    return [lengths[k] for k in keys], len(todo)
