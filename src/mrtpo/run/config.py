"""Composing the project's Hydra config outside the entry points (``compose``: the same
``configs/``, defaults and resolvers as ``src/train.py``), and the resolvers, registered on
import (the entry points import it before ``@hydra.main`` runs)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from mrtpo.run.settings import register_schemas

#: ``configs/`` of a source checkout (src/mrtpo/run/config.py -> <root>/configs).
CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"

# Run folders this process claimed (a resolver gives the same one each time it is evaluated),
# and the folders above each it created (removed with a refused run's: ``discard_refused_folder``).
_CLAIMED: dict[str, str] = {}
_MADE_PARENTS: dict[str, list[str]] = {}

#: The project's root: the folder holding configs/ (paths.root_dir's default).
PROJECT_ROOT = CONFIG_DIR.parent


def unique_dir(base: str) -> str:
    """Create ``base`` exclusively (else ``base-1``, ``base-2``...) and return it: two runs
    started in the same second would otherwise share one folder. DDP workers never come here."""
    if base in _CLAIMED:
        return _CLAIMED[base]
    path = Path(base)
    missing = [p for p in [path.parent, *path.parent.parents] if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        candidate = path.with_name(f"{path.name}-{n}") if n else path
        with contextlib.suppress(FileExistsError):
            candidate.mkdir()
            break
    _CLAIMED[base] = str(candidate)
    _MADE_PARENTS[str(candidate)] = [str(p) for p in missing]
    return str(candidate)


def made_here(folder: str | Path) -> list[Path] | None:
    """For a run folder this process created (``unique_dir``): the folders it created for it,
    the run folder first, then its parents from the innermost; None for any other folder."""
    key = str(folder)
    if key not in _MADE_PARENTS:
        key = next((k for k in _MADE_PARENTS if Path(k).resolve() == Path(folder).resolve()), "")
    if not key:
        return None
    return [Path(key), *map(Path, _MADE_PARENTS[key])]


def run_dir(resume, base: str) -> str:
    """``hydra.run.dir``: the resumed run's own folder, or a new, unique one."""
    return str(resume) if resume else unique_dir(base)


def hydra_subdir(resume) -> str | None:
    """``hydra.output_subdir``: ``.hydra``; None for a resume (``record_resume`` saves its own)."""
    return None if resume else ".hydra"


def job_log(resume, output_dir: str, job_name: str, pending_dir: str | None = None) -> str:
    """Hydra's job log: in the run folder, but a resume logs to ``pending_dir`` (older
    configs: beside the run folder's parent) until ``record_resume`` accepts it and moves the
    log into the run's own (a refused resume's stays)."""
    if not resume:
        return str(Path(output_dir) / f"{job_name}.log")
    folder = Path(str(resume)).resolve()
    pending = Path(pending_dir) if pending_dir else folder.parent.parent / "resume-logs"
    pending.mkdir(parents=True, exist_ok=True)
    return str(pending / f"{folder.name}.{os.getpid()}.log")


def flat_dirname(name: str) -> str:
    """A sweep job's folder name from its overrides: one folder, not a nest of them for a
    path-valued override (``model.name_or_path=/a/b``), at most 200 characters."""
    return str(name).replace("/", "_").replace(os.sep, "_")[:200]


# A multirun's folder, by its base (``.../multiruns/<time>``): the last one the launcher
# resolved from a sweep's own overrides, for its jobs (whose overrides sweep nothing).
_SWEEP_DIRS: dict[str, str] = {}


def swept_keys(overrides) -> list[str]:
    """The keys a multirun sweeps over (``method=gdpo,mrtpo``, ``seed=range(1,4)``), in order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, keys = OverridesParser.create(), []
    for text in overrides or []:
        try:
            parsed = parser.parse_overrides([str(text)])[0]
        except Exception:  # not Hydra's grammar: not a sweep Hydra would run
            continue
        if parsed.is_sweep_override() and parsed.key_or_group not in keys:
            keys.append(parsed.key_or_group)
    return keys


def sweep_dir(base, overrides) -> str:
    """``hydra.sweep.dir``: ``base`` then the swept keys (``..._method-seed``, at most 100
    more characters). A job (sweeping nothing) gets its sweep's last folder; as with Hydra's
    ``${now:...}``, two sweeps over the same keys in the same second share one."""
    key, keys = str(base), swept_keys(overrides)
    if not keys:
        return _SWEEP_DIRS.get(key, key)
    name = re.sub(r"[^A-Za-z0-9._=+-]", "_", "-".join(keys))[:100]
    _SWEEP_DIRS[key] = f"{key}_{name}"
    return _SWEEP_DIRS[key]


# src/eval.py's .hydra subfolders, by eval.output: one answer per folder however often resolved.
_EVAL_SUBDIRS: dict[str, str] = {}


def eval_hydra_subdir(output) -> str:
    """``hydra.output_subdir`` of eval: ``.hydra``, unless ``eval.output`` already holds a
    ``.hydra/`` (e.g. eval.output=<training run>): then ``.hydra/eval-<time>``, so a training
    run's saved config is never overwritten. The same answer each time it is resolved."""
    if not output or not (Path(str(output)) / ".hydra").exists():
        return ".hydra"
    stamp = f".hydra/eval-{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    return _EVAL_SUBDIRS.setdefault(str(output), stamp)


def given_overrides() -> list[str] | None:
    """The overrides this Hydra job was given; None outside a Hydra job."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return [str(o) for o in HydraConfig.get().overrides.task]
    except Exception:
        return None


def run_config_path(ckpt_path: str | Path) -> Path:
    """``<run>/.hydra/config.yaml`` for ``<run>/checkpoints/<name>.ckpt``."""
    ckpt = Path(ckpt_path)
    run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run / ".hydra" / "config.yaml"


def eval_task_name(choice: str, ckpt_path, overrides) -> str:
    """The task an evaluation scores, for its folder name (eval.yaml's ``run_name``): the
    training run's (``hydra.yaml``, ``job.json``) when ``ckpt_path`` is given without ``task=``."""
    given = any(str(o).lstrip("+").startswith("task=") for o in (overrides or []))
    if not ckpt_path or given:
        return choice
    run = run_config_path(str(ckpt_path)).parent.parent
    try:
        saved = OmegaConf.load(run / ".hydra" / "hydra.yaml")
        return str(saved.hydra.runtime.choices.task)
    except Exception:  # no saved Hydra config: the job's record, else the choice
        try:
            return str(json.loads((run / "job.json").read_text())["task"] or choice)
        except Exception:
            return choice


def project_root() -> str:
    return str(PROJECT_ROOT)


def register_resolvers() -> None:
    """``mrtpo.<name>`` for each resolver function of this module."""
    folders = (unique_dir, run_dir, hydra_subdir, job_log, flat_dirname, sweep_dir)
    for fn in (*folders, project_root, eval_hydra_subdir, eval_task_name):
        name = f"mrtpo.{fn.__name__}"
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


register_schemas()


def compose(config_name: str = "train.yaml", overrides: Sequence[str] = (), config_dir=None):
    """The config as the entry points compose it, made the current ``HydraConfig``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir or CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name, overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
    return cfg
