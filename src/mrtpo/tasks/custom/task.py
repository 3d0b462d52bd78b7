"""``task=custom``: your prompts and your reward functions, without writing a Task.

Prompts come from a data file, a saved HF dataset folder or a hub id (``task.data``); rewards
are functions named by import strings, called per response as ``fn(prompt, response, **row)``
or, with a ``completions`` parameter, TRL's way once per batch; a reward may have a block
function of the per-response signature (its verifier's text, appended as ``Task.contexts``
does). Each call has ``task.reward_timeout_s`` seconds. How to write each: docs/extending.md, 1.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mrtpo import live
from mrtpo.tasks.base import Example, Messages, Score, Task, reward_value, split_reward
from mrtpo.tasks.custom.callables import (
    label,
    launch_dir,
    on_import_path,
    resolve,
    short_name,
)
from mrtpo.tasks.custom.data import columns, detect_format, read_rows
from mrtpo.tasks.deadline import CheckTimeout, budget_seconds, call_with_budget

log = logging.getLogger(__name__)

# The prompt and the response are passed positionally: columns of these names (other than the
# prompt column itself) cannot also be keywords.
_RESERVED = ("prompt", "response")


@dataclass
class CustomDataConfig:
    """``task.data`` (see configs/task/custom.yaml)."""

    path: str | None = None  # the train split: a file, a dataset folder or a hub id
    format: str | None = None  # jsonl | json | parquet | csv | hf; None: from the extension
    split: str = "train"  # HF datasets: the split read for train
    name: str | None = None  # HF datasets: the configuration name
    prompt_column: str = "prompt"  # text, or chat messages [{role, content}, ...]
    id_column: str | None = None  # None: ids are "<split>-<row number>"
    reference_column: str | None = None  # reference responses, for stage=sft
    system_prompt: str | None = None  # prepended to prompts that have no system message
    splits: dict[str, str] = field(default_factory=dict)  # other splits: name -> file or HF split
    val_size: int = 0  # with no splits.val: hold out the last N train rows as val
    max_examples: int | None = None  # first N rows of every split (smoke runs)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> CustomDataConfig:
        raw = dict(raw or {})
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - valid)
        if unknown:
            raise ValueError(f"task.data: unknown key(s) {unknown}; valid keys: {sorted(valid)}")
        out = cls(**raw)
        if not out.path:
            raise ValueError(
                "task.data.path is required: a JSONL / JSON / parquet / CSV file, a saved HF "
                "dataset folder, or a hub dataset id (task=custom task.data.path=prompts.jsonl)"
            )
        out.path = str(out.path)
        out.splits = {str(k): str(v) for k, v in (out.splits or {}).items()}
        if out.val_size < 0:
            raise ValueError(f"task.data.val_size must be >= 0, got {out.val_size}")
        if out.val_size and "val" in out.splits:
            raise ValueError(
                "task.data.val_size and task.data.splits.val both define the val split; set one"
            )
        return out


@dataclass(frozen=True)
class _Fn:
    """One configured callable: what it is called in the config, and the function."""

    name: str  # the reward it belongs to
    fn: Callable
    label: str  # its dotted name, for messages
    batched: bool = False  # TRL's form: (prompts, completions, **kwargs) -> list, per batch


def takes_batch(fn: Callable) -> bool:
    """Whether ``fn`` has TRL's batched signature: a parameter named ``completions`` (TRL
    passes ``prompts=`` and ``completions=`` by name)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return False
    return "completions" in params


class CustomTask(Task):
    """Prompts from a data file, rewards (and optional blocks) from importable functions."""

    info_in_prompt = False  # information comes as per-response blocks

    def __init__(
        self,
        data: Mapping[str, Any],
        rewards: Sequence[str | Callable],
        reward_names: Sequence[str] | None = None,
        blocks: Mapping[str, str | Callable] | None = None,
        success: str | Callable | None = None,
        success_threshold: float = 1.0,
        reward_ranges: Mapping[str, Sequence[float]] | None = None,
        rewards_vary_per_prompt: bool = False,
        import_dirs: Sequence[str] = (),
        name: str = "custom",
        max_block_chars: int = 16384,
        reward_timeout_s: float | None = 60.0,
    ) -> None:
        self.name = name
        self.reward_timeout_s = budget_seconds(reward_timeout_s, "task.reward_timeout_s")
        if int(max_block_chars) < 1:
            raise ValueError(f"task.max_block_chars must be >= 1, got {max_block_chars}")
        self.max_block_chars = int(max_block_chars)
        self.cfg = CustomDataConfig.from_mapping(data)
        for d in import_dirs or ():  # so that 'mymod.r1' is found in the user's folder
            on_import_path(d, first=True)
        on_import_path(launch_dir(), first=False)  # and in the launch folder, after installed ones
        self._rewards = self._resolve_rewards(rewards, reward_names)
        self.reward_names = tuple(r.name for r in self._rewards)
        self._blocks = self._resolve_blocks(blocks or {})
        self.rewards_vary_per_prompt = bool(rewards_vary_per_prompt)
        self.reward_ranges = self._ranges(reward_ranges or {})
        self._success, self.success_threshold = self._resolve_success(success), success_threshold
        self.success_check = "success" if self._success is not None else None
        self._warned: set[str] = set()
        self._cache: dict[str, list[Example]] = {}
        # Read the train split now, so that a wrong path or column fails at construction.
        self.examples("train")

    # ---- configuration ------------------------------------------------------------------
    @staticmethod
    def _resolve_rewards(specs, names) -> list[_Fn]:
        if isinstance(specs, (str, bytes)) or callable(specs):
            specs = [specs]
        specs = list(specs or [])
        if not specs:
            raise ValueError(
                "task.rewards is empty: give a list of reward functions, e.g. "
                "task.rewards=[mymodule.reward_a,mymodule.reward_b]"
            )
        fns = [resolve(s, f"task.rewards[{i}]") for i, s in enumerate(specs)]
        if names is not None:
            names = [str(n) for n in names]
            if len(names) != len(fns):
                raise ValueError(
                    f"task.reward_names has {len(names)} name(s) for {len(fns)} reward "
                    f"function(s) in task.rewards; give one name per function"
                )
        else:
            names = [short_name(fn) for fn in fns]
            if None in names:
                i = names.index(None)
                raise ValueError(
                    f"task.rewards[{i}] ({label(fns[i])}) has no usable name; set "
                    "task.reward_names=[...] (one per reward)"
                )
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(
                f"reward names {dup} occur more than once (from the functions' names); set "
                "task.reward_names=[...] to name each reward"
            )
        bad = [n for n in names if not n or "/" in n]
        if bad:
            raise ValueError(f"task.reward_names: {bad} are not valid names (empty or with '/')")
        return [_Fn(n, f, label(f), takes_batch(f)) for n, f in zip(names, fns)]

    def _refuse_unknown_rewards(self, raw: Mapping, key: str) -> None:
        """``key`` (a mapping per reward) may only name this task's rewards."""
        unknown = sorted(set(raw) - set(self.reward_names))
        if unknown:
            raise ValueError(
                f"{key} has key(s) {unknown} that are not rewards of this task; its "
                f"rewards are {list(self.reward_names)}"
            )

    def _resolve_blocks(self, specs: Mapping) -> dict[str, _Fn]:
        self._refuse_unknown_rewards(specs, "task.blocks")
        fns = {str(k): resolve(v, f"task.blocks.{k}") for k, v in specs.items() if v is not None}
        for k, fn in fns.items():
            _refuse_batched(fn, f"task.blocks.{k}")
        return {k: _Fn(k, fn, label(fn)) for k, fn in fns.items()}

    def _ranges(self, raw: Mapping) -> dict[str, tuple[float, float]]:
        self._refuse_unknown_rewards(raw, "task.reward_ranges")
        out = {}
        for k, v in raw.items():
            lo, hi = (float(x) for x in v)
            if not lo < hi:
                raise ValueError(f"task.reward_ranges.{k}: need low < high, got {list(v)}")
            out[str(k)] = (lo, hi)
        return out

    def _resolve_success(self, spec) -> Callable | str | None:
        if spec is None or spec is False:
            return None
        if spec == "all" or (isinstance(spec, str) and spec in self.reward_names):
            return spec
        fn = resolve(spec, "task.success")
        _refuse_batched(fn, "task.success")
        return fn

    # ---- data -----------------------------------------------------------------------------
    def examples(self, split: str) -> Sequence[Example]:
        if split not in self._cache:
            self._cache[split] = self._load(split)
        return self._cache[split]

    def _load(self, split: str) -> list[Example]:
        c = self.cfg
        if split == "train" or (split == "val" and "val" not in c.splits and c.val_size > 0):
            rows = self._rows(c.path, c.split, "task.data.path", c.format)
            if c.val_size:
                if c.val_size >= len(rows):
                    raise ValueError(
                        f"task.data.val_size={c.val_size} leaves no train rows ({len(rows)} in "
                        f"{c.path})"
                    )
                rows = rows[-c.val_size :] if split == "val" else rows[: -c.val_size]
            source = c.path
        elif split in c.splits:
            rows, source = self._split_rows(split), c.splits[split]
        else:
            hint = f"task.data.splits.{split}=<file or HF split>"
            if split == "val":
                hint += " or hold out train rows with task.data.val_size=N"
            raise ValueError(
                f"task {self.name} has splits {['train', *sorted(c.splits)]}, not {split!r}; "
                f"add it as {hint}"
            )
        if c.max_examples is not None:
            rows = rows[: int(c.max_examples)]
        return self._to_examples(rows, split, source)

    def _split_rows(self, split: str) -> list[dict]:
        value, key = self.cfg.splits[split], f"task.data.splits.{split}"
        if live.is_rows(value):  # a dataset given to mrtpo.Trainer
            return live.rows(value, key)
        if Path(value).exists():
            return self._rows(value, None, key, fmt=None)  # its own file: format from its name
        if detect_format(self.cfg.path, self.cfg.format, "task.data.format") == "hf":
            return self._rows(self.cfg.path, value, key, self.cfg.format)  # same HF dataset
        raise FileNotFoundError(f"{key}={value}: no such file")

    def _rows(self, path: str, hf_split: str | None, key: str, fmt: str | None) -> list[dict]:
        if live.is_rows(path):  # a dataset given to mrtpo.Trainer, held in memory
            return live.rows(path, key)
        fmt = detect_format(path, fmt, "task.data.format", path_key=key)
        return read_rows(path, fmt, split=hf_split, name=self.cfg.name, key=key)

    def _to_examples(self, rows: list[dict], split: str, source: str) -> list[Example]:
        c = self.cfg
        cols = columns(rows)
        if not rows:
            raise ValueError(f"{source}: no rows (split {split!r})")
        for key in ("prompt_column", "id_column", "reference_column"):
            col = getattr(c, key)
            if col is not None and col not in cols:
                raise ValueError(
                    f"task.data.{key}={col!r} is not a column of {source}; its columns are {cols}"
                )
        clash = [k for k in _RESERVED if k in cols and k != c.prompt_column]
        if clash and f"clash-{source}" not in self._warned:
            self._warned.add(f"clash-{source}")
            log.warning(
                "%s: column(s) %s are not passed to the reward functions (the response is their "
                "second argument); rename the column to pass it",
                source,
                clash,
            )
        out, seen = [], set()
        for i, row in enumerate(rows):
            where = f"{source} row {i}"
            uid = str(row.get(c.id_column)) if c.id_column else f"{split}-{i}"
            if uid in seen:
                raise ValueError(
                    f"{where}: id {uid!r} (column {c.id_column!r}) occurs twice; ids must be "
                    "unique (or set task.data.id_column=null to number the rows)"
                )
            seen.add(uid)
            raw = row.get(c.prompt_column)
            kwargs = {k: v for k, v in row.items() if k != c.prompt_column and k not in _RESERVED}
            data, ref = {"prompt": raw, "row": kwargs}, self._reference(row, where)
            out.append(Example(uid, self._messages(raw, where), data, ref))
        return out

    def _messages(self, raw: Any, where: str) -> Messages:
        col = self.cfg.prompt_column
        if isinstance(raw, str):
            msgs = [{"role": "user", "content": raw}]
        elif isinstance(raw, list) and raw and all(isinstance(m, Mapping) for m in raw):
            for m in raw:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError(
                        f"{where}: column {col!r} holds chat messages, but {dict(m)!r} is not "
                        "a {'role': str, 'content': str} message"
                    )
            msgs = [{"role": m["role"], "content": m["content"]} for m in raw]
            if not any(m["role"] == "user" for m in msgs):
                raise ValueError(
                    f"{where}: the messages in column {col!r} have no user message (verifier "
                    "blocks are appended to the last one)"
                )
        else:
            raise ValueError(
                f"{where}: column {col!r} must hold text or a list of chat messages, got "
                f"{type(raw).__name__} {str(raw)[:80]!r}"
            )
        for i, m in enumerate(msgs):
            what = f"column {col!r}" + (f" (message {i})" if len(msgs) > 1 else "")
            _check_text(m["content"], where, what)
        if self.cfg.system_prompt and msgs[0]["role"] != "system":  # a user's own one wins
            _check_text(self.cfg.system_prompt, "task.data.system_prompt", "the text")
            msgs.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        return msgs

    def _reference(self, row: Mapping[str, Any], where: str) -> str | None:
        if not self.cfg.reference_column:
            return None
        raw, what = row.get(self.cfg.reference_column), f"column {self.cfg.reference_column!r}"
        if raw is None or isinstance(raw, str):
            _check_text(raw or "", where, what)
            return raw or None
        if isinstance(raw, list):  # TRL's conversational completions: [{"role": "assistant", ...}]
            said = [m.get("content") for m in raw if isinstance(m, Mapping)]
            if said and all(isinstance(s, str) for s in said):
                _check_text("".join(said), where, what)
                return "".join(said)
        raise ValueError(
            f"{where}: {what} must hold text (or assistant messages), got {type(raw).__name__}"
        )

    # ---- rewards ------------------------------------------------------------------------
    def score(self, example: Example, response: str) -> Score:
        return self.score_many([example], [response])[0]

    def score_many(self, examples: Sequence[Example], responses: Sequence[str]) -> list[Score]:
        """Each batched (TRL-style) reward is called once for the whole batch; the
        per-sample ones, the blocks and the success rule once per response."""
        batched = self._batched_values(examples, responses)
        return [
            self._score_one(e, r, {name: vals[i] for name, vals in batched.items()})
            for i, (e, r) in enumerate(zip(examples, responses, strict=True))
        ]

    def _score_one(
        self, example: Example, response: str, given: Mapping[str, tuple[Any, str | None]]
    ) -> Score:
        """One response's Score; ``given``: the batched rewards' (value, failure) for it."""
        rewards: dict[str, float | None] = {}
        blocks: dict[str, str | None] = dict.fromkeys(self.reward_names)
        reasons: dict[str, str] = {}
        extras: dict[str, Any] = {}
        errors: list[str] = []
        for r in self._rewards:
            who = f"reward {r.name} ({r.label})"
            value, failed = given.get(r.name) or self._call(r.fn, who, example, response)
            rewards[r.name] = None
            if failed:  # costs this reward of this sample only
                errors.append(f"{who} {failed}")
                continue
            value, measured, problem = split_reward(value)  # a value, or one with extras
            if measured is not None:
                extras[r.name] = measured  # cleaned with the score (mrtpo.core.scoring)
            if problem is None:  # every task's rule (tasks.base.reward_value)
                rewards[r.name], problem = reward_value(value)
                if problem and isinstance(value, (list, tuple)):
                    problem += (
                        "; a function that scores a batch takes (prompts, completions, **kwargs)"
                    )
            if problem:
                errors.append(f"{who} returned {problem}")
        for name, b in self._blocks.items():
            if rewards.get(name) is None:
                continue  # a reward that does not apply is never replayed
            text, failed = self._call(b.fn, f"block {name} ({b.label})", example, response)
            if failed:
                self._warn_once(b.label, failed)
                reasons[f"block/{name}"] = f"{b.label} {failed}"[:200]
                continue
            if text is not None and not isinstance(text, str):
                self._warn_once(b.label, f"returned a {type(text).__name__}, not str or None")
                continue
            blocks[name] = text or None
        checks: dict[str, Any] = {}
        if self._success is not None:
            checks["success"] = self._succeeded(example, response, rewards)
        return Score(rewards, blocks, reasons, checks, "; ".join(errors) or None, extras)

    def _batched_values(
        self, examples: Sequence[Example], responses: Sequence[str]
    ) -> dict[str, list[tuple[Any, str | None]]]:
        """Reward name -> (value, failure) per response, for the TRL-style rewards: one call
        ``fn(prompts=[...], completions=[...], **columns)`` each. A call that raises, or
        returns anything but one value per completion, costs that reward of the batch."""
        fns = [r for r in self._rewards if r.batched]
        if not fns or not examples:
            return {}
        n = len(examples)
        prompts = [e.data["prompt"] for e in examples]
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(e.data["prompt"], list) else t
            for e, t in zip(examples, responses, strict=True)
        ]
        rows = [e.data["row"] for e in examples]
        names = dict.fromkeys(k for row in rows for k in row if k not in ("prompts", "completions"))
        cols = {k: [row.get(k) for row in rows] for k in names}
        where = f"a batch of {n} (first example {examples[0].id})"
        out = {}
        for r in fns:
            values, failed = self._guarded(
                r.fn, (), {"prompts": list(prompts), "completions": list(completions), **cols},
                f"reward {r.name} ({r.label})", where,
            )  # fmt: skip
            items, failed = ([], failed) if failed else _batch_values(values, n)
            out[r.name] = [(None, failed)] * n if failed else [(v, None) for v in items]
        return out

    def _call(
        self, fn: Callable, who: str, example: Example, response: str
    ) -> tuple[Any, str | None]:
        """``fn(prompt, response, **row)`` and None, or None and why it failed."""
        args = (example.data["prompt"], response)
        return self._guarded(fn, args, example.data["row"], who, f"example {example.id}")

    def _guarded(
        self, fn: Callable, args: tuple, kwargs: Mapping[str, Any], who: str, where: str
    ) -> tuple[Any, str | None]:
        """``fn(*args, **kwargs)`` and None, or None and why it failed. Running past
        ``task.reward_timeout_s`` (logged once per function) or a ``SystemExit`` fails that call
        only; a ``KeyboardInterrupt`` stops the run, the function named in log and exception."""
        budget = self.reward_timeout_s
        try:
            call = functools.partial(fn, *args, **kwargs)
            return call_with_budget(call, seconds=budget, what=who), None
        except KeyboardInterrupt as exc:
            msg = f"KeyboardInterrupt while {who} scored {where}: the run stops"
            log.error("%s (Ctrl-C, or the function raised KeyboardInterrupt)", msg)
            exc.add_note(msg)
            exc.mrtpo_logged = True  # type: ignore[attr-defined]
            raise
        except SystemExit as exc:
            return None, (
                f"raised SystemExit({exc.code!r}): a reward function must return a value "
                "(or None), not exit; the run goes on and counts a scoring error"
            )
        except CheckTimeout:
            why = f"ran past its time budget (task.reward_timeout_s={budget:g} s)"
            if f"timeout {who}" not in self._warned:
                self._warned.add(f"timeout {who}")
                log.warning(
                    "%s %s on %s: that value is None, and each such call costs up to %g s "
                    "(further timeouts of it are not logged)",
                    who, why, where, budget,
                )  # fmt: skip
            return None, why
        except Exception as exc:
            return None, f"raised {type(exc).__name__}: {exc}"

    def _succeeded(self, example: Example, response: str, rewards) -> bool | None:
        rule, t = self._success, self.success_threshold
        if rule == "all":
            vals = [v for v in rewards.values() if v is not None]
            return all(v >= t for v in vals) if vals else None
        if isinstance(rule, str):
            v = rewards.get(rule)
            return None if v is None else v >= t
        out, failed = self._call(rule, f"task.success ({label(rule)})", example, response)
        if failed:
            self._warn_once(label(rule), failed)
            return None
        return None if out is None else bool(out)

    def _warn_once(self, who: str, what: str) -> None:
        if who not in self._warned:
            self._warned.add(who)
            log.warning("%s failed (%s); further failures of it are not logged", who, what)

    def summarize(self, examples, scores) -> dict[str, float]:
        out = super().summarize(examples, scores)
        succ = [bool(s.checks["success"]) for s in scores if s.checks.get("success") is not None]
        if succ:
            out["success"] = sum(succ) / len(succ)
        return out


def _refuse_batched(fn: Callable, key: str) -> None:
    if takes_batch(fn):
        raise ValueError(
            f"{key} ({label(fn)}) takes 'completions' (TRL's batched form); only reward "
            "functions may be batched: write it as (prompt, response, **row), called per response"
        )


def _batch_values(values: Any, n: int) -> tuple[list[Any], str | None]:
    """A batched reward's return value as one value per completion, or what is wrong with it.
    A 0-d tensor or array is one value (refused, not copied to every completion); what cannot
    be listed is refused with its type. Never raises: a bad return costs only that reward."""
    want = f"not a list of {n} values (one per completion, None where the reward does not apply)"
    if getattr(values, "ndim", None) == 0 or getattr(values, "shape", None) == ():
        return [], f"returned a 0-d {type(values).__name__} (one value), {want}"
    if isinstance(values, (str, bytes, bytearray, Mapping)) or not hasattr(values, "__len__"):
        return [], f"returned a {type(values).__name__}, {want}"
    try:
        items = list(values)
    except Exception as exc:
        return [], f"returned a {type(values).__name__} that cannot be listed ({exc}), {want}"
    if len(items) != n:
        return [], f"returned {len(items)} values for {n} completions (one per completion)"
    return items, None


def _check_text(text: str, where: str, what: str) -> None:
    """Refuse text that cannot be encoded (a lone surrogate such as ``"\\ud800"`` from a JSON
    escape): no tokenizer takes it, and it would fail only after the model has loaded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where}: {what} holds U+{ord(text[exc.start]):04X} at character {exc.start}, a "
            "lone surrogate that is not text (no tokenizer can encode it); fix or drop that row"
        ) from None
