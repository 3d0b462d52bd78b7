"""The RL batch over ranks: one rank's share of a global batch (``resolve_batch``), the global
batch a config makes on its world size (``global_batch``), and the rule a resume on another
world size follows (``batch_on_resume``: same global batch, or refused naming the keys)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mrtpo.run.placement import world_size
from mrtpo.run.settings import PER_RANK_DEFAULTS, RLConfig


def resolve_batch(cfg, ranks: int) -> RLConfig | None:
    """One rank's ``rl`` settings for ``ranks`` processes (``RLConfig.per_rank``), logged: a
    global batch divided over them, or a per-rank one with the total it makes on several
    ranks. ``cfg`` is left as given; ``section(cfg, "rl")`` divides the same way."""
    import logging

    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "rl")
    if node is None:
        return None
    given = RLConfig.from_mapping(OmegaConf.to_container(node, resolve=True))
    mine = given.per_rank(ranks)
    log = logging.getLogger(__name__)
    for key in PER_RANK_DEFAULTS:
        total, share = getattr(given, "global_" + key), getattr(mine, key)
        if total is not None:
            log.info("rl.global_%s=%d over %d rank(s): %d per rank", key, total, ranks, share)
        elif ranks > 1:
            log.info(
                "rl.%s=%d is per rank: %d ranks make %d (rl.global_%s states the total instead)",
                *(key, share, ranks, share * ranks, key),
            )
    return mine


#: The rl keys that state the batch, per rank or over all ranks: a resume is compared by the
#: global batch they make (``batch_on_resume``), not key by key.
BATCH_KEYS = tuple(f"rl.{form}{key}" for key in PER_RANK_DEFAULTS for form in ("", "global_"))


def global_batch(cfg, ranks: int | None = None) -> dict[str, int] | None:
    """One RL step over all ranks, whatever form the batch keys take: ``world_size``
    (default: ``cfg.trainer``'s processes), ``prompts_per_step`` and ``mini_batch_size`` (as
    the update counts it: capped at a rank's responses). None without a usable ``rl``/trainer."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "rl")
    if node is None:
        return None
    try:
        ranks = world_size(cfg) if ranks is None else ranks
        rank = RLConfig.from_mapping(OmegaConf.to_container(node, resolve=True)).per_rank(ranks)
    except (ValueError, TypeError):  # ConfigError included
        return None
    responses = rank.prompts_per_step * rank.group_size
    return {
        "world_size": ranks,
        "prompts_per_step": rank.prompts_per_step * ranks,
        "mini_batch_size": min(rank.mini_batch_size, responses) * ranks,
    }


def _recorded_batch(record: Mapping) -> dict[str, int] | None:
    """The global batch of a settings record (``mrtpo.run.resume.settings_record``): as
    recorded, or worked out from its ``trainer.*`` and ``rl.*`` settings for a record written
    before the batch was (a ``trainer.devices=auto`` then counts this machine's GPUs)."""
    if isinstance(record.get("batch"), Mapping):
        return dict(record["batch"])
    tree: dict[str, Any] = {}
    for key, value in (record.get("settings") or {}).items():
        *parents, leaf = key.split(".")
        if parents and parents[0] in ("trainer", "rl"):
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    from omegaconf import OmegaConf

    return global_batch(OmegaConf.create(tree)) if "rl" in tree else None


def batch_on_resume(theirs: Mapping, mine: Mapping, ckpt_path) -> tuple[tuple[str, ...], str]:
    """Compare a checkpoint's global batch (``theirs``) with a resume's (``mine``): returns
    (batch keys to skip in the key-by-key comparison, refusal or ''). The keys may change form
    for the same global batch; another world size giving another one is refused naming the
    ``rl.global_*`` keys that keep it."""
    old, new = _recorded_batch(theirs), _recorded_batch(mine)
    sizes = ("prompts_per_step", "mini_batch_size")
    if old is None or new is None:
        return (), ""
    if all(old[k] == new[k] for k in sizes):
        return BATCH_KEYS, ""
    if old["world_size"] == new["world_size"]:
        return (), ""  # a changed key: the key-by-key comparison names it
    w0, w1 = old["world_size"], new["world_size"]
    keep = " ".join(f"rl.global_{k}={old[k]}" for k in sizes)
    how = (
        f"keep its batch over {w1} with {keep} (and rl.prompts_per_step=null "
        "rl.mini_batch_size=null; docs/scaling.md)"
        if all(old[k] % w1 == 0 for k in sizes)
        else f"start a new run from it with ckpt_path={ckpt_path} (its batch does not divide "
        f"over {w1})"
    )
    return (), (
        f"{ckpt_path} was trained on {w0} process{'es' * (w0 != 1)} (trainer.devices x "
        f"trainer.num_nodes) and this resume runs on {w1}: its batch keys would make "
        f"{new['prompts_per_step']} prompts per step and {new['mini_batch_size']} responses "
        f"per optimizer step where the run had {old['prompts_per_step']} and "
        f"{old['mini_batch_size']}. Resume on {w0} process{'es' * (w0 != 1)}, or {how}"
    )
