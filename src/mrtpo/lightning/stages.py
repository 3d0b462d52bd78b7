"""Stages: what a run does with its policy (``stage=rl``, ``stage=sft``, or one of your own).

A stage (``cfg.stage._target_``) turns policy, tokenizer, task and prompt stream into the
LightningModule, DataModule and callbacks of its training; the pipeline never asks which. A new
one is a ``Stage`` subclass plus ``configs/stage/<name>.yaml`` (``test_extension.py`` adds one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf

from mrtpo.lightning.callbacks.rollout import RolloutCallback
from mrtpo.lightning.data import PromptDataModule
from mrtpo.lightning.module import PolicyModule
from mrtpo.lightning.sft import SFTModule
from mrtpo.rollout.base import SamplingConfig
from mrtpo.run.settings import SFTConfig, section
from mrtpo.tasks.base import Task


class Stage(ABC):
    """Base class: ``build`` returns (module, datamodule, extra callbacks)."""

    name: str = "stage"

    def __init__(self, name: str | None = None) -> None:
        if name:
            self.name = name

    def check(self, cfg: DictConfig, task: Task) -> None:  # noqa: B027  (optional hook)
        """Refuse a config this stage cannot run, before the model loads."""

    @abstractmethod
    def build(
        self, cfg: DictConfig, policy, tokenizer, task: Task, prompts: PromptDataModule
    ) -> tuple[L.LightningModule, L.LightningDataModule, list[L.Callback]]: ...


def _container(node) -> Any:
    return OmegaConf.to_container(node, resolve=True) if node is not None else None


class RLStage(Stage):
    """Multi-reward RL: ``PolicyModule`` plus the rollout callback that feeds it;
    ``optimizer`` and ``scheduler``: configs/stage/rl.yaml's, as ``PolicyModule`` takes them."""

    name = "rl"

    def __init__(
        self, name: str | None = None, optimizer: Any = None, scheduler: Any = None
    ) -> None:
        super().__init__(name)
        self.optimizer, self.scheduler = optimizer, scheduler

    def check(self, cfg: DictConfig, task: Task) -> None:
        from hydra.utils import instantiate

        # Checked before the model loads, so a bad method.* or rollout.sampling.* value
        # fails at once, naming the key.
        SamplingConfig(**_container(cfg.rollout.sampling)).check_for_training()
        self._method = instantiate(cfg.method)
        self._method.setup(task)  # validation only: the step binds it with its services
        strategy = str(OmegaConf.select(cfg, "trainer.strategy._target_", default="") or "")
        if strategy.endswith("FSDP2Strategy"):
            # Combinations whose sharded forwards are not yet in lockstep, or whose adapter
            # merges would meet sharded tensors: refused rather than left to hang or crash.
            if getattr(self._method, "teacher", None) is not None:
                raise ValueError(
                    f"method={getattr(self._method, 'config_name', '?')} needs a frozen teacher, "
                    "whose forwards are not sharded in lockstep yet: use trainer=ddp (or "
                    "trainer=gpu), or another method with trainer=fsdp"
                )
            if int(OmegaConf.select(cfg, "model.lora.r", default=0) or 0) > 0:
                raise ValueError(
                    "model.lora.r > 0 with trainer=fsdp is not supported yet (adapter merges "
                    "for export and vLLM sync would meet sharded tensors): LoRA trains a 7B "
                    "model on one GPU, so use trainer=gpu or trainer=ddp"
                )

    def build(self, cfg, policy, tokenizer, task, prompts):
        from hydra.utils import instantiate

        method = getattr(self, "_method", None) or instantiate(cfg.method)
        parts = {k: section(cfg, k) for k in ("rl", "optim", "replay")}
        hooks = {"optimizer": self.optimizer, "scheduler": self.scheduler}
        module = PolicyModule(policy, tokenizer, task, method, seed=cfg.seed, **parts, **hooks)
        rl = parts["rl"]
        # an engine's settings reach it by interpolation in its config (configs/rollout/hf.yaml)
        engine = instantiate(cfg.rollout.engine)
        sampling = _container(cfg.rollout.sampling)
        keys = ("val_max_new_tokens", "schedule", "max_staleness")  # else the callback's defaults
        extra = {k: cfg.rollout[k] for k in keys if k in cfg.rollout}
        rollout = RolloutCallback(engine, sampling, rl.group_size, **extra)
        return module, prompts, [rollout]


class SFTStage(Stage):
    """Supervised warm start on the task's references (``mrtpo.lightning.sft``)."""

    name = "sft"

    def __init__(self, name: str | None = None, sft: Mapping | None = None) -> None:
        super().__init__(name)
        self.sft = SFTConfig.from_mapping(dict(sft or {}))

    def build(self, cfg, policy, tokenizer, task, prompts):
        module = SFTModule(policy, tokenizer, task, self.sft)
        return module, module.datamodule(prompts), module.callbacks()
