"""Every key of a composed training config is read by something, or the run is refused.

Hydra's ``+key=value`` adds any key (its own hint for a misspelt group is ``+metod=gdpo``: that
run trained MRTPO and exited 0). ``check_keys`` refuses such a config before anything loads,
naming the key and the nearest real one: read keys are ``TOP_LEVEL``'s, the typed sections'
fields, the arguments of a ``_target_`` node's class, ``FIXED`` nodes' keys, and anything under
``paths`` and ``hydra``. Before Hydra composes, ``check_overrides`` refuses a command line's
replaced key, a ``method.<key>`` the chosen method lacks, and an unknown key of a typed section.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import yaml
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from mrtpo.run.config import CONFIG_DIR
from mrtpo.run.settings import SCHEMAS, ConfigError, declaration, renamed, setting_words

#: The top-level keys of a training config, and what reads each.
TOP_LEVEL: dict[str, str] = {
    "job_name": "the log folder (logs/<job_name>/runs)",
    "run_name": "the run folder's name",
    "seed": "every random generator",
    "ckpt_path": "the checkpoint a new run starts from",
    "print_config": "the config tree printed at the start",
    "warm_start": "the runs done first (mrtpo.lightning.pipeline.run_warm_starts)",
    "threads": "torch's CPU threads (mrtpo.run.placement.choose_threads)",
    "paths": "where data, logs and caches live",
    "model": "the policy (mrtpo.core.models.load_policy)",
    "task": "the prompts and rewards",
    "method": "how rewards become token advantages",
    "rollout": "the generation engine and sampling",
    "trainer": "the Lightning trainer",
    "logger": "the metrics sinks",
    "callbacks": "the callbacks",
    "stage": "RL or SFT",
    "rl": "the RL step's settings",
    "optim": "the optimizer's settings",
    "replay": "self-replay's batching",
    "data": "the prompt stream",
    "hydra": "Hydra itself",
    # keys a command adds with +key=value, or a preset declares
    "resume": "+resume=<run folder>: continue a run in its folder",
    "allow_cpu": "+allow_cpu=true: a model of 1B parameters or more on the CPU trainer",
    "dry_run": "dry_run=true (src/train.py --check): check the run and say what it would do",
    "paper_data": "a paper preset's data files (mrtpo.run.checks.check_paper_data)",
}

#: Config groups (``configs/<group>/``): ``+metod=gdpo`` is most likely ``method=gdpo``.
GROUPS = ("task", "method", "model", "rollout", "trainer", "logger", "callbacks", "stage",
          "experiment", "debug", "paths")  # fmt: skip

#: Words people type for a key of an untyped group that has another name here; a typed
#: setting's words are declared on its field (``mrtpo.run.settings.setting(words=...)``).
OTHER_WORDS: dict[str, str] = {
    "max_steps": "trainer.max_steps",
    "steps": "trainer.max_steps",
    "num_steps": "trainer.max_steps",
    "devices": "trainer.devices",
    "gpus": "trainer.devices",
    "precision": "trainer.precision",
    "beta": "method.beta",
    "temperature": "rollout.sampling.temperature",
    "max_new_tokens": "rollout.sampling.max_new_tokens",
    "max_tokens": "rollout.sampling.max_new_tokens",
    "model_name": "model.name_or_path",
    "model_path": "model.name_or_path",
    "data_path": "task.data.path",
    "data_dir": "paths.data_dir",
    "output_dir": "paths.output_dir",
    "log_dir": "paths.log_dir",
    "num_threads": "threads",
}


def synonyms() -> dict[str, str]:
    """Every word people type for a key, and the key: the typed settings' own, then the rest."""
    return {**setting_words(), **OTHER_WORDS}


#: Hydra's own keys in a node with a ``_target_``.
HYDRA_KEYS = frozenset({"_target_", "_convert_", "_partial_", "_recursive_", "_args_"})


#: Nodes without a ``_target_`` whose keys the code reads by name.
FIXED: dict[str, Callable[[], tuple[str, ...] | None]] = {
    "model": lambda: _takes("mrtpo.core.models.load_policy"),
    "rollout": lambda: ("engine", "sampling", "val_max_new_tokens", "schedule", "max_staleness"),
    "rollout.sampling": lambda: _takes("mrtpo.rollout.base.SamplingConfig"),
}


def _takes(target: str) -> tuple[str, ...] | None:
    """The keyword arguments ``target`` takes; None if it takes any or cannot be inspected here."""
    try:
        obj = get_object(target)
        sig = inspect.signature(obj)
    except Exception:
        return None
    params = list(sig.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL)


def nearest(key: str, candidates: list[str]) -> str | None:
    """The candidate closest to ``key`` (a synonym first, then by spelling), or None."""
    leaf, words = key.rsplit(".", 1)[-1], synonyms()
    if leaf in words and words[leaf] != key:
        return words[leaf]
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if match:
        return match[0]
    match = difflib.get_close_matches(leaf, [c.rsplit(".", 1)[-1] for c in candidates], 1, 0.75)
    return next((c for c in candidates if match and c.rsplit(".", 1)[-1] == match[0]), None)


def unread_keys(tree: Mapping[str, Any]) -> Iterator[tuple[str, list[str]]]:
    """(dotted key, the keys that would be read in its place) for each key nothing reads."""
    for key in tree:
        if key not in TOP_LEVEL:
            yield str(key), [*TOP_LEVEL, *GROUPS]
    for name, read in FIXED.items():
        node = dig(tree, name)
        known = read() if isinstance(node, Mapping) else None
        if known is not None:
            for key in node:
                if key not in known:
                    yield f"{name}.{key}", [f"{name}.{k}" for k in known]
    for name in TOP_LEVEL:
        if name in ("hydra", "paths") or name in SCHEMAS:
            continue
        yield from _unread_in_targets(tree.get(name), name)


def dig(tree: Mapping[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` in a plain tree of mappings (None where a part is missing)."""
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _unread_in_targets(node: Any, where: str) -> Iterator[tuple[str, list[str]]]:
    """Keys of every ``_target_`` node at or below ``node`` that its target does not take."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _unread_in_targets(item, f"{where}[{i}]")
        return
    if not isinstance(node, Mapping):
        return
    target = node.get("_target_")
    takes = _takes(str(target)) if isinstance(target, str) else None
    for key, value in node.items():
        key = str(key)
        if takes is not None and key not in HYDRA_KEYS and key not in takes:
            yield f"{where}.{key}", [f"{where}.{k}" for k in takes]
        elif where != "stage" or key != "sft":  # stage.sft: a typed section
            yield from _unread_in_targets(value, f"{where}.{key}")


def _refusal(key: str, candidates: list[str], tree: Mapping[str, Any]) -> str:
    value = dig(tree, key) if "[" not in key else None
    shown = f"{key}={value}" if isinstance(value, (str, int, float, bool)) else key
    near = nearest(key, candidates)
    if near in GROUPS and "." not in key:  # +metod=gdpo: a group's option was meant
        hint = f"; did you mean {near}={value} (a config group: configs/{near}/)?"
    elif near:
        hint = f"; did you mean {near}?"
    else:
        hint = "; `python src/train.py --help` lists every group and key"
    return (
        f"+{shown}: nothing reads the key {key!r}, so the run would ignore it{hint} "
        "(the run was refused before anything loaded)"
    )


def check_keys(cfg) -> None:
    """Refuse a training config holding a key nothing reads, naming it and the nearest real one."""
    if not isinstance(cfg, DictConfig) or "task" not in cfg or "trainer" not in cfg:
        return  # a library caller's partial config: only whole training configs are checked
    tree = OmegaConf.to_container(cfg, resolve=False)
    for key, candidates in unread_keys(tree):
        raise ConfigError(_refusal(key, candidates, tree))


def check_renamed(key: str) -> None:
    """Refuse a replaced key (a setting's old name), naming the one to use."""
    old = key.lstrip("+~")
    new = renamed().get(old)
    if new is None:
        return
    note = declaration(new).metadata.get("old_note")
    raise ConfigError(
        f"{old} was replaced by {new}{f' ({note})' if note else ''}: set that instead"
    )


def _method_keys(name: str, depth: int = 0) -> set[str] | None:
    """The keys ``configs/method/<name>.yaml`` and its ``defaults`` set; None if unreadable."""
    path = CONFIG_DIR / "method" / f"{name}.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or depth > 4:
        return None
    keys = {k for k in data if k != "defaults"}
    for base in data.get("defaults") or []:
        if base == "_self_":
            continue
        more = _method_keys(str(base), depth + 1) if isinstance(base, str) else None
        if more is None:
            return None  # a form of defaults not read here: Hydra decides
        keys |= more
    return keys


def check_method_keys(argv: Sequence[str]) -> None:
    """Refuse ``method.<key>=...`` for a method without that key (``method=gdpo
    method.beta=0.5``), naming the method and its keys: Hydra would advise ``+method.beta``,
    which gives GDPO a beta it never reads. The method is the last ``method=`` given, else
    the default (``mrtpo``); under an ``experiment=`` preset without ``method=`` Hydra decides."""
    words = [a for a in argv if "=" in a and not a.startswith("-")]
    chosen = [a.split("=", 1)[1] for a in words if a.split("=", 1)[0].lstrip("+") == "method"]
    if not chosen and any(a.split("=", 1)[0].lstrip("+") == "experiment" for a in words):
        return
    name = chosen[-1] if chosen else "mrtpo"
    keys = _method_keys(name)
    if keys is None:
        return  # an unknown method: Hydra names the choices
    for arg in words:
        key = arg.split("=", 1)[0]
        if not key.startswith("method.") or key.startswith(("+", "~")):
            continue
        leaf = key.split(".")[1]
        if leaf in keys:
            continue
        why = (
            " (beta is MRTPO's share of the credit placed by relevance; this method gives "
            "every token its response's credit): drop method.beta, or choose method=mrtpo"
            if leaf == "beta"
            else f": its keys are {sorted(k for k in keys if not k.startswith('_'))}"
        )
        raise ConfigError(f"{arg}: method={name} has no {leaf}{why}")


def check_overrides(argv: Sequence[str]) -> None:
    """Refuse ``rl.nope=1`` naming the valid keys, and a replaced key naming its successor."""
    check_method_keys(argv)
    for arg in argv:
        key = arg.split("=", 1)[0]
        if "=" in arg:
            check_renamed(key)
        if "=" not in arg or arg.startswith(("+", "~", "-")):
            continue
        for name, schema in SCHEMAS.items():
            leaf = key.removeprefix(name + ".").split(".")[0]
            if key.startswith(name + ".") and leaf not in schema.field_names():
                raise ConfigError(
                    f"unknown key {key!r}: '{name}' has no key {leaf!r}; valid keys: "
                    f"{sorted(schema.field_names())}"
                )
