"""Whole-config checks made before any model or data loads (``validate``): every typed
section's ranges, the seed and folder names, the trainer's step limit, NaN/inf anywhere
numeric, the method's and the engine's own checks, and the schedule's rule."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mrtpo.core.errors import ConfigError
from mrtpo.run.overrides import check_renamed
from mrtpo.run.settings import SCHEMAS, renamed, section

#: numpy's (and so Lightning's ``seed_everything``'s) range of seeds
SEED_RANGE = (0, 2**32 - 1)
#: untyped groups whose numbers go straight into training: none may be NaN or infinite
NUMERIC_GROUPS = ("method", "rollout", "trainer", "stage")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_seed(cfg) -> None:
    """``seed``: an integer numpy can take (``int()`` or numpy would fail naming no key)."""
    from omegaconf import OmegaConf

    lo, hi = SEED_RANGE
    seed = OmegaConf.select(cfg, "seed", default=0)
    if not (_is_int(seed) and lo <= seed <= hi):
        raise ConfigError(f"seed={seed!r} is not allowed: an integer in [{lo}, {hi}]")


def check_names(cfg) -> None:
    """``job_name`` and ``run_name`` are one folder name each: the run's folder is
    ``<paths.log_dir>/<job_name>/runs/<time>_<run_name>``, and a separator or ``..`` in them
    put it outside ``logs/`` (``run_name=x/../../../../escaped``)."""
    from omegaconf import OmegaConf

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
    """``seed``, ``job_name`` and ``run_name``, and the ``trainer`` keys the RL loop depends
    on, named when they cannot work."""
    from omegaconf import OmegaConf

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


def _nonfinite_leaves(node: Any, key: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _nonfinite_leaves(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _nonfinite_leaves(v, f"{key}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        yield key, node


def check_finite(cfg, groups: Sequence[str] = NUMERIC_GROUPS) -> None:
    """Refuse a NaN or infinite number anywhere in ``groups`` (``method.reward_weights``,
    ``rollout.sampling``, ...), naming its key. Interpolations are left as they are."""
    from omegaconf import OmegaConf

    for name in groups:
        node = OmegaConf.select(cfg, name)
        if node is None:
            continue
        raw = OmegaConf.to_container(node, resolve=False)
        for key, value in _nonfinite_leaves(raw, name):
            raise ConfigError(
                f"{key}={value!r} is not allowed: a finite number (NaN and infinity cannot "
                "be trained with)"
            )


def validate(cfg) -> None:
    """Check the typed sections, seed, step limit and validation interval, and that no number
    is NaN/inf, before anything loads (unread keys: ``config_keys.check_keys``, run first)."""
    from omegaconf import OmegaConf

    for name in SCHEMAS:
        if OmegaConf.select(cfg, name) is not None:
            section(cfg, name)
    check_run(cfg)
    check_finite(cfg)
    check_engine(cfg)
    check_schedule(cfg)
    check_old_names(cfg)
    check_engine_settings(cfg)
    check_method(cfg)


def check_method(cfg) -> None:
    """``method.*`` values, checked by the method's own constructor before any model loads
    or the run starts; its refusal (``method.beta=1.0``) is a ``ConfigError``, so a refused
    run leaves no folder (``mrtpo.run.folder.discard_refused_folder``)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "method", default=None)
    if node is None or OmegaConf.select(node, "_target_", default=None) is None:
        return
    _instantiate_checked(node)


def _instantiate_checked(node) -> None:
    """Build ``node`` to let its constructor check its values; a ValueError or TypeError it
    raises becomes a one-line ``ConfigError``."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

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
    from omegaconf import OmegaConf

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
    """``rl.tis_cap`` needs an engine that reports the sampled tokens' log-probs (one whose
    class does not say ``reports_logprobs = False``)."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    cap = OmegaConf.select(cfg, "rl.tis_cap")
    target = OmegaConf.select(cfg, "rollout.engine._target_")
    if cap is None or target is None or getattr(get_class(str(target)), "reports_logprobs", True):
        return
    raise ConfigError(
        f"rl.tis_cap={cap} needs the engine's log-probs of the sampled tokens, and "
        f"rollout.engine._target_={target} reports none; set rl.tis_cap=null or use an engine "
        "that reports them (rollout=hf, rollout=vllm)"
    )


def check_engine_settings(cfg) -> None:
    """The engine's own checks of ``rollout.engine.*`` before anything loads (run and
    ``--check``): built from the config when ``checks_settings_when_built`` says it is free."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "rollout.engine")
    if node is None:
        return
    target = node.get("_target_")
    if target is not None and getattr(get_class(str(target)), "checks_settings_when_built", False):
        _instantiate_checked(node)


def check_schedule(cfg) -> None:
    """``rollout.schedule``/``max_staleness`` against the engine, by the rollout source's own
    rule (``mrtpo.rollout.source.check_schedule``), before anything loads."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from mrtpo.rollout.source import check_schedule as rule

    target = OmegaConf.select(cfg, "rollout.engine._target_")
    engine = get_class(str(target)) if target is not None else None
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
    from omegaconf import OmegaConf

    for old, new in renamed().items():
        parent, _, leaf = old.rpartition(".")
        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        if not OmegaConf.is_config(node) or leaf not in node:
            continue
        raw = OmegaConf.to_container(node, resolve=False).get(leaf)
        if not (isinstance(raw, str) and new in raw and raw.startswith("${")):
            check_renamed(old)
