"""The typed settings of a run: every key of the ``rl``, ``optim``, ``replay``, ``data`` and
``stage.sft`` sections declared once, on its field, with its facts (``setting``), as in TRL's
``GRPOConfig`` (YAML alone cannot say ``group_size`` is an integer >= 2). Registered with
Hydra's ConfigStore (``schema/<name>``): a wrong type fails at composition, a value out of
range in ``__post_init__``, an unknown key naming the valid ones."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, ClassVar, List, Optional  # noqa: UP035  (OmegaConf reads these annotations)

from mrtpo.core.errors import ConfigError
from mrtpo.core.forward import shared_prompt_mode
from mrtpo.run.placement import world_size

__all__ = ["ConfigError"]  # also importable from here, as it always was

log = logging.getLogger(__name__)


def _finite(value: Any) -> bool:
    """False for a NaN or infinite number, or a list holding one; True for anything else."""
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def _need(ok: bool, section: str, key: str, value: Any, allowed: str) -> None:
    # NaN fails every comparison, but inf passes ">= 0": a number is also refused when it is
    # not finite (rl.kl_coef=inf skipped every update and the run still ended with rc 0).
    if not _finite(value):
        raise ConfigError(f"{section}.{key}={value!r} is not allowed: a finite value, {allowed}")
    if not ok:
        raise ConfigError(f"{section}.{key}={value!r} is not allowed: {allowed}")


def setting(
    default: Any = MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    check: Callable[[Any], bool] | None = None,
    allowed: str | Callable[[], str] = "",
    resume: bool = False,
    old: tuple[str, ...] = (),
    old_note: str = "",
    words: tuple[str, ...] = (),
) -> Any:
    """A settings field with its facts: ``check`` (a test of the value; ``allowed`` says what
    passes, in the refusal), ``resume`` (a ``+resume`` may change it: it changes memory, speed
    or what is shown, not what is computed), ``old`` (dotted keys it replaced; ``old_note``
    says why, in their refusal) and ``words`` (names people type for it, for hints)."""
    meta = {"check": check, "allowed": allowed, "resume": resume, "old": tuple(old),
            "old_note": old_note, "words": tuple(words)}  # fmt: skip
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _min(n: int, null: bool = False) -> dict[str, Any]:
    """``check`` and ``allowed`` of a setting that must be ``>= n`` (or null)."""
    if null:
        return {"check": lambda v: v is None or v >= n, "allowed": f">= {n} or null"}
    return {"check": lambda v: v >= n, "allowed": f">= {n}"}


class _Section:
    section: ClassVar[str] = ""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, given: Mapping[str, Any] | _Section | None):
        """An instance from a plain mapping (library use), refusing unknown keys."""
        if isinstance(given, cls):
            return given
        given = dict(given or {})
        unknown = sorted(set(given) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {unknown} in '{cls.section}'; valid keys: {sorted(cls.field_names())}"
            )
        return cls(**given)

    def __post_init__(self) -> None:
        for f in fields(self):  # in order: the first bad key is named
            check = f.metadata.get("check")
            if check is None:
                continue
            value, allowed = getattr(self, f.name), f.metadata["allowed"]
            allowed = allowed() if callable(allowed) else allowed
            _need(check(value), self.section, f.name, value, allowed)
        self._settle()

    def _settle(self) -> None:
        """Checks across fields, and values put in their one form, after each field's own."""


#: RL batch keys that have a per-rank and a global form, with the per-rank default.
PER_RANK_DEFAULTS = {"prompts_per_step": 4, "mini_batch_size": 16}


def _loss_aggregations() -> dict:
    from mrtpo.core.loss import AGGREGATIONS

    return AGGREGATIONS


_PER_RANK = _min(1, null=True)


@dataclass
class RLConfig(_Section):
    """One RL step: B prompts x G samples, scored, then clipped-surrogate updates."""

    section: ClassVar[str] = "rl"
    # B, per rank. null: 4, or global_prompts_per_step divided over the ranks.
    prompts_per_step: Optional[int] = setting(None, **_PER_RANK, words=("prompts_per_step",))  # noqa: UP045
    # B over all ranks (trainer.devices x trainer.num_nodes), divided over them (per_rank);
    # set this or prompts_per_step (both only when they agree). docs/scaling.md
    global_prompts_per_step: Optional[int] = setting(None, **_PER_RANK, words=("batch_size",))  # noqa: UP045
    group_size: int = setting(  # G
        4, check=lambda v: v >= 2, words=("num_generations", "group_size", "n_samples"),
        allowed=">= 2 (advantages are relative to a prompt's group; with 1 sample every one is 0)",
    )  # fmt: skip
    ppo_epochs: int = setting(1, **_min(1), words=("epochs",))
    # Responses per optimizer step, per rank (null: 16, or global_mini_batch_size / ranks).
    mini_batch_size: Optional[int] = setting(None, **_PER_RANK)  # noqa: UP045
    global_mini_batch_size: Optional[int] = setting(None, **_PER_RANK)  # noqa: UP045  (over all ranks)
    # responses per forward/backward (gradient accumulation)
    micro_batch_size: int = setting(8, **_min(1), resume=True)
    clip_low: float = setting(0.2, check=lambda v: 0 <= v < 1, allowed="in [0, 1)")  # epsilon_low
    clip_high: float = setting(0.28, **_min(0))  # epsilon_high
    # KL to the frozen initial policy (0: no reference model)
    kl_coef: float = setting(0.0, **_min(0), words=("kl_coef",))
    loss_agg: str = setting(  # or seq-mean-token-mean
        "token-mean",
        check=lambda v: v in _loss_aggregations(),
        allowed=lambda: f"{list(_loss_aggregations())}",
    )
    # null or 0: no clipping
    max_grad_norm: Optional[float] = setting(1.0, **_min(0, null=True))  # noqa: UP045
    # stop after this many skipped non-finite steps
    max_nonfinite_steps: int = setting(3, **_min(1), resume=True)
    # stop after this many all-failed scoring steps
    max_consecutive_score_failures: int = setting(3, **_min(1), resume=True)
    # halve replay.token_budget and retry this often on OOM
    replay_oom_retries: int = setting(6, **_min(0), resume=True)
    # Truncated importance sampling of the engine's samples (docs/rollout.md); null: off
    tis_cap: Optional[float] = setting(  # noqa: UP045
        None, check=lambda v: v is None or v > 0,
        allowed="> 0 (a cap on pi_trainer / pi_engine, e.g. 2.0) or null (off)",
    )  # fmt: skip
    # The same for a batch sampled by older weights (rollout.schedule=one_step_off / async)
    # where rl.tis_cap is null: decoupled PPO's correction to pi_old (docs/method.md)
    stale_tis_cap: float = setting(
        2.0, check=lambda v: v > 0,
        allowed="> 0 (the cap on pi_old / pi_engine for samples of older weights, e.g. 2.0)",
    )  # fmt: skip
    # Log train/rollout/logp_gap/* every step (with dropout it costs an eval-mode forward)
    measure_logp_gap: bool = setting(True, resume=True)
    # Each prompt once per forward: a group's G samples share its key/value cache in every
    # training-side forward and the HF engine's prefill, same numbers (docs/rollout.md). auto:
    # where it saves enough tokens and the model supports it; false: never; always: wherever
    # the model supports it.
    shared_prompt_forward: str = setting(
        "auto",
        check=lambda v: shared_prompt_mode(v) is not None,
        allowed="auto, false or always",
        resume=True,
        old=("replay.share_prefix", "rollout.engine.share_prompt"),
        old_note="one switch, auto/off/always, for every shared-prompt forward",
    )

    def _settle(self) -> None:
        for key, default in PER_RANK_DEFAULTS.items():
            if getattr(self, key) is None and getattr(self, "global_" + key) is None:
                setattr(self, key, default)
        self.shared_prompt_forward = shared_prompt_mode(self.shared_prompt_forward)

    def per_rank(self, ranks: int) -> RLConfig:
        """This config for one of ``ranks`` processes: each ``global_*`` batch key divided
        over them into its per-rank key (the global one cleared). Refused, naming the keys,
        when a total does not divide or disagrees with a per-rank value also given."""
        out = replace(self)
        for key in PER_RANK_DEFAULTS:
            total, given = getattr(self, "global_" + key), getattr(self, key)
            if total is None:
                continue
            if total % ranks:
                raise ConfigError(
                    f"rl.global_{key}={total} does not divide over {ranks} ranks "
                    f"(trainer.devices x trainer.num_nodes): set it to a multiple of {ranks}, "
                    "or change trainer.devices"
                )
            if given is not None and given != total // ranks:
                raise ConfigError(
                    f"rl.{key}={given} (per rank) disagrees with rl.global_{key}={total} "
                    f"({total // ranks} per rank over {ranks} ranks): set one of them "
                    f"(rl.global_{key}=null keeps the per-rank value)"
                )
            setattr(out, key, total // ranks)
            setattr(out, "global_" + key, None)
        return out


@dataclass
class OptimConfig(_Section):
    """AdamW and a linear learning-rate warm-up over ``warmup_steps`` RL steps (the unit of
    ``trainer.max_steps`` and ``method.beta_warmup_steps``: all updates of one step share
    its learning rate)."""

    section: ClassVar[str] = "optim"
    lr: float = setting(1.0e-6, check=lambda v: v > 0, allowed="> 0", words=("learning_rate", "lr"))
    weight_decay: float = setting(0.0, **_min(0), words=("weight_decay",))
    betas: List[float] = setting(  # noqa: UP006, RUF009
        factory=lambda: [0.9, 0.999],
        check=lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
        allowed="two numbers in [0, 1), e.g. [0.9,0.95]",
    )
    warmup_steps: int = setting(0, **_min(0), words=("warmup_steps",))


@dataclass
class ReplayConfig(_Section):
    """Self-replay's batching (see mrtpo.core.replay)."""

    section: ClassVar[str] = "replay"
    # rows x padded length per replay forward
    token_budget: int = setting(16384, **_min(1), resume=True)
    # (row, position) pairs per float32 log-softmax / JSD chunk
    jsd_chunk: int = setting(256, **_min(1), resume=True)
    # responses a step whose P_all replay also scores the update's way (train/replay/
    # noise_floor, mrtpo.core.replay.NoiseFloor); 0: off
    noise_floor: int = setting(0, **_min(0), resume=True)


@dataclass
class DataConfig(_Section):
    """The prompt stream."""

    section: ClassVar[str] = "data"
    # longer prompts are dropped; null: keep all
    max_prompt_tokens: Optional[int] = setting(4096, **_min(1, null=True))  # noqa: UP045
    # validation prompts (0: no validation)
    val_prompts: int = setting(0, **_min(0), resume=True)
    val_batch_size: int = setting(8, **_min(1), resume=True)


@dataclass
class SFTConfig(_Section):
    """The SFT stage (``stage=sft``): supervised warm start on reference responses."""

    section: ClassVar[str] = "stage.sft"
    lr: float = setting(1.0e-3, check=lambda v: v > 0, allowed="> 0")
    weight_decay: float = setting(0.0, **_min(0))
    warmup_steps: int = 0
    # (prompt, reference) pairs per optimizer step
    batch_size: int = setting(32, **_min(1))
    max_grad_norm: Optional[float] = setting(1.0, **_min(0, null=True))  # noqa: UP045
    # Stop once the held-out `target_metric` reaches `target_success` (null: never; the run
    # then ends at trainer.max_steps). Checked every `eval_every` steps from `min_steps` on.
    target_success: Optional[float] = setting(  # noqa: UP045
        None, check=lambda v: v is None or 0 <= v <= 1, allowed="in [0, 1] or null"
    )
    target_metric: Optional[str] = None  # noqa: UP045  (null: the task's success check)
    # above: stop once metric >= target; below: once it falls to it
    stop_when: str = setting(
        "above", check=lambda v: v in ("above", "below"), allowed="above or below"
    )
    eval_every: int = setting(10, **_min(1))
    min_steps: int = setting(0, **_min(0))
    eval_prompts: int = 64  # held-out prompts (the task's val split); checked in _settle
    # responses per prompt (when sampling)
    eval_samples: int = setting(1, **_min(1))
    # 0: greedy; > 0: sample at this temperature
    eval_temperature: float = setting(0.0, **_min(0))
    eval_max_new_tokens: int = setting(32, **_min(1))
    save_dir: Optional[str] = None  # noqa: UP045  (null: <run folder>/policy)
    # Share of training examples shown after the task's self-distillation teacher context
    # (Task.teacher_messages) instead of the plain prompt, the target still the reference: a
    # small model learns to read a reference in context, as OPSD's teacher does (docs/method.md)
    teacher_share: float = setting(0.0, check=lambda v: 0 <= v <= 1, allowed="in [0, 1]")

    def _settle(self) -> None:
        _need(
            self.target_success is None or self.eval_prompts >= 1,
            self.section,
            "eval_prompts",
            self.eval_prompts,
            ">= 1 when stage.sft.target_success is set",
        )


SCHEMAS: dict[str, type[_Section]] = {
    "rl": RLConfig,
    "optim": OptimConfig,
    "replay": ReplayConfig,
    "data": DataConfig,
    "stage.sft": SFTConfig,
}


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        cs.store(group="schema", name=name.replace("stage.", ""), node=schema)


def section(cfg, name: str):
    """The typed, range-checked settings of ``name`` (``"rl"``: one rank's, a global batch
    divided over ``world_size(cfg)``; the config keeps what was given, as checkpoints record)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, name)
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    out = SCHEMAS[name].from_mapping(node)
    return out.per_rank(world_size(cfg)) if isinstance(out, RLConfig) else out


def leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(key, value) of each leaf of a tree of mappings and lists, keyed ``a.b[0]``."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, node


def resolve_batch(cfg, ranks: int) -> RLConfig | None:
    """One rank's ``rl`` settings for ``ranks`` processes (``RLConfig.per_rank``), logged."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "rl")
    if node is None:
        return None
    given = RLConfig.from_mapping(OmegaConf.to_container(node, resolve=True))
    mine = given.per_rank(ranks)
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


def declared() -> Iterator[tuple[str, Field]]:
    """(dotted key, its field) for every setting of every typed section."""
    for name, schema in SCHEMAS.items():
        for f in fields(schema):
            yield f"{name}.{f.name}", f


def declaration(key: str) -> Field:
    """The field of the dotted setting ``key`` (``rl.group_size``); KeyError if none."""
    return dict(declared())[key]


def renamed() -> dict[str, str]:
    """Each replaced key and the setting that does its job now (the fields' ``old``)."""
    return {old: key for key, f in declared() for old in f.metadata.get("old", ())}


def resumable() -> tuple[str, ...]:
    """The settings a ``+resume`` may change (the fields' ``resume``)."""
    return tuple(key for key, f in declared() if f.metadata.get("resume"))


def setting_words() -> dict[str, str]:
    """Words people type for a setting (``learning_rate``) and the setting, for hints."""
    return {word: key for key, f in declared() for word in f.metadata.get("words", ())}
