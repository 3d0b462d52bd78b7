"""Build and run a training job from a composed Hydra config (used by src/train.py and tests)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mrtpo.run_folder import (
    read_checkpoint,
    record_invocation,
    record_resume,
    resume_checkpoint,
    validate_resume,
)

log = logging.getLogger(__name__)


def print_config(cfg: DictConfig) -> None:
    """A rich tree of the resolved config, one branch per top-level group."""
    from rich import print as rprint
    from rich.syntax import Syntax
    from rich.tree import Tree

    tree = Tree("config", guide_style="dim")
    for key in cfg:
        branch = tree.add(str(key), guide_style="dim")
        node = cfg[key]
        text = OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else str(node)
        branch.add(Syntax(text, "yaml", theme="ansi_dark", word_wrap=True))
    rprint(tree)


def _container(node) -> Any:
    return OmegaConf.to_container(node, resolve=True) if node is not None else None


def build(cfg: DictConfig):
    """(trainer, module, datamodule) for ``cfg``; nothing is trained yet."""
    import lightning as L
    from hydra.utils import instantiate

    from mrtpo.callbacks.rollout import RolloutCallback
    from mrtpo.data import PromptDataModule
    from mrtpo.models import load_policy

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    policy, tokenizer = load_policy(**_container(cfg.model))
    task = instantiate(cfg.task)
    stage = cfg.stage.name
    datamodule = PromptDataModule(
        task,
        prompts_per_step=cfg.rl.prompts_per_step,
        seed=cfg.seed,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        val_prompts=cfg.data.val_prompts,
        val_batch_size=cfg.data.val_batch_size,
        tokenizer=tokenizer,
    )
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c]
    if stage == "rl":
        from mrtpo.module import PolicyModule

        method = instantiate(cfg.method)
        module = PolicyModule(
            policy,
            tokenizer,
            task,
            method,
            rl=_container(cfg.rl),
            optim=_container(cfg.optim),
            replay=_container(cfg.replay),
            seed=cfg.seed,
        )
        engine = instantiate(cfg.rollout.engine)
        callbacks.append(
            RolloutCallback(
                engine,
                sampling=_container(cfg.rollout.sampling),
                group_size=cfg.rl.group_size,
                val_max_new_tokens=cfg.rollout.get("val_max_new_tokens"),
            )
        )
    elif stage == "sft":
        from mrtpo.sft import SFTModule

        module = SFTModule(policy, tokenizer, task, **_container(cfg.stage.sft))
        datamodule = module.datamodule(datamodule)
        callbacks.extend(module.callbacks())
    else:
        raise ValueError(f"stage={stage!r} is not supported; use stage=rl or stage=sft")
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c]
    from mrtpo.callbacks.resume import ResumeMetrics

    # Resuming into a folder that has metrics: keep its rows before the checkpoint's step.
    callbacks.append(ResumeMetrics(loggers, resuming=resume_checkpoint(cfg) is not None))
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return trainer, module, datamodule


def metrics_csv(trainer) -> Path | None:
    for lg in trainer.loggers:
        if type(lg).__name__ == "CSVLogger":
            return Path(lg.log_dir) / "metrics.csv"
    return None


def train(cfg: DictConfig) -> dict[str, float]:
    """Run training; return the last logged metrics."""
    if cfg.get("print_config"):
        print_config(cfg)
    ckpt_path = resume_checkpoint(cfg)
    # Read the checkpoint before anything is built: a damaged file fails here, naming it.
    ckpt = read_checkpoint(ckpt_path) if ckpt_path else None
    trainer, module, datamodule = build(cfg)
    if ckpt is not None:
        # Nothing in the run folder has changed yet: a refused resume leaves it as it was.
        validate_resume(ckpt, module, ckpt_path)
        del ckpt
    if cfg.get("resume"):
        record_resume(cfg, cfg.resume)
    else:
        record_invocation(cfg)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    path = metrics_csv(trainer)
    if path is not None and trainer.is_global_zero:
        log.info("metrics: %s", path)
    return metrics
