"""What a run or policy folder was trained on: its task and its model, read from what the run
left (``.hydra/config.yaml``, the export's ``mrtpo_export.json`` and ``config.json``).

The synthetic demo runs scored on Spider gave a table of 0.000 with no warning (issue 40
item 3): ``check_sources`` refuses a folder trained on another task family and a row whose
seeds hold different models. A folder that does not say (a base model) is taken as it is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


def family_target(task_config: str) -> str:
    """The task class of ``configs/task/<task_config>.yaml``."""
    from mrtpo.run.config import CONFIG_DIR

    return str(OmegaConf.load(CONFIG_DIR / "task" / f"{task_config}.yaml")._target_)


def _run_config(folder: Path) -> Any:
    try:
        return OmegaConf.load(folder / ".hydra" / "config.yaml")
    except Exception:  # absent or unreadable: the folder says nothing
        return None


def trained_task(folder: Path) -> tuple[str, str] | None:
    """(task class, task as the run chose it) a folder was trained on; None when unknown."""
    cfg = _run_config(folder)
    if cfg is not None:
        target = OmegaConf.select(cfg, "task._target_", default=None)
        if target:
            try:
                hydra = OmegaConf.load(folder / ".hydra" / "hydra.yaml")
                name = str(OmegaConf.select(hydra, "hydra.runtime.choices.task"))
            except Exception:
                name = str(target).rsplit(".", 1)[-1]
            return str(target), name
    try:
        name = json.loads((folder / "mrtpo_export.json").read_text(encoding="utf-8"))["task"]
        return family_target(str(name)), str(name)
    except Exception:  # not one of this project's exports, or a task of no config here
        return None


def _signature(sizes: dict[str, Any]) -> str | None:
    try:
        return (
            f"hidden {int(sizes['hidden_size'])} x {int(sizes['num_hidden_layers'])} layers, "
            f"MLP {int(sizes['intermediate_size'])}"
        )  # (no vocabulary: the tiny model's export trims it to its tokenizer's)
    except (KeyError, TypeError, ValueError):
        return None


def model_identity(folder: Path) -> str | None:
    """The model a folder holds or was trained from, by its sizes (the export's config.json,
    the run's model config, or a paper model's published sizes); else its model's name."""
    for path in (folder / "policy" / "config.json", folder / "config.json"):
        try:
            return _signature(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    cfg = _run_config(folder)
    if cfg is None:
        return None
    from mrtpo.run.dryrun import model_sizes

    try:
        sizes = model_sizes(cfg)
    except Exception:  # a config that does not resolve here
        sizes = None
    name = OmegaConf.select(cfg, "model.name_or_path", default=None)
    return (_signature(sizes) if sizes else None) or (Path(str(name)).name if name else None)


def check_sources(family: str, task_config: str, sources: Sequence[Any]) -> None:
    """Refuse (``SystemExit`` with one line per problem) folders trained on another task than
    ``family``'s, and rows whose seeds hold different models. ``sources``: objects with
    ``path`` and ``method`` (the row they belong to)."""
    want = family_target(task_config)
    problems = []
    for src in sources:
        task = trained_task(src.path)
        if task is not None and task[0] != want:
            problems.append(
                f"{src.path} was trained on task={task[1]} ({task[0]}), not on the {family} "
                f"family (task={task_config}, {want})"
            )
    rows: dict[tuple[str, ...], list[tuple[Path, str]]] = {}
    for src in sources:
        model = model_identity(src.path)
        if model is not None:
            rows.setdefault(tuple(src.method), []).append((src.path, model))
    for method, members in rows.items():
        if len({m for _, m in members}) > 1:
            said = "; ".join(f"{p}: {m}" for p, m in members)
            problems.append(
                f"the row {' '.join(method) or '(defaults)'} mixes models across its seeds ({said})"
            )
    if problems:
        raise SystemExit(
            f"error: src/table.py {family} refuses what would not belong in its table: "
            + "; ".join(problems)
            + f". Give runs of task={task_config}, one model per row"
        )
