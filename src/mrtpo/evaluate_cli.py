"""The command line of ``src/eval.py``: what its ``--help`` lists, the name and ``.hydra``
folder of its run folder (the resolvers configs/eval.yaml and configs/hydra/eval.yaml use),
and its job, which ends on a bad value with one line.

This is an entry point's module: library code never imports it. The evaluation itself is
``mrtpo.eval_job.run``; the training run behind a checkpoint is ``mrtpo.trained_run``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mrtpo.cli import help_groups, run_job
from mrtpo.trained_run import run_config_path

#: The groups eval composes (its ``--help`` lists only these).
EVAL_GROUPS = ("model", "task", "rollout", "paths")


#: What each group of eval chooses (its --help).
GROUP_HELP = {
    "model": "the policy and tokenizer (or model.name_or_path=<folder>)",
    "task": "the benchmark family; eval.split picks the split",
    "rollout": "the generation engine (hf, or vllm)",
    "paths": "where data, logs and caches live",
}


def _help_groups() -> str:
    return help_groups({g: GROUP_HELP.get(g, "") for g in EVAL_GROUPS})


_SUBDIRS: dict[str, str] = {}


def _hydra_subdir(output) -> str:
    """``hydra.output_subdir`` of eval: ``.hydra``, unless ``eval.output`` already holds a
    ``.hydra/`` (e.g. eval.output=<training run>): then ``.hydra/eval-<time>``, so a training
    run's saved config is never overwritten. The same answer each time it is resolved."""
    if not output or not (Path(str(output)) / ".hydra").exists():
        return ".hydra"
    key = str(output)
    if key not in _SUBDIRS:
        _SUBDIRS[key] = f".hydra/eval-{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    return _SUBDIRS[key]


def _task_name(choice: str, ckpt_path, overrides) -> str:
    """The task an evaluation scores, for its folder name: the training run's (its
    ``.hydra/hydra.yaml`` or ``job.json``) when ``ckpt_path`` is given without ``task=``."""
    given = any(str(o).lstrip("+").startswith("task=") for o in (overrides or []))
    if not ckpt_path or given:
        return choice
    run = run_config_path(str(ckpt_path)).parent.parent
    try:
        saved = OmegaConf.load(run / ".hydra" / "hydra.yaml")
        return str(saved.hydra.runtime.choices.task)
    except Exception:  # no saved Hydra config: the job's record, else the choice
        import json

        try:
            return str(json.loads((run / "job.json").read_text())["task"] or choice)
        except Exception:
            return choice


# configs/hydra/eval.yaml resolves these (and mrtpo.config's mrtpo.flat_dirname); src/eval.py
# imports this module before Hydra runs.
for _name, _fn in (
    ("mrtpo.eval_groups", _help_groups),
    ("mrtpo.eval_hydra_subdir", _hydra_subdir),
    ("mrtpo.eval_task_name", _task_name),
):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _fn)


def main_job(cfg: DictConfig) -> dict[str, float]:
    """``src/eval.py``'s job: a bad setting, missing data or a model that cannot load ends it
    with the message alone (``mrtpo.cli.run_job``; the traceback goes to the run's log file)."""
    from mrtpo.eval_job import run
    from mrtpo.threads import configure

    def job(cfg: DictConfig) -> dict[str, float]:
        configure(cfg)  # torch's CPU threads, before the model loads (configs/eval.yaml)
        return run(cfg)

    return run_job(job, cfg)
