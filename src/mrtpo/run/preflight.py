"""Checks of a training config that need nothing loaded; each failure is one ``ConfigError``
line naming what to change (issue 41, item 7). ``check(cfg)`` runs before anything loads:

- a value left open (``???``), e.g. ``task=custom`` without ``task.rewards``;
- a logger whose package is missing (``logger=wandb`` without ``wandb``);
- ``rollout=vllm`` without CUDA: vLLM's CPU build must be installed, and its attention has
  no kernel for heads under 32 wide (tiny/toy have 16; ``model=tiny_wide`` has two of 32).

A missing data file is refused where the task reads it (``tasks.custom.data.detect_format``).
"""

from __future__ import annotations

import importlib.util
import logging

from omegaconf import DictConfig, ListConfig, OmegaConf

from mrtpo.run.checks import warmup_note
from mrtpo.run.settings import ConfigError

#: How to set a mandatory key (``???`` in its config) left without a value, and what it is.
_MISSING_HINTS = {
    "task.data.path": (
        "task.data.path=prompts.jsonl",
        "your prompts: a .jsonl, .json, .parquet or .csv file, or a dataset folder",
    ),
    "task.rewards": (
        "task.rewards=[mymod.r1,mymod.r2]",
        "your reward functions, as import strings",
    ),
}


def check(cfg: DictConfig) -> None:
    """Every check of this module, in the order a user would fix them."""
    check_mandatory(cfg)
    check_logger_packages(cfg)
    check_vllm_on_cpu(cfg)
    # not a refusal (a short run to try things is fine): said once, as the run starts (a
    # resume's start said it; report.py names such runs)
    note = None if cfg.get("resume") else warmup_note(cfg)
    if note:
        logging.getLogger(__name__).warning("%s", note)


def _task_choice(cfg: DictConfig) -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.choices.get("task"))
    except Exception:  # composed without Hydra's runtime record
        return OmegaConf.select(cfg, "task.name", default=None)


def check_mandatory(cfg: DictConfig) -> None:
    """Refuse a config that leaves a mandatory value (``???``) unset, naming each such key."""
    missing = sorted(_missing(cfg, ""))
    if not missing:
        return
    said = [f"{_MISSING_HINTS[k][0]} ({_MISSING_HINTS[k][1]})" if k in _MISSING_HINTS else k
            for k in missing]  # fmt: skip
    task = _task_choice(cfg)
    who = f"task={task} needs" if task and all(k.startswith("task.") for k in missing) else "set"
    raise ConfigError(
        f"{who} {' and '.join(said)}; "
        + ("see docs/extending.md" if task == "custom" else "give each a value on the command line")
    )


def _missing(node, prefix: str) -> list[str]:
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
            out += _missing(child, f"{name}.")
    return out


def check_logger_packages(cfg: DictConfig) -> None:
    """Refuse a logger whose package is missing (``mrtpo.run.loggers.check_loggers``) as a config
    error (still a ``LoggerPackageMissing``): the message says what to install or which
    logger to choose instead."""
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
    """``rollout=vllm`` where it would run on vLLM's CPU build: the build must be installed,
    and the model's heads at least 32 wide (vLLM's CPU attention kernels)."""
    engine = OmegaConf.select(cfg, "rollout.engine")
    if engine is None or not str(engine.get("_target_", "")).endswith("VLLMEngine"):
        return
    device = str(engine.get("device", "auto"))
    if device == "cuda":
        return  # the engine itself says when there is no CUDA device
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return
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
