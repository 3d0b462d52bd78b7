"""Build and run a training job from a composed Hydra config (used by src/train.py and tests)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

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


def resume_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint to resume from: ``ckpt_path``, or ``last.ckpt`` of the ``resume`` run.

    ``+resume=<run folder>`` continues a run in its own folder (configs/hydra/default.yaml
    points ``hydra.run.dir`` at it), from its latest checkpoint, appending to its metrics.
    """
    ckpt = cfg.get("ckpt_path")
    resume = cfg.get("resume")
    if not resume:
        return ckpt
    run = Path(str(resume))
    if run.is_file():
        raise ValueError(
            f"resume={resume} is a file; resume takes a run folder (logs/train/runs/<run>). "
            "To start a new run from a checkpoint file use ckpt_path= instead"
        )
    if not run.is_dir():
        raise FileNotFoundError(f"resume={resume}: no such run folder")
    if ckpt:
        return ckpt
    dirpath = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath", default=None)
    candidates = [Path(str(dirpath)) / "last.ckpt"] if dirpath else []
    candidates.append(run / "checkpoints" / "last.ckpt")
    for c in candidates:
        if c.is_file():
            return str(c)
    raise FileNotFoundError(
        f"resume={resume}: no last.ckpt under {run / 'checkpoints'} (the run stopped before its "
        "first checkpoint?); start it again, or pass ckpt_path= to a checkpoint"
    )


def record_invocation(cfg: DictConfig) -> None:
    """Append this invocation's overrides to ``.hydra/history.yaml`` of the run folder.

    Hydra rewrites ``.hydra/overrides.yaml`` each time a run folder is used, so after a
    resume the history keeps the original command line too. Only the launching process
    writes (DDP workers run with ``hydra.output_subdir=null``).
    """
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except Exception:
        return
    if not hc.output_subdir or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    folder = Path(hc.runtime.output_dir) / str(hc.output_subdir)
    if not folder.is_dir():
        return
    entry = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "overrides": list(hc.overrides.task),
    }
    with open(folder / "history.yaml", "a", encoding="utf-8") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create([entry])))


def train(cfg: DictConfig) -> dict[str, float]:
    """Run training; return the last logged metrics."""
    if cfg.get("print_config"):
        print_config(cfg)
    ckpt_path = resume_checkpoint(cfg)
    record_invocation(cfg)
    trainer, module, datamodule = build(cfg)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    path = metrics_csv(trainer)
    if path is not None and trainer.is_global_zero:
        log.info("metrics: %s", path)
    return metrics
