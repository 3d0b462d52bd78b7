"""What src/train.py and src/eval.py share: ``--help``'s config group lines, a user error
ending the job with its message alone (``error: ...``, exit status 2), loading the model.
Importing it registers the ``mrtpo.train_groups``/``mrtpo.eval_groups`` resolvers that the
help templates of configs/hydra/default.yaml and eval.yaml use."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from mrtpo.core.errors import CompactHydraException
from mrtpo.run.config import CONFIG_DIR
from mrtpo.run.settings import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: True in the process of an entry point (src/train.py): a refusal before Hydra starts the
#: job is printed as one line with exit status 2; a library caller gets the exception.
COMMAND_LINE = False

#: What a bad value, missing data or a model that cannot load raises: the entry points print
#: its message alone. Anything else (a bug, an interrupted run) keeps Hydra's traceback.
USER_ERRORS = (ValueError, FileNotFoundError, KeyError)


def help_groups(described: Mapping[str, str]) -> str:
    """``--help``'s groups: each one's options (``configs/<group>/*.yaml``), and what it chooses."""
    options = {
        g: ", ".join(sorted(p.stem for p in (CONFIG_DIR / g).glob("*.yaml"))) for g in described
    }
    return "\n".join(f"{g}: {options[g]}\n    {text}".rstrip() for g, text in described.items())


#: What each group of src/train.py chooses (its --help), in the order a user picks them.
TRAIN_GROUP_HELP = {
    "experiment": "a preset: a paper setting or a toy run, with the groups and keys it needs",
    "task": "the prompts and their rewards (task.* keys: data files, splits, constraints)",
    "method": "how the rewards become one update: MRTPO and its ablations, GDPO, GRPO, CoRT, OPSD",
    "model": "the policy and tokenizer (or model.name_or_path=<folder or hub id>); model.lora.r",
    "rollout": "the generation engine (hf, or vllm); rollout.sampling.* the sampling",
    "trainer": "where it runs (cpu, gpu, ddp, fsdp) and trainer.max_steps, trainer.devices",
    "stage": "rl (multi-reward RL, the default) or sft (supervised warm start)",
    "logger": "where the metrics are written: metrics.csv in the run folder, TensorBoard, W&B",
    "callbacks": "checkpoints, the console lines, samples and the end-of-run export; none: off",
    "debug": "fast: a run of a few seconds",
    "paths": "where data, logs and caches live",
}

#: What each group of src/eval.py chooses (its --help lists only these groups).
EVAL_GROUP_HELP = {
    "model": "the policy and tokenizer (or model.name_or_path=<folder>)",
    "task": "the benchmark family; eval.split picks the split",
    "rollout": "the generation engine (hf, or vllm)",
    "paths": "where data, logs and caches live",
}

for _name, _groups in (
    ("mrtpo.train_groups", TRAIN_GROUP_HELP),
    ("mrtpo.eval_groups", EVAL_GROUP_HELP),
):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, lambda g=_groups: help_groups(g))


def in_sweep() -> bool:
    """Whether this runs as a job of a Hydra sweep (``-m``)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # not inside a Hydra job
        return False


def log_to_files(level: int, message: str, exc: BaseException | None = None) -> list[str]:
    """Log ``message`` (and ``exc``'s traceback) to the root logger's files only; their paths."""
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    record = log.makeRecord(log.name, level, __file__, 0, message, None, info)
    files = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
            handler.flush()
            files.append(handler.baseFilename)
    return files


class JobFailed(CompactHydraException):
    """A job of a sweep that stopped on a bad value, missing data or a model that cannot
    load: Hydra records it as failed, runs the others, and prints this message alone."""


def user_error(exc: BaseException) -> BaseException | None:
    """The error to show for a ``USER_ERRORS`` ``exc``, or one (or an ``ImportError``) that
    Hydra's ``instantiate`` wrapped; None for anything else."""
    if isinstance(exc, USER_ERRORS):
        return exc
    cause = exc.__cause__
    if isinstance(exc, InstantiationException) and isinstance(cause, (*USER_ERRORS, ImportError)):
        return cause
    return None


def run_job(job: Callable[[DictConfig], T], cfg: DictConfig) -> T:
    """Run a job; a ``USER_ERRORS`` prints ``error: <message>`` (and where its traceback was
    logged) and exits 2, or fails a sweep's job. ``HYDRA_FULL_ERROR=1`` keeps the traceback."""
    try:
        return job(cfg)
    except Exception as raised:
        exc = user_error(raised)
        if exc is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        files = log_to_files(logging.ERROR, "stopped", raised)
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {text}", file=sys.stderr)
        if files and not isinstance(exc, (ConfigError, FileNotFoundError)):
            print(f"(the traceback is in {files[0]})", file=sys.stderr)
        if in_sweep():
            raise JobFailed(f"error: {text}") from None
        raise SystemExit(2) from None


def _load_failure(name: str, exc: BaseException) -> str:
    """Why ``model.name_or_path=name`` did not load, in one line."""
    lines = [s.strip() for s in str(exc).strip().splitlines() if s.strip()]
    first = lines[0] if lines else type(exc).__name__
    for prefix in (f"model.name_or_path={name} ", f"could not load model '{name}': "):
        first = first.removeprefix(prefix)
    folder = Path(name)
    if name.startswith(("/", "./", "../", "~")) and not folder.expanduser().exists():
        return "no such folder: name a folder that holds a model, or a Hub id such as org/name"
    if folder.is_dir() and not (folder / "config.json").is_file() and "tiny model" not in first:
        return "the folder holds no config.json: it is not a model folder"
    if not folder.exists() and "/" in name and not name.startswith(("/", ".")):
        first += "; without network, point model.name_or_path at a local copy of the model"
    return first


def load_model(cfg: DictConfig) -> tuple[Any, Any]:
    """The policy and tokenizer of ``cfg.model``; a model that does not load is a one-line error."""
    from mrtpo.core.models import load_policy

    try:
        return load_policy(**OmegaConf.to_container(cfg.model, resolve=True))
    except (OSError, ValueError, KeyError) as exc:
        name = str(cfg.model.get("name_or_path"))
        why = _load_failure(name, exc)
        # a folder that is not there: a refusal (the run leaves no folder); a model that is
        # there but fails to load keeps its run folder and the traceback in its log
        missing = name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists()
        error = ConfigError if missing else ValueError
        raise error(f"model.name_or_path={name}: cannot load the model ({why})") from exc
