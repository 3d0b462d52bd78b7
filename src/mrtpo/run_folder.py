"""Run folders and resuming into them, without ever losing what a folder already holds.

``+resume=<run folder>`` continues a run in place. Before anything in that folder changes
(metrics, checkpoints, the saved overrides), the resume is validated: the checkpoint must be
readable, and it must have been trained with the same task, method, reward set and model
shapes as the resuming config. A refused resume leaves the folder byte for byte as it was.

Hydra does not write the resuming command's config into the folder (``hydra.output_subdir``
is null for a resume, see configs/hydra/default.yaml); once the resume is validated it is
recorded beside the original under ``.hydra/resumes/<time>/`` and appended to
``.hydra/history.yaml``. The original ``.hydra/overrides.yaml`` is never rewritten.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class ResumeRefused(ValueError):
    """A resume that would not continue the same run; the folder was left untouched."""


def resume_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint to resume from: ``ckpt_path``, or ``last.ckpt`` of the ``resume`` run."""
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


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Verify (checksum, finiteness) and load a checkpoint on the CPU, memory-mapped.

    A damaged, truncated or empty file is refused naming it and the earlier checkpoints of
    its folder (``mrtpo.checkpointing``), not with torch's internal messages.
    """
    from mrtpo.checkpointing import CheckpointError, load_checkpoint

    path = Path(path)
    try:
        ckpt = load_checkpoint(path, map_location="cpu", weights_only=False, mmap=True)
    except CheckpointError as exc:
        raise ResumeRefused(str(exc)) from exc
    if "state_dict" not in ckpt:
        raise ResumeRefused(f"checkpoint {path} holds no 'state_dict' (not a Lightning checkpoint)")
    return ckpt


def validate_resume(ckpt: dict[str, Any], module, ckpt_path: str | Path) -> None:
    """Refuse a checkpoint that another task, method, reward set or model produced."""
    state = ckpt.get("mrtpo") or {}
    identity = module.identity() if hasattr(module, "identity") else {}
    for key, mine in identity.items():
        if key in state and state[key] != mine:
            raise ResumeRefused(
                f"{ckpt_path} was trained with {key}={state[key]!r} but this run has "
                f"{key}={mine!r}; resume with the original run's overrides (its "
                ".hydra/overrides.yaml, left unchanged)"
            )
    theirs = ckpt["state_dict"]
    ours = module.state_dict()
    missing = sorted(set(ours) - set(theirs))
    extra = sorted(set(theirs) - set(ours))
    shapes = [
        f"{k}: checkpoint {tuple(theirs[k].shape)} vs model {tuple(ours[k].shape)}"
        for k in sorted(set(ours) & set(theirs))
        if hasattr(theirs[k], "shape") and tuple(theirs[k].shape) != tuple(ours[k].shape)
    ]
    if missing or extra or shapes:
        detail = "; ".join(
            [f"{len(missing)} parameters missing (e.g. {missing[:2]})"] * bool(missing)
            + [f"{len(extra)} unexpected (e.g. {extra[:2]})"] * bool(extra)
            + [f"shape mismatches: {shapes[:2]}"] * bool(shapes)
        )
        raise ResumeRefused(
            f"{ckpt_path} holds a different model than model.name_or_path / model=... of this "
            f"run ({detail}); resume with the original run's model= overrides"
        )


def record_resume(cfg: DictConfig, run: str | Path) -> None:
    """After a validated resume: save this invocation beside the original config."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except Exception:
        overrides = []
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    folder = Path(run) / ".hydra" / "resumes" / f"{stamp}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=False))
    entry = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "resume": True, "overrides": overrides}
    with open(Path(run) / ".hydra" / "history.yaml", "a", encoding="utf-8") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create([entry])))
    # Hydra's job log of a resume went outside the folder until now (mrtpo.config.job_log):
    # move what it holds into the run's own log and log there from here on.
    target = Path(run) / "train.log"
    root = logging.getLogger()
    fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    for h in list(root.handlers):
        name = getattr(h, "baseFilename", "")
        if isinstance(h, logging.FileHandler) and Path(name).parent.name == "resume-logs":
            h.flush()
            h.close()
            root.removeHandler(h)
            fmt = h.formatter or fmt
            pending = Path(name)
            if pending.is_file():
                with open(target, "ab") as out:
                    out.write(pending.read_bytes())
                pending.unlink()
                with contextlib.suppress(OSError):  # kept while another resume is pending
                    pending.parent.rmdir()
    handler = logging.FileHandler(target, encoding="utf-8")
    handler.setFormatter(fmt)
    root.addHandler(handler)


def record_invocation(cfg: DictConfig) -> None:
    """Append a new run's overrides to ``.hydra/history.yaml`` of its folder.

    Only the launching process writes (DDP workers run with ``hydra.output_subdir=null``).
    """
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        subdir, output_dir = hc.output_subdir, hc.runtime.output_dir
    except Exception:  # composed outside a Hydra run (tests, library use): nothing to record
        return
    if not subdir or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    folder = Path(output_dir) / str(subdir)
    if not folder.is_dir():
        return
    entry = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "overrides": list(hc.overrides.task)}
    with open(folder / "history.yaml", "a", encoding="utf-8") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create([entry])))
