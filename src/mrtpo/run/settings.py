"""The typed settings of a run: every key declared once, with its default, type and range.

These dataclasses are the single source of the ``rl``, ``optim``, ``replay``, ``data`` and
``stage.sft`` sections. They are registered with Hydra's ConfigStore (``schema/<name>``) and
listed in the defaults of ``configs/train.yaml``, so

* every key can be overridden plainly (``rl.replay_oom_retries=8``, ``optim.betas=[0.9,0.95]``);
* a value of the wrong type fails while Hydra composes the config, naming the key;
* a value out of range fails in ``__post_init__`` (``validate``, called before any model or
  data is loaded), naming the key, the value and what is allowed;
* an unknown key fails naming the valid ones (``check_overrides`` for the command line,
  ``from_mapping`` for library callers).

Why structured configs rather than YAML alone: YAML cannot say that ``group_size`` is an
integer >= 2, and the code that needs the value would have to repeat the default anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, List, Optional  # noqa: UP035  (OmegaConf reads these annotations)

from mrtpo.core.errors import ConfigError
from mrtpo.core.forward import shared_prompt_mode


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


#: RL batch keys that have a per-rank and a global form, with the per-rank default.
PER_RANK_DEFAULTS = {"prompts_per_step": 4, "mini_batch_size": 16}


def _loss_aggregations() -> dict:
    from mrtpo.core.loss import AGGREGATIONS

    return AGGREGATIONS


#: ``rl`` keys checked one value at a time: (key, its test, what is allowed), in the order
#: ``RLConfig`` checks them.
_RL_CHECKS: tuple[tuple[str, Callable[[Any], bool], str | Callable[[], str]], ...] = (
    ("group_size", lambda v: v >= 2,
     ">= 2 (advantages are relative to a prompt's group; with 1 sample every one is 0)"),
    ("ppo_epochs", lambda v: v >= 1, ">= 1"),
    ("micro_batch_size", lambda v: v >= 1, ">= 1"),
    ("clip_low", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("clip_high", lambda v: v >= 0, ">= 0"),
    ("kl_coef", lambda v: v >= 0, ">= 0"),
    ("loss_agg", lambda v: v in _loss_aggregations(), lambda: f"{list(_loss_aggregations())}"),
    ("max_grad_norm", lambda v: v is None or v >= 0, ">= 0 or null"),
    ("max_nonfinite_steps", lambda v: v >= 1, ">= 1"),
    ("max_consecutive_score_failures", lambda v: v >= 1, ">= 1"),
    ("replay_oom_retries", lambda v: v >= 0, ">= 0"),
    ("tis_cap", lambda v: v is None or v > 0,
     "> 0 (a cap on pi_trainer / pi_engine, e.g. 2.0) or null (off)"),
    ("stale_tis_cap", lambda v: v > 0,
     "> 0 (the cap on pi_old / pi_engine for samples of older weights, e.g. 2.0)"),
)  # fmt: skip


@dataclass
class RLConfig(_Section):
    """One RL step: B prompts x G samples, scored, then clipped-surrogate updates."""

    section: ClassVar[str] = "rl"
    # B, per rank. null: 4, or global_prompts_per_step divided over the ranks.
    prompts_per_step: Optional[int] = None  # noqa: UP045
    # B over all ranks (trainer.devices x trainer.num_nodes), divided over them when the run
    # starts (resolve_batch); a total that does not divide is refused. Set this or
    # prompts_per_step; both are accepted only when they agree.
    global_prompts_per_step: Optional[int] = None  # noqa: UP045
    group_size: int = 4  # G
    ppo_epochs: int = 1
    # Responses per optimizer step, per rank (null: 16, or global_mini_batch_size / ranks).
    mini_batch_size: Optional[int] = None  # noqa: UP045
    global_mini_batch_size: Optional[int] = None  # noqa: UP045  (over all ranks)
    micro_batch_size: int = 8  # responses per forward/backward (gradient accumulation)
    clip_low: float = 0.2  # epsilon_low
    clip_high: float = 0.28  # epsilon_high
    kl_coef: float = 0.0  # KL to the frozen initial policy (0: no reference model)
    loss_agg: str = "token-mean"  # or seq-mean-token-mean
    max_grad_norm: Optional[float] = 1.0  # noqa: UP045  (null or 0: no clipping)
    max_nonfinite_steps: int = 3  # stop after this many skipped non-finite steps
    max_consecutive_score_failures: int = 3  # stop after this many all-failed scoring steps
    replay_oom_retries: int = 6  # halve replay.token_budget and retry this often on OOM
    # Truncated importance sampling: each token's surrogate is multiplied by the detached
    # min(pi_trainer_old / pi_engine, tis_cap), correcting for an engine (vLLM, bf16) whose
    # sampling distribution differs from the trainer's. null: off; a cap of 2 is common.
    tis_cap: Optional[float] = None  # noqa: UP045
    # The same weights for a batch sampled by older weights than the trainer's
    # (rollout.schedule=one_step_off / async), where rl.tis_cap is null: decoupled PPO's
    # correction from the behaviour policy (the engine's) to pi_old (docs/method.md).
    stale_tis_cap: float = 2.0
    # Log train/rollout/logp_gap/* every step. Free with one update per step (measured from the
    # update's forward) unless the policy has dropout: then it costs an eval-mode forward,
    # which false skips (without TIS).
    measure_logp_gap: bool = True
    # Each prompt once per forward: rows repeating a prompt (a group's G samples) run its
    # key/value cache once in the update, old-policy and reference passes (same numbers).
    # auto: where it saves enough tokens and the model supports it (mrtpo.core.forward says why
    # not, once); false: never; always: wherever the model supports it.
    shared_prompt_forward: str = "auto"

    def __post_init__(self) -> None:
        s = self.section
        for key, default in PER_RANK_DEFAULTS.items():
            for name in (key, "global_" + key):
                value = getattr(self, name)
                _need(value is None or value >= 1, s, name, value, ">= 1 or null")
            if getattr(self, key) is None and getattr(self, "global_" + key) is None:
                setattr(self, key, default)
        for name, ok, allowed in _RL_CHECKS:  # in order: the first bad key is named
            value = getattr(self, name)
            _need(ok(value), s, name, value, allowed() if callable(allowed) else allowed)

        mode = shared_prompt_mode(self.shared_prompt_forward)
        _need(
            mode is not None,
            s,
            "shared_prompt_forward",
            self.shared_prompt_forward,
            "auto, false or always",
        )
        self.shared_prompt_forward = mode

    def per_rank(self, ranks: int) -> RLConfig:
        """This config for one of ``ranks`` processes: each ``global_*`` batch key divided
        over them into its per-rank key (the global one cleared). Refused, naming the keys,
        when a total does not divide or disagrees with a per-rank value also given."""
        import dataclasses

        out = dataclasses.replace(self)
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
    lr: float = 1.0e-6
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # noqa: UP006
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        s = self.section
        _need(self.lr > 0, s, "lr", self.lr, "> 0")
        _need(self.weight_decay >= 0, s, "weight_decay", self.weight_decay, ">= 0")
        betas = list(self.betas)
        _need(
            len(betas) == 2 and all(0 <= b < 1 for b in betas),
            s,
            "betas",
            betas,
            "two numbers in [0, 1), e.g. [0.9,0.95]",
        )
        _need(self.warmup_steps >= 0, s, "warmup_steps", self.warmup_steps, ">= 0")


@dataclass
class ReplayConfig(_Section):
    """Self-replay's batching (see mrtpo.core.replay)."""

    section: ClassVar[str] = "replay"
    token_budget: int = 16384  # rows x padded length per replay forward
    jsd_chunk: int = 256  # (row, position) pairs per float32 log-softmax / JSD chunk
    # responses a step whose P_all replay also scores the update's way (train/replay/
    # noise_floor, mrtpo.core.replay_noise); 0: off
    noise_floor: int = 0

    def __post_init__(self) -> None:
        s = self.section
        _need(self.token_budget >= 1, s, "token_budget", self.token_budget, ">= 1")
        _need(self.jsd_chunk >= 1, s, "jsd_chunk", self.jsd_chunk, ">= 1")
        _need(self.noise_floor >= 0, s, "noise_floor", self.noise_floor, ">= 0")


@dataclass
class DataConfig(_Section):
    """The prompt stream."""

    section: ClassVar[str] = "data"
    max_prompt_tokens: Optional[int] = 4096  # noqa: UP045  (longer prompts are dropped; null: keep all)
    val_prompts: int = 0  # validation prompts (0: no validation)
    val_batch_size: int = 8

    def __post_init__(self) -> None:
        s = self.section
        _need(
            self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
            s,
            "max_prompt_tokens",
            self.max_prompt_tokens,
            ">= 1 or null",
        )
        _need(self.val_prompts >= 0, s, "val_prompts", self.val_prompts, ">= 0")
        _need(self.val_batch_size >= 1, s, "val_batch_size", self.val_batch_size, ">= 1")


@dataclass
class SFTConfig(_Section):
    """The SFT stage (``stage=sft``): supervised warm start on reference responses."""

    section: ClassVar[str] = "stage.sft"
    lr: float = 1.0e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    batch_size: int = 32  # (prompt, reference) pairs per optimizer step
    max_grad_norm: Optional[float] = 1.0  # noqa: UP045
    # Stop once the held-out `target_metric` reaches `target_success` (null: never; the run
    # then ends at trainer.max_steps). Checked every `eval_every` steps from `min_steps` on.
    target_success: Optional[float] = None  # noqa: UP045
    target_metric: Optional[str] = None  # noqa: UP045  (null: the task's success check)
    stop_when: str = "above"  # above: stop once metric >= target; below: once it falls to it
    eval_every: int = 10
    min_steps: int = 0
    eval_prompts: int = 64  # held-out prompts (the task's val split)
    eval_samples: int = 1  # responses per prompt (when sampling)
    eval_temperature: float = 0.0  # 0: greedy; > 0: sample at this temperature
    eval_max_new_tokens: int = 32
    save_dir: Optional[str] = None  # noqa: UP045  (null: <run folder>/policy)
    # Share of training examples shown after the task's self-distillation teacher context
    # (Task.teacher_messages: the reference as an earlier answer, then the question again)
    # instead of the plain prompt, the target still being the reference. A small model learns
    # there to read a reference in its context, which a pretrained LLM already does: OPSD's
    # teacher is this policy reading such a context.
    teacher_share: float = 0.0

    def __post_init__(self) -> None:
        s = self.section
        _need(self.lr > 0, s, "lr", self.lr, "> 0")
        _need(self.weight_decay >= 0, s, "weight_decay", self.weight_decay, ">= 0")
        _need(
            self.max_grad_norm is None or self.max_grad_norm >= 0,
            s,
            "max_grad_norm",
            self.max_grad_norm,
            ">= 0 or null",
        )
        _need(0 <= self.teacher_share <= 1, s, "teacher_share", self.teacher_share, "in [0, 1]")
        _need(self.batch_size >= 1, s, "batch_size", self.batch_size, ">= 1")
        _need(
            self.target_success is None or 0 <= self.target_success <= 1,
            s,
            "target_success",
            self.target_success,
            "in [0, 1] or null",
        )
        _need(
            self.stop_when in ("above", "below"), s, "stop_when", self.stop_when, "above or below"
        )
        _need(self.eval_every >= 1, s, "eval_every", self.eval_every, ">= 1")
        _need(self.min_steps >= 0, s, "min_steps", self.min_steps, ">= 0")
        _need(
            self.target_success is None or self.eval_prompts >= 1,
            s,
            "eval_prompts",
            self.eval_prompts,
            ">= 1 when stage.sft.target_success is set",
        )
        _need(self.eval_samples >= 1, s, "eval_samples", self.eval_samples, ">= 1")
        _need(self.eval_temperature >= 0, s, "eval_temperature", self.eval_temperature, ">= 0")
        _need(
            self.eval_max_new_tokens >= 1,
            s,
            "eval_max_new_tokens",
            self.eval_max_new_tokens,
            ">= 1",
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
    """The typed, range-checked settings of ``name`` (e.g. ``"rl"``) of a composed config.
    ``rl`` is one rank's: a global batch divided over ``world_size(cfg)`` ranks (the config
    itself keeps what was given, which is what a checkpoint records)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, name)
    schema = SCHEMAS[name]
    if node is None:
        out = schema()
    elif isinstance(node, schema):
        out = node
    else:
        out = schema.from_mapping(OmegaConf.to_container(node, resolve=True))
    return out.per_rank(world_size(cfg)) if isinstance(out, RLConfig) else out


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
    """Check every typed section present in ``cfg`` (before any model or data loads), the
    seed, the trainer's step limit and validation interval, and that no number is NaN/inf.
    (That every key is read by something is ``mrtpo.run.config_keys.check_keys``, which the
    pipeline runs first.)"""
    from omegaconf import OmegaConf

    for name in SCHEMAS:
        if OmegaConf.select(cfg, name) is not None:
            section(cfg, name)
    check_run(cfg)
    check_finite(cfg)
    check_engine(cfg)
    check_schedule(cfg)
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


#: The most weight versions an ``async`` sample may lag behind (``rollout.max_staleness``):
#: async keeps that many batches generated ahead, each from weights older than the last.
#: Past a few versions the stale-sample correction has little left to correct with.
MAX_STALENESS = 16

#: Engines whose constructor only stores and checks its settings (no model, no process):
#: the run's validation and ``--check`` build one to run those checks before anything loads.
SETTINGS_ONLY_ENGINES = ("mrtpo.rollout.vllm_server.VLLMServerEngine",)


def _engine_keys(engine) -> None:
    """``port`` and ``weight_dir`` of an engine node: a TCP port, an existing folder."""
    from omegaconf import OmegaConf

    port = OmegaConf.select(engine, "port", default=None)
    if port is not None and not (_is_int(port) and 1 <= port <= 65535):
        raise ConfigError(
            f"rollout.engine.port={port!r} is not allowed: a TCP port from 1 to 65535, or "
            "null for a free one"
        )
    folder = OmegaConf.select(engine, "weight_dir", default=None)
    if folder is not None:
        import os

        if not os.path.isdir(str(folder)):
            raise ConfigError(
                f"rollout.engine.weight_dir={folder}: no such folder (it must exist and be "
                "readable by the server as its MRTPO_WEIGHT_ROOT)"
            )


def check_engine_settings(cfg) -> None:
    """The rollout engine's own checks of its settings (``rollout.engine.*``), run before
    anything loads by both the run (``validate``) and ``--check``: one engine built from the
    config for ``SETTINGS_ONLY_ENGINES``, and the port and weight folder of any engine."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "rollout.engine")
    if node is None:
        return
    _engine_keys(node)
    if str(node.get("_target_")) not in SETTINGS_ONLY_ENGINES:
        return
    _instantiate_checked(node)


def check_schedule(cfg) -> None:
    """``rollout.schedule`` and ``rollout.max_staleness`` are valid, and a schedule that
    generates while the trainer updates has an engine that can (its own weights) and that
    reports the sampling log-probs the loss corrects with: refused before anything loads."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from mrtpo.rollout.source import check_schedule as check_values

    schedule = OmegaConf.select(cfg, "rollout.schedule", default="sync")
    staleness = OmegaConf.select(cfg, "rollout.max_staleness", default=1)
    if not (_is_int(staleness) and staleness <= MAX_STALENESS):
        raise ConfigError(
            f"rollout.max_staleness={staleness!r} is not allowed: an integer from 1 to "
            f"{MAX_STALENESS} (how many weight versions a sample may lag behind the trainer; "
            "async keeps that many batches generated ahead)"
        )
    try:
        check_values(schedule, staleness)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    target = OmegaConf.select(cfg, "rollout.engine._target_")
    if schedule == "sync" or target is None:
        return
    cls = get_class(str(target))
    own = bool(OmegaConf.select(cfg, "rollout.engine.own_copy", default=False))
    if not (getattr(cls, "generates_apart", False) or own):
        raise ConfigError(
            f"rollout.schedule={schedule} generates while the trainer updates, and "
            f"{cls.__name__} samples from the trainer's own weights or process: use "
            "rollout=vllm_server, or rollout=hf with rollout.engine.own_copy=true, or "
            "rollout.schedule=sync"
        )
    if not getattr(cls, "reports_logprobs", True):
        raise ConfigError(
            f"rollout.schedule={schedule} corrects the loss with the engine's sampling "
            f"log-probs, which {cls.__name__} does not report; use rollout.schedule=sync"
        )


#: Keys that were replaced, and the key that does their job now.
RENAMED = {
    # one prefix-sharing switch for every forward (update, old-policy, reference, teacher,
    # replay and the HF engine's prefill)
    "replay.share_prefix": "rl.shared_prompt_forward",
    "rollout.engine.share_prompt": "rl.shared_prompt_forward",
}


def check_renamed(key: str) -> None:
    """Refuse a replaced key, naming the one to use."""
    if key.lstrip("+~") in RENAMED:
        raise ConfigError(
            f"{key.lstrip('+~')} was replaced by {RENAMED[key.lstrip('+~')]} (one switch, "
            "auto/off/always, for every shared-prompt forward): set that instead"
        )


def _method_keys(name: str, depth: int = 0) -> set[str] | None:
    """The keys ``configs/method/<name>.yaml`` sets, with those of the methods it builds on
    (its ``defaults``); None when there is no such file or it cannot be read here."""
    from pathlib import Path

    import yaml

    # the project's configs/ (as mrtpo.run.config.CONFIG_DIR, which imports this module)
    path = Path(__file__).resolve().parents[3] / "configs" / "method" / f"{name}.yaml"
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
    """Refuse ``rl.nope=1`` on the command line, listing the valid keys of that section,
    and a replaced key (``RENAMED``), naming the one to use.

    Hydra would refuse it too, but says only that the key is not in the config (and suggests
    ``+rl.nope=1``, which a schema refuses as well).
    """
    check_method_keys(argv)
    for arg in argv:
        if "=" in arg:
            check_renamed(arg.split("=", 1)[0])
        if "=" not in arg or arg.startswith(("+", "~", "-")):
            continue
        key = arg.split("=", 1)[0]
        for name, schema in SCHEMAS.items():
            prefix = name + "."
            if key.startswith(prefix):
                leaf = key[len(prefix) :].split(".")[0]
                if leaf not in schema.field_names():
                    raise ConfigError(
                        f"unknown key {key!r}: '{name}' has no key {leaf!r}; valid keys: "
                        f"{sorted(schema.field_names())}"
                    )


# ---- Where a run runs: its ranks, the global batch, trainer/model refusals -------------------
# Checked by the pipeline before anything loads (mrtpo.lightning.pipeline.prepare).

#: Models at least this large (parameters) are refused on the CPU trainer unless +allow_cpu=true.
CPU_PARAMS_LIMIT = 1.0e9


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _on_gpu(trainer, gpus: int) -> bool:
    accelerator = str(trainer.get("accelerator", "auto")).lower()
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpus > 0)


def _devices_per_node(value: Any, on_gpu: bool, gpus: int) -> int:
    """Processes per node that ``trainer.devices`` starts, counted as Lightning counts them."""
    if not isinstance(value, (str, int)) and hasattr(value, "__len__"):
        return len(value)  # a list of GPU ids
    text = str(value).strip()
    if text in ("auto", "-1"):
        if text == "-1" and not on_gpu:
            raise ConfigError(
                "trainer.devices=-1 means every GPU; on the CPU trainer give a number of "
                "processes (trainer.devices=1, 2, ...)"
            )
        return max(gpus, 1) if on_gpu else 1
    if "," in text:
        return len([t for t in text.split(",") if t.strip()])
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"trainer.devices={value!r} is not allowed: a count >= 1, a list of GPU ids, "
            "-1 (every GPU) or auto"
        )
    return int(text)


def world_size(cfg, gpus: int | None = None) -> int:
    """How many training processes ``cfg.trainer`` starts: devices per node x nodes."""
    from omegaconf import OmegaConf

    trainer = OmegaConf.select(cfg, "trainer")
    if trainer is None:
        return 1
    gpus = visible_gpus() if gpus is None else gpus
    per_node = _devices_per_node(trainer.get("devices", "auto"), _on_gpu(trainer, gpus), gpus)
    return per_node * int(trainer.get("num_nodes", 1) or 1)


def _parameter_count(d: Mapping) -> float | None:
    """Parameters of a decoder-only transformer from its config.json sizes (None if absent)."""
    try:
        h, layers, vocab = int(d["hidden_size"]), int(d["num_hidden_layers"]), int(d["vocab_size"])
        heads = int(d.get("num_attention_heads") or 1)
        kv = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or h // heads)
        inter = int(d.get("intermediate_size") or 4 * h)
    except (KeyError, TypeError, ValueError):
        return None
    attention = h * head_dim * 2 * (heads + kv)  # q and o, k and v
    embeddings = vocab * h * (1 if d.get("tie_word_embeddings") else 2)
    return float(layers * (attention + 3 * h * inter) + embeddings)


def model_parameters(model) -> float | None:
    """About how many parameters ``cfg.model`` has, without loading it: from the tiny model's
    sizes, a local folder's config.json, or the size in a hub id (``Qwen2.5-7B-Instruct``)."""
    import json
    import re
    from pathlib import Path

    if model is None:
        return None
    if model.get("tiny"):
        return _parameter_count(model.tiny)
    name = str(model.get("name_or_path") or "")
    config = Path(name) / "config.json"
    if config.is_file():
        try:
            return _parameter_count(json.loads(config.read_text()))
        except (OSError, ValueError):
            return None
    m = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)[Bb](?![A-Za-z0-9])", Path(name).name)
    return float(m.group(1)) * 1e9 if m else None


def _preset(cfg) -> str:
    """``experiment=<name>`` of a composed config, for messages ('' when none)."""
    from omegaconf import OmegaConf

    name = OmegaConf.select(cfg, "hydra.runtime.choices.experiment", default=None)
    if name is None:
        try:
            from hydra.core.hydra_config import HydraConfig

            name = HydraConfig.get().runtime.choices.get("experiment")
        except (ValueError, AttributeError):
            name = None
    return f"experiment={name} " if name and name != "null" else ""


def check_placement(cfg, gpus: int | None = None) -> int:
    """Refuse, before anything loads, a trainer this machine cannot start (GPUs it lacks) or
    a model too large for the CPU trainer (unless ``+allow_cpu=true``); return the number
    of ranks. ``gpus``: the GPUs to assume (default: those visible)."""
    from omegaconf import OmegaConf

    trainer = OmegaConf.select(cfg, "trainer")
    if trainer is None:
        return 1
    gpus = visible_gpus() if gpus is None else gpus
    on_gpu = _on_gpu(trainer, gpus)
    per_node = _devices_per_node(trainer.get("devices", "auto"), on_gpu, gpus)
    if on_gpu and per_node > gpus:
        fix = (
            f"lower trainer.devices to {gpus} where docs/scaling.md says the model fits"
            if gpus
            else "run it on a GPU machine"
        )
        raise ConfigError(
            f"{_preset(cfg)}trains on {per_node} GPU(s) per node (trainer.accelerator="
            f"{trainer.get('accelerator')}, trainer.devices={trainer.get('devices')}), but this "
            f"machine has {gpus or 'no'} CUDA GPU(s): {fix}, or try the pipeline on the CPU "
            "with trainer=cpu trainer.devices=1 model=tiny"
        )
    if not on_gpu and not OmegaConf.select(cfg, "allow_cpu", default=False):
        n = model_parameters(OmegaConf.select(cfg, "model"))
        if n is not None and n >= CPU_PARAMS_LIMIT:
            raise ConfigError(
                f"model.name_or_path={cfg.model.name_or_path} has about {n / 1e9:.1f}B "
                f"parameters: on the CPU trainer its training state in float32 (weights, "
                f"gradients and AdamW moments, 16 B each) is about {16 * n / 1e9:.0f} GB and a "
                "step takes hours. Train it on GPUs (the paper presets compose their trainer; "
                "docs/scaling.md), or add +allow_cpu=true to run it on the CPU anyway"
            )
    return per_node * int(trainer.get("num_nodes", 1) or 1)


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


# ---- the global batch a resume must keep -------------------------------------------------------

#: The rl keys that state the batch, per rank or over all ranks: a resume is compared by the
#: global batch they make (``batch_on_resume``), not key by key.
BATCH_KEYS = tuple(f"rl.{form}{key}" for key in PER_RANK_DEFAULTS for form in ("", "global_"))


def global_batch(cfg, ranks: int | None = None) -> dict[str, int] | None:
    """What one RL step of ``cfg`` takes over all its ranks, whatever form its batch keys
    have: ``world_size`` (``ranks``, default: the processes ``cfg.trainer`` starts),
    ``prompts_per_step`` and ``mini_batch_size`` (responses per optimizer step, counted as the
    update counts them: a mini-batch larger than a rank's responses is all of them). None
    when ``cfg`` has no usable ``rl`` section or trainer (refused elsewhere, naming the key)."""
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
    """The global batch of a settings record (``mrtpo.run.folder.settings_record``): as
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
    """Compare the global batch of a checkpoint's settings record (``theirs``) with a
    resume's (``mine``). Returns (the batch keys to leave out of the key-by-key comparison,
    the refusal; '' when there is none): the keys may change form when they make the same
    global batch, and a resume on another world size that makes another one is refused
    naming the run's world size and the ``rl.global_*`` keys that keep its batch."""
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
