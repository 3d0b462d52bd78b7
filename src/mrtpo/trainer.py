"""``mrtpo.Trainer`` and ``mrtpo.Config``: a TRL ``GRPOTrainer`` script, run by MRTPO
(docs/extending.md section 5, README's example).

``train()`` runs ``python src/train.py task=custom ...``'s job through ``mrtpo.api.train``
(``Config``'s fields name their config keys); rewards, dataset and a loaded model reach it in
memory (``mrtpo.live``), the config names them by tokens only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import islice
from pathlib import Path
from typing import Any

from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate

from mrtpo import api, live
from mrtpo.api import _quoted, as_overrides
from mrtpo.run.checks import validate
from mrtpo.run.config import compose
from mrtpo.run.config_keys import check_keys

__all__ = ["Config", "Trainer"]

log = logging.getLogger(__name__)


def _key(key: str, help: str, default: Any = None) -> Any:
    return field(default=default, metadata={"key": key, "help": help})


@dataclass
class Config:
    """The knobs of a TRL ``GRPOConfig`` that MRTPO shares, under TRL's names and meanings;
    None keeps the config's default. Each field sets the one config key in its metadata
    (``Config.mapping()``); ``overrides`` takes any other Hydra override."""

    method: str = _key("method", "mrtpo | gdpo | grpo | mrtpo_saw | ... (configs/method/)", "mrtpo")
    output_dir: str | None = _key("paths.log_dir", "runs land in <output_dir>/train/runs/<run>")
    learning_rate: float | None = _key("optim.lr", "AdamW's learning rate")
    num_generations: int | None = _key("rl.group_size", "completions per prompt (G)")
    per_device_train_batch_size: int | None = _key(
        "rl.prompts_per_step",
        "completions per step (TRL's meaning); prompts per step = this / the group size "
        "(num_generations, or rl.group_size as overrides or an experiment set it)",
    )
    max_completion_length: int | None = _key("rollout.sampling.max_new_tokens", "per completion")
    max_prompt_length: int | None = _key("data.max_prompt_tokens", "longer prompts are dropped")
    temperature: float | None = _key("rollout.sampling.temperature", "sampling temperature")
    beta: float | None = _key("rl.kl_coef", "KL coefficient to the initial policy (TRL's beta)")
    epsilon: float | None = _key("rl.clip_low", "lower clip of the ratio")
    epsilon_high: float | None = _key("rl.clip_high", "upper clip of the ratio")
    num_iterations: int | None = _key("rl.ppo_epochs", "updates per generated batch")
    max_grad_norm: float | None = _key("rl.max_grad_norm", "gradient clipping (0: none)")
    warmup_steps: int | None = _key("optim.warmup_steps", "linear learning-rate warm-up")
    weight_decay: float | None = _key("optim.weight_decay", "AdamW's weight decay")
    max_steps: int | None = _key("trainer.max_steps", "RL steps")
    logging_steps: int | None = _key("trainer.log_every_n_steps", "log every N steps")
    eval_steps: int | None = _key("trainer.val_check_interval", "validate every N steps")
    save_steps: int | None = _key(
        "callbacks.model_checkpoint.every_n_train_steps", "checkpoint every N steps"
    )
    report_to: str | list[str] | None = _key(  # noqa: RUF009 (a field(), as _key returns)
        "logger", "none | csv | tensorboard | wandb (csv is always kept: run.history() reads it)"
    )
    seed: int | None = _key("seed", "the run's seed")
    reward_weights: list[float] | None = _key(  # noqa: RUF009
        "method.reward_weights", "one weight per reward function, in order"
    )
    credit_beta: float | None = _key(
        "method.beta", "MRTPO's share of credit that follows relevance (not TRL's beta)"
    )
    overrides: list[str] = field(
        default_factory=list, metadata={"key": "", "help": "any Hydra override, key=value"}
    )

    @classmethod
    def mapping(cls) -> dict[str, str]:
        """Field name -> the config key it sets."""
        return {f.name: f.metadata["key"] for f in fields(cls) if f.metadata.get("key")}

    def to_overrides(self, reward_names: Sequence[str]) -> list[str]:
        """The Hydra overrides these settings stand for (``overrides`` last)."""
        written = {  # as is: config group options, a mapping, a count of prompts
            "report_to": _logger,
            "reward_weights": lambda w: self._weights(w, reward_names),
            "per_device_train_batch_size": self._prompts_per_step,
        }
        out = [f"method={self.method}"]
        for name, key in self.mapping().items():
            value, write = getattr(self, name), written.get(name)
            if value is not None and name != "method":
                out += [f"{key}={write(value)}"] if write else as_overrides({key: value})
        return out + [str(o) for o in self.overrides]

    def _prompts_per_step(self, batch: int) -> int:
        g = self.rl_sizes()[0]
        if batch < g or batch % g:
            raise ValueError(
                f"Config(per_device_train_batch_size={batch}) must be a multiple of "
                f"num_generations={g}: it counts completions, num_generations per prompt"
            )
        return batch // g

    def rl_sizes(self) -> tuple[int, int]:
        """(rl.group_size, prompts per step) of the composed config, so that ``overrides`` or
        an experiment count; (num_generations or 4, 4) where it does not compose (the pre-check
        then says why). Composed only where no override gives the size (overrides win)."""
        batch = self.per_device_train_batch_size
        rest = replace(self, per_device_train_batch_size=None, reward_weights=None)
        words = tuple(rest.to_overrides([]))
        g = _given_int(words, "rl.group_size")
        per_step = None if batch else _given_int(words, "rl.prompts_per_step")
        if g is None or (per_step is None and not batch):
            composed = _composed_sizes(words)
            if composed is None:
                return self.num_generations or 4, 4
            g, per_step = composed
        return g, batch // max(g, 1) if batch else int(per_step)

    @staticmethod
    def _weights(weights: Sequence[float], names: Sequence[str]) -> str:
        """``{name: weight, ...}``, one weight per reward function."""
        if len(weights) != len(names):
            raise ValueError(
                f"Config(reward_weights=...) has {len(weights)} weight(s) for {len(names)} "
                f"reward function(s) {list(names)}; give one per function"
            )
        return "{" + ", ".join(f"{n}: {float(w)!r}" for n, w in zip(names, weights)) + "}"


def _given_int(words: Sequence[str], key: str) -> int | None:
    """The value the last override of ``key`` gives, when it is a whole number above 0 (the
    config composes to it: an override is applied after every preset); None otherwise."""
    for word in reversed(words):
        name, _, value = word.partition("=")
        if name.lstrip("+~") == key:
            whole = value.isdigit() and str(int(value)) == value and int(value) > 0
            return int(value) if whole else None
    return None


@functools.lru_cache(maxsize=8)
def _composed_sizes(words: tuple[str, ...]) -> tuple[int, int] | None:
    """(rl.group_size, prompts per step) that ``task=custom`` and ``words`` compose to; None
    where they do not compose."""
    try:
        rl = compose("train.yaml", ["task=custom", *words]).rl
        per_step = rl.get("prompts_per_step") or rl.get("global_prompts_per_step") or 4
        return int(rl.group_size), int(per_step)
    except Exception:  # a bad setting: refused in one line by Trainer's pre-check
        return None


def _logger(report_to: str | Sequence[str]) -> str:
    """``logger=[csv,...]``: TRL's ``report_to`` names, with the CSV log always kept."""
    wanted = [report_to] if isinstance(report_to, str) else list(report_to)
    known = ("none", "csv", "tensorboard", "wandb")
    bad = [w for w in wanted if w not in known]
    if bad:
        raise ValueError(
            f"Config(report_to={report_to!r}): {bad} not known; give any of {list(known)} "
            "(csv is always written)"
        )
    return "[" + ",".join(["csv", *sorted({w for w in wanted if w in known[2:]})]) + "]"


class Trainer:
    """TRL's ``GRPOTrainer`` arguments, trained by this project's job (module docstring)."""

    def __init__(
        self,
        model: Any = None,
        reward_funcs: Callable | Sequence[Callable] | None = None,
        args: Config | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Sequence[Any] | None = None,
        reward_blocks: Mapping[str, Callable] | None = None,
        tokenizer: Any = None,
    ) -> None:
        if args is not None and not isinstance(args, Config):
            raise TypeError(f"args is a mrtpo.Config, not a {type(args).__name__}")
        self.args = args or Config()
        self.reward_funcs = _reward_funcs(reward_funcs)
        self.reward_names = _names(self.reward_funcs)
        self.reward_blocks = _blocks(reward_blocks)
        self.train_rows = _rows(train_dataset, "train_dataset", lambda: _row_limit(self.args))
        self.eval_rows = None if eval_dataset is None else _rows(eval_dataset, "eval_dataset")
        self.callbacks = _callbacks(callbacks)
        self.model, self.tokenizer = model, processing_class or tokenizer
        self._model_overrides = _model_overrides(model)
        if _is_model(model) and self.tokenizer is None:
            self.tokenizer = _tokenizer_of(model)
        elif not _is_model(model) and self.tokenizer is not None:
            log.warning(
                "processing_class is used with a loaded model only; the model's own is used"
            )

    def train(self) -> Any:
        """Run the job; return its ``api.RunResult`` and keep the trained policy in
        ``self.model`` / ``self.tokenizer``."""
        _probe(self.reward_funcs, self.reward_names, self.train_rows)
        overrides = self.args.to_overrides(self.reward_names)  # bad settings: before anything
        tokens: list[str] = []
        try:
            overrides = [*self._task_overrides(tokens), *self._model_overrides, *overrides]
            given = self.model if _is_model(self.model) else None
            tokenizer = self.tokenizer if given is not None else None
            s = live.Session(given, tokenizer, _prepare, callbacks=self.callbacks)
            with live.session(s), _config_errors_named(self.args) as composed:
                # composed once: checked (a bad setting is one line, and no run folder), then run
                result = api.train(overrides, check=lambda cfg: _precheck(cfg, self.args, composed))
        finally:
            live.drop(tokens)
        self.model, self.tokenizer = s.policy, s.built_tokenizer
        return result

    def _task_overrides(self, tokens: list[str]) -> list[str]:
        def keep(obj: Any, kind: str) -> str:
            tokens.append(live.put(obj, kind))
            return tokens[-1]

        rewards = [
            f"mrtpo.live.{keep(_trl_reward(f, n), 'reward')}"
            for f, n in zip(self.reward_funcs, self.reward_names)
        ]
        out = [
            "task=custom",
            f"task.data.path={live.PREFIX}{keep(self.train_rows, 'train_dataset')}",
            f"task.rewards=[{','.join(rewards)}]",
            f"task.reward_names=[{','.join(self.reward_names)}]",
        ]
        if self.eval_rows is not None:
            out.append(f"task.data.splits={{val: {live.PREFIX}{keep(self.eval_rows, 'eval')}}}")
            out.append(f"data.val_prompts={len(self.eval_rows)}")  # validated on all of them
        if self.reward_blocks:
            blocks = [
                f"{k}: mrtpo.live.{keep(fn, 'block')}" for k, fn in self.reward_blocks.items()
            ]
            out.append("task.blocks={" + ",".join(blocks) + "}")
        return out


def _precheck(cfg: Any, args: Config, composed: list[bool]) -> None:
    """Check the composed config as the job will, before the run folder; the error names the
    ``Config`` field that set the key. ``composed`` records that the config composed."""
    composed.append(True)
    try:
        check_keys(cfg)
        validate(cfg)
        devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
        if str(devices) != "1" or str(nodes) != "1":  # processes it starts cannot use the objects
            raise ValueError(
                f"trainer.devices={devices} trainer.num_nodes={nodes}: mrtpo.Trainer trains in "
                "this one process (its objects cannot reach others); for several devices run "
                "python src/train.py task=custom with import strings (docs/extending.md)"
            )
        try:  # the task built as the job will: a bad row or block name is refused here
            instantiate(cfg.task)
        except InstantiationException as exc:  # the task's own error, not Hydra's wrapper
            if isinstance(exc.__cause__, Exception):
                raise exc.__cause__ from None
            raise
    except ValueError as exc:
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (_named(exc.args[0], args), *exc.args[1:])
        raise


@contextlib.contextmanager
def _config_errors_named(args: Config) -> Iterator[list[bool]]:
    """A config that does not compose is one line naming the ``Config`` field or key; once it
    composed (the list yielded is not empty), the error is a warm start's: raised as is."""
    composed: list[bool] = []
    try:
        yield composed
    except ConfigCompositionException as exc:
        if composed:
            raise
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        m = re.match(r"Could not override '([\w.]+)'", text)
        if m and m.group(1).startswith("method."):
            text = f"{m.group(1)} is not a setting of method={args.method}"
        elif m:
            text = f"{m.group(1)} is not a setting (python src/train.py --help lists them)"
        raise ValueError(_named(text, args)) from None


def _named(message: str, args: Config) -> str:
    """``message`` led by the ``Config`` field whose key it names (as it is, if none)."""
    for name, key in Config.mapping().items():
        if message.startswith((f"{key}=", f"{key} ")) and name != "method":
            return f"Config({name}={getattr(args, name)!r}): {message}"
    return message


def _reward_funcs(given: Any) -> list[Callable]:
    if given is None:
        raise ValueError("reward_funcs is required: a reward function or a list of them")
    funcs = [given] if callable(given) or isinstance(given, str) else list(given)
    if not funcs:
        raise ValueError("reward_funcs is empty: give at least one reward function")
    for i, f in enumerate(funcs):
        if not callable(f) or hasattr(f, "forward"):  # a name or a model: a reward model
            what = (
                f"{f!r} (a reward model by name)" if isinstance(f, str) else f"a {type(f).__name__}"
            )
            raise TypeError(
                f"reward_funcs[{i}] is {what}; give a function (prompts, completions, **kwargs) "
                "-> list of float or None (reward models are not supported)"
            )
    return funcs


def _names(funcs: Sequence[Callable]) -> list[str]:
    """Each reward's name: the function's own (TRL's), ``reward_<i>`` for a lambda."""
    out = []
    for i, f in enumerate(funcs):
        name = getattr(getattr(f, "func", f), "__name__", None) or type(f).__name__
        ok = name.isidentifier() and not name.startswith("<")
        out.append(name if ok and name not in out else f"reward_{i}")
    return out


def _blocks(given: Mapping[str, Callable] | None) -> dict[str, Callable]:
    """``reward_blocks`` by reward name: a key goes into a ``task.blocks={...}`` override as
    is, so one that is not a plain name (``a,b``, ``${...}``) is refused, not written."""
    out = dict(given or {})
    for name, fn in out.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"reward_blocks has a key {name!r} that is not a name; key each block by its "
                "reward function's name (letters, digits and _)"
            )
        if not callable(fn):
            raise TypeError(f"reward_blocks[{name!r}] is a {type(fn).__name__}, not a function")
    return out


def _row_limit(cfg: Config) -> int | None:
    """How many rows of a stream (IterableDataset) are read: max_steps x prompts per step
    (of the config the settings compose to)."""
    if cfg.max_steps is None:
        return None
    return max(1, cfg.max_steps * max(cfg.rl_sizes()[1], 1))


def _rows(
    dataset: Any, name: str, limit: Callable[[], int | None] | None = None
) -> list[dict[str, Any]]:
    """``dataset`` (a ``datasets.Dataset`` / ``IterableDataset`` or a list of dicts) as rows
    with a ``prompt`` column; anything else is one line naming what to change. A stream is
    read whole without ``limit``, else up to ``limit()`` rows."""
    if dataset is None:
        raise ValueError(
            f"{name} is required: a datasets.Dataset or a list of dicts with a 'prompt'"
        )
    if hasattr(dataset, "to_list") and hasattr(dataset, "__len__"):  # datasets.Dataset
        rows = dataset.to_list()
    elif isinstance(dataset, Iterable) and not isinstance(dataset, (str, bytes, Mapping)):
        # an IterableDataset: take what the run uses
        limited = limit is not None and not isinstance(dataset, Sequence)
        n = limit() if limited else None
        if limited and n is None:
            raise ValueError(
                f"{name} is a stream ({type(dataset).__name__}): set Config(max_steps=N), as "
                "TRL asks, so that the rows the run needs can be read"
            )
        rows = list(islice(dataset, n) if limited else dataset)
    else:
        raise TypeError(
            f"{name} is a {type(dataset).__name__}; give a datasets.Dataset or a list of dicts"
        )
    if not rows:
        raise ValueError(f"{name} has no rows")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, Mapping)), None)
    if bad is not None:
        raise TypeError(f"{name}[{bad}] is a {type(rows[bad]).__name__}, not a dict (a row)")
    missing = next((i for i, r in enumerate(rows) if "prompt" not in r), None)
    if missing is not None:
        cols = sorted({k for r in rows[:100] for k in r})
        raise ValueError(
            f"{name} has no 'prompt' column (row {missing} has {cols}): as in TRL, each row's "
            "'prompt' holds text or chat messages; rename the column that holds the prompts"
        )
    return [dict(r) for r in rows]


def _callbacks(given: Sequence[Any] | None) -> list[Any]:
    from lightning.pytorch.callbacks import Callback

    out = list(given or [])
    for i, c in enumerate(out):
        if not isinstance(c, Callback):
            raise TypeError(
                f"callbacks[{i}] is a {type(c).__name__}: callbacks here are Lightning callbacks "
                "(lightning.pytorch.Callback), not transformers' TrainerCallback"
            )
    return out


def _is_model(model: Any) -> bool:
    return model is not None and not isinstance(model, (str, Path))


def _model_overrides(model: Any) -> list[str]:
    """``model.*`` overrides: none for the tiny model, a path or hub id, or a loaded model's
    own name (recorded only)."""
    if model is None:
        return []
    if isinstance(model, (str, Path)):
        return [f"model.name_or_path={_quoted(str(model))}", "model.tiny=null"]
    import torch

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generate"):
        raise TypeError(
            f"model is a {type(model).__name__}; give None (the tiny model), a path or hub id, "
            "or a loaded transformers causal LM (PreTrainedModel)"
        )
    name = str(getattr(model, "name_or_path", "") or "in-memory-model")
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        getattr(model, "dtype", torch.float32), "fp32"
    )
    return [f"model.name_or_path={_quoted(name)}", "model.tiny=null", f"model.dtype={dtype}"]


def _tokenizer_of(model: Any) -> Any:
    name = getattr(model, "name_or_path", "") or ""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception:
        raise ValueError(
            f"model is a loaded model whose tokenizer cannot be loaded from {name!r}; pass "
            "processing_class=<its tokenizer>"
        ) from None


def _prepare(model: Any, tokenizer: Any, cfg: Any) -> tuple[Any, Any]:
    """A given model and tokenizer made ready as ``load_policy`` makes a loaded one."""
    from mrtpo.core.models import prepare_policy

    name = cfg.model.get("name_or_path") or "the given model"
    return prepare_policy(
        model, tokenizer, bool(cfg.model.get("gradient_checkpointing")), cfg.model.get("lora"), name
    )


def _accepts(fn: Callable) -> Callable[[str], bool]:
    """Whether ``fn`` takes a keyword of that name (all of them with ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return lambda name: True
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return lambda name: True
    names = {p.name for p in params}
    return lambda name: name in names


def _trl_reward(fn: Callable, name: str) -> Callable:
    """``fn`` called as TRL calls a reward: prompts, completions, completion_ids (re-tokenized
    by the run's tokenizer) and the other columns, each by name if ``fn`` takes it."""
    takes = _accepts(fn)

    def call(prompts, completions, **columns):
        s = live.current()
        tok = s.built_tokenizer if s is not None else None
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        ids = [tok(t, add_special_tokens=False)["input_ids"] if tok else [] for t in texts]
        given = {"prompts": prompts, "completions": completions, "completion_ids": ids, **columns}
        return fn(**{k: v for k, v in given.items() if takes(k)})

    call.__name__ = name
    call.__qualname__ = getattr(getattr(fn, "func", fn), "__qualname__", name)
    call.__module__ = getattr(getattr(fn, "func", fn), "__module__", None) or __name__
    return call


def _probe(funcs: Sequence[Callable], names: Sequence[str], rows: list[dict]) -> None:
    """Call each reward on two prompts with empty completions: a wrong count (or no list) is
    refused before the run; one that raises is left to the run (which counts it per batch)."""
    sample = rows[:2]
    prompts = [r["prompt"] for r in sample]
    completions = [
        [{"role": "assistant", "content": ""}] if isinstance(p, list) else "" for p in prompts
    ]
    columns = {k: [r.get(k) for r in sample] for r in sample for k in r if k != "prompt"}
    for i, (fn, name) in enumerate(zip(funcs, names)):
        try:
            values = _trl_reward(fn, name)(prompts, completions, **columns)
        except Exception as exc:
            log.debug("reward %s raised on empty completions (%s); not checked", name, exc)
            continue
        listed = isinstance(values, (list, tuple)) or getattr(values, "ndim", 0) == 1
        count = len(values) if listed else None
        if count != len(sample):
            got = f"{count} value(s)" if count is not None else f"a {type(values).__name__}"
            raise ValueError(
                f"reward_funcs[{i}] ({name}) returned {got} for {len(sample)} completions; a "
                "reward function returns a list with one float (or None) per completion"
            )
