"""The training run behind a checkpoint, for evaluating or exporting it: the model and task
of ``ckpt_path=<run>/checkpoints/<x>.ckpt`` come from that run's ``.hydra/config.yaml``
(docs/reliability.md). Code a run folder names is imported only when the command line names
it or says ``eval.trust_run_code=true`` (``run_code``).

``check_sources``: what a run or policy folder was trained on, its task and its model, read
from what the run left. The synthetic demo runs scored on Spider gave a table of 0.000 with no
warning (issue 40 item 3): a folder of another task family, or a row whose seeds hold
different models, is refused; a folder that does not say (a base model) is taken as it is."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from mrtpo.run.config import CONFIG_DIR, given_overrides, run_config_path
from mrtpo.run.config_keys import dig

log = logging.getLogger(__name__)

#: Config groups taken from the training run of ``ckpt_path`` unless given on the command line.
RUN_GROUPS = ("model", "task")


def _given(overrides: list[str], group: str) -> tuple[bool, list[str]]:
    """(whether ``group=...`` itself was chosen, the dotted ``group.x.y`` keys given)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    chosen, keys = False, []
    for ov in OverridesParser.create().parse_overrides(overrides):
        key = ov.key_or_group
        if key == group:
            chosen = True
        elif key.startswith(group + "."):
            keys.append(key)
    return chosen, keys


def from_training_run(
    cfg: DictConfig, overrides: list[str] | None = None, builds_task: bool = True
) -> tuple[DictConfig, dict[str, Any]]:
    """``cfg`` with ``model`` and ``task`` from ``cfg.ckpt_path``'s training run (a command-line
    group wins, single keys apply on top), and where each came from. ``overrides``: a
    self-composing caller's command line (default: Hydra's); ``builds_task``: refuse untrusted
    task code (export, which never builds the task, passes False)."""
    ckpt = cfg.get("ckpt_path")
    if not ckpt:
        return cfg, {}
    if not Path(str(ckpt)).is_file():
        raise FileNotFoundError(f"ckpt_path={ckpt}: no such checkpoint file")
    saved = run_config_path(str(ckpt))
    if not saved.is_file():
        log.warning(
            "ckpt_path=%s: no training config at %s; using model= and task= of this command "
            "(%s, %s)",
            *(ckpt, saved, cfg.model.get("name_or_path"), cfg.task.get("_target_")),
        )
        return cfg, {"run_config": None}
    train_cfg = OmegaConf.load(saved)
    overrides = (given_overrides() or []) if overrides is None else list(overrides)
    info: dict[str, Any] = {"run_config": str(saved)}
    for group in RUN_GROUPS:
        chosen, keys = _given(overrides, group)
        if chosen or group not in train_cfg:
            info[f"{group}_source"] = "command line"
            continue
        try:
            node = OmegaConf.create(OmegaConf.to_container(train_cfg[group], resolve=True))
        except Exception as exc:  # e.g. an interpolation into a key eval lacks
            raise ValueError(
                f"ckpt_path={ckpt}: cannot read {group} from {saved} ({exc}); pass {group}=... "
                "on the command line"
            ) from exc
        if group == "task":
            if builds_task:
                check_run_code(cfg, node, keys, saved)
            info["dropped"] = _drop_smoke_limits(node, keys)
        for key in keys:  # e.g. model.name_or_path=/local/copy of the run's model
            sub = key[len(group) + 1 :]
            value = OmegaConf.select(cfg, key, default=None)
            OmegaConf.update(node, sub, value, force_add=True)
        with open_dict(cfg):
            cfg[group] = node
        info[f"{group}_source"] = f"training run ({saved})" + (
            f" with {', '.join(keys)}" if keys else ""
        )
        log.info("eval: %s from the training run %s", group, saved.parent.parent)
    return cfg, info


#: Keys of a task config that name code, with the evaluation split that imports it (None:
#: every split). A ``_target_`` is code too unless one of the project's own task classes.
CODE_KEYS: dict[str, str | None] = dict.fromkeys(("rewards", "blocks", "success", "import_dirs"))
CODE_KEYS["muldimif.checker_dir"] = "muldimif"


def _own_task_configs(cfg: DictConfig) -> dict[str, dict]:
    """configs/task/*.yaml by ``_target_``, resolved with this command's ``paths``."""
    out: dict[str, dict] = {}
    for path in sorted((CONFIG_DIR / "task").glob("*.yaml")):
        try:
            both = OmegaConf.create({"paths": cfg.get("paths") or {}, "task": OmegaConf.load(path)})
            node = OmegaConf.to_container(both.task, resolve=True)
        except Exception:  # a key this command cannot resolve: compared unresolved, differs
            node = OmegaConf.to_container(OmegaConf.load(path))
        if isinstance(node, dict) and node.get("_target_"):
            out.setdefault(str(node["_target_"]), node)
    return out


def _targets(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every ``_target_`` in ``node`` as (dotted key, value)."""
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{path}.{k}" if path else str(k)
            found += [(key, v)] if k == "_target_" else _targets(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _targets(v, f"{path}.{i}" if path else str(i))
    return found


def run_code(task: DictConfig, given: list[str], cfg: DictConfig) -> list[str]:
    """``task.<key>=<value>`` for each piece of code the run's ``task`` names but ``given`` not."""
    node = OmegaConf.to_container(task, resolve=True)
    own = _own_task_configs(cfg)
    mine = own.get(str(node.get("_target_")), {})
    split = OmegaConf.select(cfg, "eval.split", default=None)
    found = [(k, v) for k, v in _targets(node) if not (k == "_target_" and v in own)]
    for key, only_on in CODE_KEYS.items():
        value = dig(node, key)
        if value in (None, [], {}, False) or (only_on is not None and split != only_on):
            continue
        if key == "success" and (not isinstance(value, str) or not any(c in value for c in ".:")):
            continue  # "all" or a reward's name: no import
        if value != dig(mine, key):
            found.append((key, value))

    def named_here(key: str) -> bool:
        full = f"task.{key}"
        return any(full == g or full.startswith(g + ".") for g in given)

    return [f"task.{k}={v!r}" for k, v in found if not named_here(k)]


def check_run_code(cfg: DictConfig, task: DictConfig, given: list[str], saved: Path) -> None:
    """Refuse untrusted code the run folder's task config names (``eval.trust_run_code=true``)."""
    trust = OmegaConf.select(cfg, "eval.trust_run_code", default=False)
    if not isinstance(trust, bool):
        raise ValueError(f"eval.trust_run_code={trust!r} is not allowed: true or false")
    code = run_code(task, given, cfg)
    if not code:
        return
    listing = "; ".join(code)[:600]
    if trust:
        log.warning("eval: importing the code that %s names (eval.trust_run_code=true): %s",
                    saved, listing)  # fmt: skip
        return
    keys = "=..., +".join(dict.fromkeys(c.split("=", 1)[0] for c in code))
    raise ValueError(
        f"ckpt_path={cfg.ckpt_path}: its training run's config {saved} names code that "
        f"evaluating it would import and run: {listing}. Nothing of it was imported. If you "
        "trust that run folder, add eval.trust_run_code=true; or name the code yourself on "
        f"the command line (+{keys}=..., or task=<name>)"
    )


#: Task keys that shrink a training run's data (smoke runs, tests): an evaluation of its
#: checkpoint scores the whole split unless the command line sets them again.
SMOKE_LIMITS = ("max_examples", "data.max_examples")


def _drop_smoke_limits(task: DictConfig, given: list[str]) -> list[str]:
    """Null the run's ``task.max_examples``-style limits (not the ones given here); say so."""
    dropped = []
    for key in SMOKE_LIMITS:
        value = OmegaConf.select(task, key, default=None)
        if value is None or f"task.{key}" in given:
            continue
        OmegaConf.update(task, key, None)
        dropped.append(f"task.{key}={value}")
        log.warning(
            "eval: the training run's task.%s=%s (a training limit) is not applied: the whole "
            "split is scored; pass task.%s=%s to keep it (eval.limit=N: the first N)",
            key, value, key, value,
        )  # fmt: skip
    return dropped


def load_checkpoint_weights(
    policy, ckpt_path: str, model_source: str = "", use: str = "evaluate one"
) -> int | None:
    """A checkpoint's policy weights into ``policy``; its step. A mismatch: one ValueError."""
    from mrtpo.core.lora import checkpoint_keys
    from mrtpo.run.checkpointing import CheckpointError, load_checkpoint

    try:
        ckpt = load_checkpoint(ckpt_path, map_location="cpu", mmap=True)
    except CheckpointError as exc:
        raise ValueError(exc.advice(use)) from exc
    state = ckpt.get("state_dict") or {}
    weights = {k[len("policy.") :]: v for k, v in state.items() if k.startswith("policy.")}
    ours = policy.state_dict()
    shapes = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(ours[k].shape)}"
        for k, v in weights.items()
        if k in ours and tuple(v.shape) != tuple(ours[k].shape)
    ]
    unexpected = [k for k in weights if k not in ours]
    # a LoRA run's checkpoint holds its adapters only: the base is model.name_or_path
    missing = [k for k in checkpoint_keys(policy) if k not in weights and "lm_head" not in k]
    if not weights or shapes or unexpected or missing:
        detail = "; ".join(
            [f"shapes differ: {shapes[:2]}"] * bool(shapes)
            + [f"{len(unexpected)} unexpected parameters (e.g. {unexpected[:2]})"]
            * bool(unexpected)
            + [f"{len(missing)} missing (e.g. {missing[:2]})"] * bool(missing)
            + ["it holds no policy weights"] * (not weights)
        )
        raise ValueError(
            f"ckpt_path={ckpt_path} holds a different model than the one loaded "
            f"(model from {model_source or 'the command line'}): {detail}. Drop model= from "
            "the command line to use the training run's model, or pick the matching model="
        )
    policy.load_state_dict(weights, strict=False)
    return ckpt.get("global_step")


#: The file an export writes last: its presence marks a finished export (and its step).
MARKER = "mrtpo_export.json"


def exported_step(out: Path) -> int | None:
    """The training step of the export in ``out`` (None: none there, or unreadable)."""
    try:
        step = json.loads((out / MARKER).read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def pending_export(cfg: Any, step: int) -> Path | None:
    """Where a run that finished training at ``step`` still owes its end-of-run export (stopped
    while exporting), or None: no RL export configured, done, or something else is there."""
    node = OmegaConf.select(cfg, "callbacks.export", default=None)
    if not node or OmegaConf.select(cfg, "stage.name", default="rl") != "rl":
        return None
    if not str(node.get("_target_", "")).endswith("ExportPolicy"):
        return None
    out = Path(str(node.dirpath))
    if os.path.lexists(out) and not stat.S_ISDIR(os.lstat(out).st_mode):
        return None
    if out.is_dir() and not (out / MARKER).is_file() and any(out.iterdir()):
        return None
    return None if exported_step(out) == step else out


def family_target(task_config: str) -> str:
    """The task class of ``configs/task/<task_config>.yaml``."""
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
        name = json.loads((folder / MARKER).read_text(encoding="utf-8"))["task"]
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
    """Refuse (``SystemExit``) folders trained on another task than ``family``'s, and rows whose
    seeds hold different models. ``sources``: objects with ``path`` and ``method`` (its row)."""
    want = family_target(task_config)
    problems, rows = [], {}
    for src in sources:
        task = trained_task(src.path)
        if task is not None and task[0] != want:
            problems.append(
                f"{src.path} was trained on task={task[1]} ({task[0]}), not on the {family} "
                f"family (task={task_config}, {want})"
            )
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
