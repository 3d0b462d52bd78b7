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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, List, Optional  # noqa: UP035  (OmegaConf reads these annotations)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and what is allowed."""


def _need(ok: bool, section: str, key: str, value: Any, allowed: str) -> None:
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


@dataclass
class RLConfig(_Section):
    """One RL step: B prompts x G samples, scored, then clipped-surrogate updates."""

    section: ClassVar[str] = "rl"
    prompts_per_step: int = 4  # B
    group_size: int = 4  # G
    ppo_epochs: int = 1
    mini_batch_size: int = 16  # responses per optimizer step
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
    # Log train/rollout/logp_gap/* every step. With one update per step and no TIS this costs
    # an extra no-grad forward (the old-policy pass is otherwise skipped); false skips it then.
    measure_logp_gap: bool = True

    def __post_init__(self) -> None:
        s = self.section
        _need(self.prompts_per_step >= 1, s, "prompts_per_step", self.prompts_per_step, ">= 1")
        _need(
            self.group_size >= 2,
            s,
            "group_size",
            self.group_size,
            ">= 2 (advantages are relative to a prompt's group; with 1 sample every one is 0)",
        )
        _need(self.ppo_epochs >= 1, s, "ppo_epochs", self.ppo_epochs, ">= 1")
        _need(self.mini_batch_size >= 1, s, "mini_batch_size", self.mini_batch_size, ">= 1")
        _need(self.micro_batch_size >= 1, s, "micro_batch_size", self.micro_batch_size, ">= 1")
        _need(0 <= self.clip_low < 1, s, "clip_low", self.clip_low, "in [0, 1)")
        _need(self.clip_high >= 0, s, "clip_high", self.clip_high, ">= 0")
        _need(self.kl_coef >= 0, s, "kl_coef", self.kl_coef, ">= 0")
        from mrtpo.loss import AGGREGATIONS

        _need(self.loss_agg in AGGREGATIONS, s, "loss_agg", self.loss_agg, f"{list(AGGREGATIONS)}")
        _need(
            self.max_grad_norm is None or self.max_grad_norm >= 0,
            s,
            "max_grad_norm",
            self.max_grad_norm,
            ">= 0 or null",
        )
        _need(
            self.max_nonfinite_steps >= 1,
            s,
            "max_nonfinite_steps",
            self.max_nonfinite_steps,
            ">= 1",
        )
        _need(
            self.max_consecutive_score_failures >= 1,
            s,
            "max_consecutive_score_failures",
            self.max_consecutive_score_failures,
            ">= 1",
        )
        _need(
            self.replay_oom_retries >= 0, s, "replay_oom_retries", self.replay_oom_retries, ">= 0"
        )
        _need(
            self.tis_cap is None or self.tis_cap > 0,
            s,
            "tis_cap",
            self.tis_cap,
            "> 0 (a cap on pi_trainer / pi_engine, e.g. 2.0) or null (off)",
        )


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
    """Self-replay's batching (see mrtpo.replay)."""

    section: ClassVar[str] = "replay"
    token_budget: int = 16384  # rows x padded length per replay forward
    jsd_chunk: int = 256  # (row, position) pairs per float32 log-softmax / JSD chunk
    share_prefix: bool = True  # run a response's common context prefix once (KV reuse)

    def __post_init__(self) -> None:
        s = self.section
        _need(self.token_budget >= 1, s, "token_budget", self.token_budget, ">= 1")
        _need(self.jsd_chunk >= 1, s, "jsd_chunk", self.jsd_chunk, ">= 1")


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
    """The typed, range-checked settings of ``name`` (e.g. ``"rl"``) of a composed config."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, name)
    schema = SCHEMAS[name]
    if node is None:
        return schema()
    if isinstance(node, schema):
        return node
    return schema.from_mapping(OmegaConf.to_container(node, resolve=True))


def validate(cfg) -> None:
    """Check every typed section present in ``cfg`` (before any model or data loads)."""
    from omegaconf import OmegaConf

    for name in SCHEMAS:
        if OmegaConf.select(cfg, name) is not None:
            section(cfg, name)


def check_overrides(argv: Sequence[str]) -> None:
    """Refuse ``rl.nope=1`` on the command line, listing the valid keys of that section.

    Hydra would refuse it too, but says only that the key is not in the config (and suggests
    ``+rl.nope=1``, which a schema refuses as well).
    """
    for arg in argv:
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
