"""Whole-config checks made before any model or data loads, each failure one ``ConfigError``
line naming what to change (``validate``: every typed section's ranges, the seed and folder
names, the trainer's step limit, NaN/inf anywhere numeric, the method's and the engine's own
checks, and the schedule's rule; then ``preflight``; a paper preset's data files)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from mrtpo.core.errors import ConfigError
from mrtpo.run.config_keys import check_renamed
from mrtpo.run.placement import _preset, hydra_choices, visible_gpus
from mrtpo.run.settings import SCHEMAS, leaves, renamed, section

#: numpy's (and so Lightning's ``seed_everything``'s) range of seeds
SEED_RANGE = (0, 2**32 - 1)
#: untyped groups whose numbers go straight into training: none may be NaN or infinite
NUMERIC_GROUPS = ("method", "rollout", "trainer", "stage")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_seed(cfg) -> None:
    """``seed``: an integer numpy can take (``int()`` or numpy would fail naming no key)."""
    lo, hi = SEED_RANGE
    seed = OmegaConf.select(cfg, "seed", default=0)
    if not (_is_int(seed) and lo <= seed <= hi):
        raise ConfigError(f"seed={seed!r} is not allowed: an integer in [{lo}, {hi}]")


def check_names(cfg) -> None:
    """``job_name`` and ``run_name`` are one folder name each: the run's folder is
    ``<paths.log_dir>/<job_name>/runs/<time>_<run_name>``, and a separator or ``..`` in them
    put it outside ``logs/`` (``run_name=x/../../../../escaped``)."""
    for key in ("job_name", "run_name"):
        value = OmegaConf.select(cfg, key, default=None)
        if value is None:
            continue
        name = str(value)
        if not name or name in (".", "..") or any(c in name for c in ("/", "\\", "\0")):
            raise ConfigError(
                f"{key}={name!r} is not allowed: one folder name, without '/', '\\' or a "
                "name of '.' or '..' (the run's folder is <paths.log_dir>/<job_name>/runs/"
                "<time>_<run_name>; to put runs elsewhere set paths.log_dir)"
            )


def check_run(cfg) -> None:
    """``seed``, ``job_name``, ``run_name`` and the ``trainer`` keys the RL loop depends on."""
    check_seed(cfg)
    check_names(cfg)
    if OmegaConf.select(cfg, "trainer") is None:
        return
    steps = OmegaConf.select(cfg, "trainer.max_steps", default=None)
    if not (_is_int(steps) and steps >= 1):
        raise ConfigError(
            f"trainer.max_steps={steps!r} is not allowed: a positive step count (an integer "
            ">= 1); a run without a step limit would never end"
        )
    # A number must be a step count (0 divided by zero after step 1, with validation on or
    # off; a fraction of the endless epoch is refused by Lightning in its own words). A time
    # (a string or mapping) is left to Lightning.
    every = OmegaConf.select(cfg, "trainer.val_check_interval", default=None)
    if isinstance(every, (int, float)) and not (_is_int(every) and every >= 1):
        raise ConfigError(
            f"trainer.val_check_interval={every!r} is not allowed: an integer >= 1 (validate "
            "every N RL steps); data.val_prompts=0 turns validation off"
        )


def check_finite(cfg, groups: Sequence[str] = NUMERIC_GROUPS) -> None:
    """Refuse a NaN or infinite number anywhere in ``groups`` (``method.reward_weights``,
    ``rollout.sampling``, ...), naming its key. Interpolations are left as they are."""
    for name in groups:
        node = OmegaConf.select(cfg, name)
        if node is None:
            continue
        for key, value in leaves(OmegaConf.to_container(node, resolve=False), name):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(
                    f"{key}={value!r} is not allowed: a finite number (NaN and infinity cannot "
                    "be trained with)"
                )


def validate(cfg) -> None:
    """The typed sections' ranges and the ``check_*`` below, before anything loads."""
    for name in SCHEMAS:
        if OmegaConf.select(cfg, name) is not None:
            section(cfg, name)
    checks = (check_run, check_finite, check_engine, check_schedule, check_old_names)
    for check in (*checks, check_engine_settings, check_method):
        check(cfg)


def check_method(cfg) -> None:
    """``method.*`` values, checked by the method's own constructor before anything loads; its
    refusal (``method.beta=1.0``) is a ``ConfigError``, so a refused run leaves no folder."""
    node = OmegaConf.select(cfg, "method", default=None)
    if node is not None and OmegaConf.select(node, "_target_", default=None) is not None:
        _instantiate_checked(node)


def _instantiate_checked(node) -> None:
    """Build ``node`` so its constructor checks it; a ValueError/TypeError becomes a ConfigError."""
    try:
        instantiate(node)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, (ValueError, TypeError)):
            raise ConfigError(str(cause)) from None
        raise


def warmup_note(cfg) -> str | None:
    """One line when ``method.beta_warmup_steps`` ramps beta past the run's last step, so beta
    never reaches ``method.beta`` (a 5-step run with the default 10-step warm-up ends at 0.18
    of 0.5); None otherwise."""
    from mrtpo.core.credit.relevance import beta_schedule

    beta = OmegaConf.select(cfg, "method.beta", default=None)
    warmup = OmegaConf.select(cfg, "method.beta_warmup_steps", default=None)
    steps = OmegaConf.select(cfg, "trainer.max_steps", default=None)
    if not (_is_int(warmup) and _is_int(steps) and isinstance(beta, (int, float))):
        return None
    if warmup <= 0 or beta <= 0 or steps - 1 >= warmup:
        return None
    reached = beta_schedule(float(beta), steps - 1, warmup)
    return (
        f"method.beta_warmup_steps={warmup} is longer than this run (trainer.max_steps="
        f"{steps}): beta ends at {reached:.3g} of method.beta={beta:g} at the last step; set "
        f"method.beta_warmup_steps below {steps} (0: no warm-up) for beta to reach its value"
    )


def check_engine(cfg) -> None:
    """``rl.tis_cap`` needs an engine that reports the sampled tokens' log-probs."""
    cap, engine = OmegaConf.select(cfg, "rl.tis_cap"), _engine(cfg)
    if cap is None or engine is None or getattr(engine, "reports_logprobs", True):
        return
    target = cfg.rollout.engine._target_
    raise ConfigError(
        f"rl.tis_cap={cap} needs the engine's log-probs of the sampled tokens, and "
        f"rollout.engine._target_={target} reports none; set rl.tis_cap=null or use an engine "
        "that reports them (rollout=hf, rollout=vllm)"
    )


def check_engine_settings(cfg) -> None:
    """The engine's checks of ``rollout.engine.*``, if ``checks_settings_when_built`` says free."""
    if getattr(_engine(cfg), "checks_settings_when_built", False):
        _instantiate_checked(OmegaConf.select(cfg, "rollout.engine"))


def _engine(cfg) -> type | None:
    """The class of ``rollout.engine`` (None when the config names none)."""
    target = OmegaConf.select(cfg, "rollout.engine._target_")
    return get_class(str(target)) if target is not None else None


def check_schedule(cfg) -> None:
    """``rollout.schedule``/``max_staleness`` against the engine, by ``rollout.source``'s rule."""
    from mrtpo.rollout.source import check_schedule as rule

    engine = _engine(cfg)
    own = bool(OmegaConf.select(cfg, "rollout.engine.own_copy", default=False))
    try:
        rule(
            OmegaConf.select(cfg, "rollout.schedule", default="sync"),
            OmegaConf.select(cfg, "rollout.max_staleness", default=1),
            engine,
            apart=getattr(engine, "generates_apart", False) or own,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_old_names(cfg) -> None:
    """A composed config (a preset's YAML, not only the command line) that sets a replaced
    key is refused naming its successor, unless the key only interpolates it (an engine's
    ``share_prompt: ${oc.select:rl.shared_prompt_forward,auto}``)."""
    for old, new in renamed().items():
        parent, _, leaf = old.rpartition(".")
        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        if not OmegaConf.is_config(node) or leaf not in node:
            continue
        raw = OmegaConf.to_container(node, resolve=False).get(leaf)
        if not (isinstance(raw, str) and new in raw and raw.startswith("${")):
            check_renamed(old)


#: How to set a mandatory key (``???`` in its config) left without a value, and what it is.
_MISSING_HINTS = {
    "task.data.path": "task.data.path=prompts.jsonl (your prompts: a .jsonl, .json, .parquet "
    "or .csv file, or a dataset folder)",
    "task.rewards": "task.rewards=[mymod.r1,mymod.r2] (your reward functions, as import strings)",
}


def preflight(cfg: DictConfig) -> None:
    """The checks beyond ``validate`` that need nothing loaded (issue 41 item 7), in the order a
    user would fix them: a value left open (``???``), a logger's missing package,
    ``rollout=vllm`` without CUDA. (A missing data file is refused where the task reads it.)"""
    check_mandatory(cfg)
    check_logger_packages(cfg)
    check_vllm_on_cpu(cfg)
    # not a refusal (a short run to try things is fine): said once, as the run starts (a
    # resume's start said it; report.py names such runs)
    note = None if cfg.get("resume") else warmup_note(cfg)
    if note:
        logging.getLogger(__name__).warning("%s", note)


def check_mandatory(cfg: DictConfig) -> None:
    """Refuse a config that leaves a mandatory value (``???``) unset, naming each such key."""
    missing = sorted(missing_keys(cfg))
    if not missing:
        return
    said = [_MISSING_HINTS.get(k, k) for k in missing]
    task = hydra_choices(cfg).get("task") or OmegaConf.select(cfg, "task.name", default=None)
    who = f"task={task} needs" if task and all(k.startswith("task.") for k in missing) else "set"
    raise ConfigError(
        f"{who} {' and '.join(said)}; "
        + ("see docs/extending.md" if task == "custom" else "give each a value on the command line")
    )


def missing_keys(node, prefix: str = "") -> list[str]:
    """The keys under ``node`` set to ``???``, read without resolving any interpolation
    (Hydra's own node is left out: some of its values exist only inside a job)."""
    out = []
    keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
    for key in keys:
        name = f"{prefix}{key}"
        if name == "hydra" or OmegaConf.is_interpolation(node, key):
            continue
        if OmegaConf.is_missing(node, key):
            out.append(name)
            continue
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none():
            out += missing_keys(child, f"{name}.")
    return out


def check_logger_packages(cfg: DictConfig) -> None:
    """``check_loggers``' refusal as a config error (still a ``LoggerPackageMissing``)."""
    from mrtpo.run.loggers import LoggerPackageMissing, check_loggers

    class MissingLoggerPackage(ConfigError, LoggerPackageMissing):
        pass

    try:
        check_loggers(cfg.get("logger"))
    except LoggerPackageMissing as exc:
        raise MissingLoggerPackage(str(exc).removeprefix("cannot start: ")) from None


def _head_dim(model: DictConfig | None) -> int | None:
    """The attention head width of ``cfg.model`` without loading it (None: unknown)."""
    if model is None:
        return None
    tiny = model.get("tiny")
    if tiny:
        hidden, heads = tiny.get("hidden_size"), tiny.get("num_attention_heads")
        return int(hidden) // int(heads) if hidden and heads else None
    from mrtpo.rollout.vllm import _model_head_dim

    return _model_head_dim(str(model.get("name_or_path")))


def check_vllm_on_cpu(cfg: DictConfig) -> None:
    """``rollout=vllm`` on vLLM's CPU build: it must be installed, and heads at least 32 wide."""
    engine = OmegaConf.select(cfg, "rollout.engine")
    if engine is None or not str(engine.get("_target_", "")).endswith("VLLMEngine"):
        return
    device = str(engine.get("device", "auto"))
    if device == "cuda" or (device == "auto" and visible_gpus()):
        return  # (on cuda the engine itself says when there is no CUDA device)
    if importlib.util.find_spec("vllm") is None:
        from mrtpo.rollout.vllm import INSTALL_HINT

        raise ConfigError(f"{INSTALL_HINT} (vLLM is not installed)")
    head = _head_dim(OmegaConf.select(cfg, "model"))
    if head is not None and head < 32:
        tiny = OmegaConf.select(cfg, "model.tiny") is not None
        fix = (
            "use model=tiny_wide (the tiny model with two heads of 32; for another built "
            "model: model.tiny.num_attention_heads=2 model.tiny.num_key_value_heads=1)"
            if tiny
            else "choose a model with heads of 32 or more"
        )
        raise ConfigError(
            f"rollout=vllm on this machine (no CUDA device) runs vLLM's CPU build, whose "
            f"attention needs heads of 32 or more; model.name_or_path={cfg.model.name_or_path} "
            f"has heads of {head}: {fix}, or use rollout=hf"
        )


# A paper preset trains on its files, present and in the paper's layout, or is refused.
# A preset of ``configs/experiment/`` whose paper setting reads data files lists them under
# ``paper_data``, one entry per config key that holds a path::
#
#     paper_data:
#       task.data.path:
#         what: HIR-16K as released (HIR_trainv1.jsonl of the hub dataset sastpg/HIR-16K)
#         layouts: [[source, prompt, criteria, ground_truth], [data_source, reward_model]]
#
# ``layouts`` (optional): the file's first row must hold every field of one of them. Without
# it an entry may name a folder (``kind: folder``) or a list of them; ``unless_set`` keys supply
# the data another way (``task.splits.train.hub``) and skip the entry. Before anything loads
# (``pipeline.prepare``) an unset key, a missing path or another layout is refused naming the
# key, the path and the expected file: a paper preset never falls back to other data (the
# instruction presets trained on the generated set without a word).

#: How many bytes of a JSON-lines file are read to find its first row.
FIRST_LINE_BYTES = 1 << 24


def first_row(path: Path) -> dict[str, Any] | None:
    """The first row of a .jsonl, .json (a list) or .parquet file (parquet: its field names)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path)
        return dict.fromkeys(meta.schema_arrow.names) if meta.metadata.num_rows else None
    if suffix == ".jsonl":
        with open(path, encoding="utf-8-sig") as f:
            for line in iter(lambda: f.readline(FIRST_LINE_BYTES), ""):
                if line.strip():
                    row = json.loads(line)
                    return row if isinstance(row, dict) else {}
        return None
    data = json.loads(path.read_text(encoding="utf-8-sig"))
    rows = data if isinstance(data, list) else [data]
    return (rows[0] if isinstance(rows[0], dict) else {}) if rows else None


def _layout_problem(path: Path, layouts: list[list[str]]) -> str | None:
    """Why ``path``'s first row is in none of ``layouts`` (None: it is in one)."""
    try:
        row = first_row(path)
    except Exception as exc:  # not JSON, not parquet, not UTF-8: the reader's words
        return f"cannot be read as rows ({type(exc).__name__}: {str(exc)[:200]})"
    if row is None:
        return "holds no row"
    if any(all(f in row for f in layout) for layout in layouts):
        return None
    wanted = " or ".join("{" + ", ".join(layout) + "}" for layout in layouts)
    return f"is not in the paper's layout: its first row has {sorted(row)[:12]}, not {wanted}"


def entry_problems(key: str, value: Any, spec: Mapping[str, Any]) -> list[str]:
    """What is wrong with the path(s) at ``key`` for the paper's data ``spec`` (none: [])."""
    what = str(spec.get("what") or "the paper's data")
    if value in (None, "", []):
        return [f"{key} is not set: it must name {what}"]
    paths = [Path(str(v)) for v in value] if isinstance(value, (list, tuple)) else [Path(value)]
    folder = spec.get("kind") == "folder"
    problems = []
    for p in paths:
        if folder and not p.is_dir():
            problems.append(f"{key}={p}: no such folder; it must be {what}")
        elif not folder and not p.is_file():
            problems.append(f"{key}={p}: no such file; it must be {what}")
        elif not folder and spec.get("layouts"):
            why = _layout_problem(p, [list(map(str, lay)) for lay in spec["layouts"]])
            if why:
                problems.append(f"{key}={p} {why}; it must be {what}")
    return problems


def paper_data_problems(cfg) -> list[str]:
    """One line per problem with the preset's ``paper_data`` files ([] when none)."""
    declared = OmegaConf.select(cfg, "paper_data", default=None)
    if not declared:
        return []
    out = []
    for key, spec in OmegaConf.to_container(declared, resolve=False).items():
        spec = spec if isinstance(spec, Mapping) else {}
        if any(OmegaConf.select(cfg, str(k), default=None) for k in spec.get("unless_set") or []):
            continue
        value = OmegaConf.select(cfg, str(key), default=None, throw_on_missing=False)
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        out += entry_problems(str(key), value, spec)
    return out


def check_paper_data(cfg) -> None:
    """Refuse a preset whose paper data is missing or in another layout, naming key, path, file."""
    found = paper_data_problems(cfg)
    if found:
        more = f" (and {len(found) - 1} more: dry_run=true lists them)" if len(found) > 1 else ""
        raise ConfigError(
            f"{_preset(cfg)}trains on the paper's data, and {found[0]}{more}. Put the file "
            "there or point the key at it (docs/tasks/); a preset never trains on other data"
        )
