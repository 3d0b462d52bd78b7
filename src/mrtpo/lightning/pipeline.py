"""Build and run a training job from a composed Hydra config (used by src/train.py and tests)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mrtpo import live
from mrtpo.run.checks import preflight, validate
from mrtpo.run.cli import load_model
from mrtpo.run.config import compose
from mrtpo.run.config_keys import check_keys
from mrtpo.run.folder import (
    RunFolderLock,
    drop_pending_log,
    park_refused_log,
    record_invocation,
    run_folder_of,
)
from mrtpo.run.placement import check_placement, configure_threads
from mrtpo.run.resume import (
    NothingToTrain,
    check_resume_settings,
    check_steps_left,
    read_checkpoint,
    record_resume,
    resume_checkpoint,
    settings_record,
    validate_resume,
)
from mrtpo.run.settings import resolve_batch, section
from mrtpo.run.signals import STOP, RunInterrupted

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


def prepare(cfg: DictConfig, validated: bool = False):
    """Everything that can fail cheaply, before any model loads: settings (unless
    ``validated``), a paper preset's data files, the stage, the task and what the stage needs."""
    from hydra.utils import instantiate

    from mrtpo.run.checks import check_paper_data
    from mrtpo.run.loggers import check_loggers

    if not validated:
        check_keys(cfg)
        validate(cfg)
    check_paper_data(cfg)
    # the trainer this machine can start, and the global batch divided over its ranks
    resolve_batch(cfg, check_placement(cfg))
    check_loggers(cfg.get("logger"))
    stage = instantiate(cfg.stage, _convert_="all")
    task = instantiate(cfg.task)
    stage.check(cfg, task)
    return stage, task


def build(cfg: DictConfig, validated: bool = False):
    """(trainer, module, datamodule) for ``cfg``; nothing is trained yet."""
    import lightning as L
    from hydra.utils import instantiate

    from mrtpo.lightning.callbacks.resume import ResumeMetrics
    from mrtpo.lightning.data import PromptDataModule
    from mrtpo.run.loggers import build_loggers

    # the settings as given, before prepare() derives per-rank batch keys from them
    settings = settings_record(cfg)
    stage, task = prepare(cfg, validated=validated)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    # a folder that holds no model: one line naming it; a model given to mrtpo.Trainer: that one
    policy, tokenizer = live.load_model(cfg, load_model)
    prompts = PromptDataModule(
        task,
        prompts_per_step=section(cfg, "rl").prompts_per_step,
        seed=cfg.seed,
        tokenizer=tokenizer,
        cache_dir=OmegaConf.select(cfg, "paths.cache_dir", default=None),  # prompt token counts
        **dataclasses.asdict(section(cfg, "data")),  # every data.* key is one of its arguments
    )
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c]
    callbacks += live.callbacks()  # those given to mrtpo.Trainer
    module, datamodule, extra = stage.build(cfg, policy, tokenizer, task, prompts)
    callbacks.extend(extra)
    # metrics.csv is never deleted: a resume keeps its rows before the checkpoint's step
    loggers = build_loggers(cfg.get("logger"), resuming=resume_checkpoint(cfg) is not None)
    callbacks.append(ResumeMetrics(settings=settings))
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return trainer, module, datamodule


def metrics_csv(trainer) -> Path | None:
    from lightning.pytorch.loggers import CSVLogger

    csv = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
    return None if csv is None else Path(csv.log_dir) / "metrics.csv"


def command_line() -> str:
    """This invocation as a command a user could type again."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except Exception:
        return ""
    return " ".join(["python src/train.py", *overrides])


def run_warm_starts(cfg: DictConfig) -> DictConfig:
    """Run ``cfg.warm_start``'s entries in order; return ``cfg`` starting from the last policy.

    Each entry is a run of its own, composed from its ``overrides`` plus this run's paths,
    into ``<run>/warm_start/<i>_<name>``; a finished one (a saved ``policy/``) is reused.
    """
    from hydra.core.hydra_config import HydraConfig

    root = Path(str(cfg.paths.output_dir)) / "warm_start"
    policy: Path | None = None
    saved = HydraConfig.instance().cfg
    try:
        for i, entry in enumerate(cfg.warm_start):
            name = str(entry.get("name") or f"stage{i}")
            out = root / f"{i}_{name}"
            given = [str(o) for o in entry.get("overrides", [])]
            plumbing = [f"paths.output_dir={out}"]
            plumbing += [f"paths.{k}={cfg.paths[k]}" for k in ("log_dir", "cache_dir", "data_dir")]
            if policy is not None:
                plumbing += [f"model.name_or_path={policy}", "model.tiny=null"]
            print(
                f"warm start {i + 1}/{len(cfg.warm_start)} ({name}): python src/train.py "
                + " ".join(given + plumbing[:1] + plumbing[4:]),
                flush=True,
            )
            if (out / "policy" / "config.json").is_file():
                print(f"  reusing the finished warm start in {out}", flush=True)
            else:
                train(compose("train.yaml", [*given, *plumbing]))
            policy = out / "policy"
    finally:
        HydraConfig.instance().cfg = saved
    if policy is not None:
        cfg.model.name_or_path = str(policy)
        cfg.model.tiny = None
    return cfg


def train(cfg: DictConfig) -> dict[str, float]:
    """Run training (after the config's warm starts, if any); return the last logged metrics.

    The run folder is locked (``RunFolderLock``): a second process there is refused. A
    ``+resume`` of a finished run raises ``NothingToTrain`` before anything loads; SIGTERM or
    SIGINT ends it as ``RunInterrupted``.
    """
    if cfg.get("print_config"):
        print_config(cfg)
    from mrtpo.lightning.callbacks.console import quiet_libraries

    quiet_libraries()
    check_keys(cfg)  # every key is read by something
    validate(cfg)  # typed settings and their ranges, before anything loads or runs
    check_placement(cfg)  # and a trainer this machine can start, before any warm start runs
    preflight(cfg)  # values left open, logger packages, vLLM's CPU build: one line each
    configure_threads(cfg)  # torch's CPU threads (threads=auto: one for a small model on a CPU)
    folder = run_folder_of(cfg)
    if folder is not None and not cfg.get("resume"):
        folder.mkdir(parents=True, exist_ok=True)
    try:
        with STOP.guarding(folder):
            if cfg.get("resume"):
                resume_checkpoint(cfg)  # a folder that is not a run is refused before the lock
            with RunFolderLock(folder) if folder is not None else contextlib.nullcontext() as lock:
                return _train_locked(cfg, lock)
    except NothingToTrain:
        drop_pending_log()  # the run finished already: nothing changed, nothing to keep
        raise
    except Exception as exc:
        # an interrupted resume that changed the folder (it trained) is no refused one
        if cfg.get("resume") and not (isinstance(exc, RunInterrupted) and exc.trained):
            park_refused_log(cfg, exc)
        raise


def _train_locked(cfg: DictConfig, lock: RunFolderLock | None) -> dict[str, float]:
    from mrtpo.lightning.callbacks.console import header

    if cfg.get("warm_start"):
        cmd = command_line()
        if cmd:
            print(f"composed: {cmd}", flush=True)
        cfg = run_warm_starts(cfg)
        print(f"{cfg.stage.name}: from {cfg.model.name_or_path}", flush=True)
    ckpt_path = resume_checkpoint(cfg)
    if ckpt_path:  # a start that would train no step: refused or said before anything loads
        check_steps_left(cfg, ckpt_path)
    # Read the checkpoint before anything is built: a damaged file fails here, naming it.
    ckpt = read_checkpoint(ckpt_path) if ckpt_path else None
    settings = settings_record(cfg)  # as given: build() derives per-rank keys from them
    trainer, module, datamodule = build(cfg, validated=True)  # train() validated cfg
    if trainer.is_global_zero:
        print(header(cfg), flush=True)
    if ckpt is not None:
        # Nothing in the run folder has changed yet: a refused resume leaves it as it was.
        validate_resume(ckpt, module, ckpt_path)
        if cfg.get("resume"):  # a new run from a checkpoint (ckpt_path=) may change anything
            check_resume_settings(ckpt, settings, ckpt_path)
        del ckpt
    if lock is not None:
        lock.accept()
    ckpt_dir = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath", default=None)
    if ckpt_dir and trainer.is_global_zero:
        from mrtpo.run.checkpointing import remove_stale_temporaries

        # the lock proves that no other run of this folder is alive to be writing into it
        held = lock is not None and lock.fd is not None
        inside = held and Path(str(ckpt_dir)).resolve().is_relative_to(lock.folder.resolve())
        remove_stale_temporaries(ckpt_dir, all_stale=inside)
    with STOP.fitting(trainer, ckpt_dir):  # a SIGTERM from here on lets the step end
        if cfg.get("resume"):
            record_resume(cfg, cfg.resume)
        else:
            record_invocation(cfg)
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    path = metrics_csv(trainer)
    if path is not None and trainer.is_global_zero:
        log.info("metrics: %s", path)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}
