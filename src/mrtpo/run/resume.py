"""Resuming a run in its own folder, without ever losing what the folder already holds.

``+resume=<run folder>`` continues a run in place with its own overrides (``resume_overrides``,
as ``mrtpo.run.resume_trust`` allows). Before anything there changes, the checkpoint must be
readable and trained with the same task, method, reward set, model shapes and settings, but
for ``RESUME_MAY_CHANGE`` (``settings_record``); a refused resume leaves the folder untouched.
Hydra writes no config for a resume (``hydra.output_subdir`` is null); a validated one is
recorded under ``.hydra/resumes/<time>/`` and in ``.hydra/history.yaml``, never over the
original ``.hydra/overrides.yaml``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from mrtpo.run.resume_trust import (
    NOT_RESUMED,
    is_override,
    names_code,
    override_key,
    refuse_untrusted,
    same_value,
    saved_overrides,
    value_in_run,
)
from mrtpo.safe_files import NoFollowFileHandler, make_dirs, no_follow, write_atomic

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
    """Verify (checksum, finiteness) and load a checkpoint on the CPU, memory-mapped,
    weights-only; a bad file is refused naming the usable ones beside it."""
    from mrtpo.run.checkpointing import CheckpointError, load_checkpoint

    path = Path(path)
    try:
        ckpt = load_checkpoint(path, map_location="cpu", mmap=True)
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
                f"{key}={mine!r}; +resume=<run> alone continues it with its own overrides "
                "(its .hydra/overrides.yaml): give only what a resume may change"
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
            f"run ({detail}); +resume=<run> alone continues it with its own model= overrides"
        )


def record_resume(cfg: DictConfig, run: str | Path) -> None:
    """After a validated resume: save this invocation beside the original config.

    Nothing is written through a link: a planted one is refused naming it (``safe_files``).
    """
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    overrides = given_overrides() or []
    run = Path(run)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    folder = run / ".hydra" / "resumes" / f"{stamp}-{os.getpid()}"
    make_dirs(folder, run)
    write_atomic(folder / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))
    write_atomic(folder / "config.yaml", OmegaConf.to_yaml(cfg, resolve=False))
    append_history(run / ".hydra", {"resume": True, "overrides": overrides})
    _log_into(run / "train.log")


def _log_into(target: Path) -> None:
    """Move a resume's pending job log (``config.job_log``) to the end of ``target``, the
    run's own log, and log there from now on."""
    fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    for h, pending in pending_logs():
        detach(h)
        fmt = h.formatter or fmt
        if pending.is_file():
            with open(target, "ab", opener=no_follow) as out:
                out.write(pending.read_bytes())
            pending.unlink()
            with contextlib.suppress(OSError):  # kept while another resume is pending
                pending.parent.rmdir()
    handler = NoFollowFileHandler(target, encoding="utf-8")
    handler.setFormatter(fmt)
    logging.getLogger().addHandler(handler)


# ---- the run's records of its commands and its pending log (also ``mrtpo.run.folder``'s) ----


def given_overrides() -> list[str] | None:
    """The overrides this Hydra job was given; None outside a Hydra job."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return [str(o) for o in HydraConfig.get().overrides.task]
    except Exception:
        return None


def append_history(hydra_dir: Path, entry: dict[str, Any]) -> None:
    """Append ``entry``, time-stamped, to ``<hydra_dir>/history.yaml`` (never via a link)."""
    entry = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), **entry}
    with open(hydra_dir / "history.yaml", "a", encoding="utf-8", opener=no_follow) as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create([entry])))


def pending_logs() -> list[tuple[logging.FileHandler, Path]]:
    """The root logger's handlers writing a resume's pending log (in ``resume-logs/``)."""
    return [
        (h, Path(h.baseFilename))
        for h in logging.getLogger().handlers
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent.name == "resume-logs"
    ]


def detach(handler: logging.Handler) -> None:
    """Close ``handler`` and take it off the root logger."""
    handler.close()
    logging.getLogger().removeHandler(handler)


# ---- the settings a resume may change ------------------------------------------------------

#: Where a checkpoint keeps the settings of the run that wrote it (``settings_record``).
SETTINGS_KEY = "mrtpo_settings"

#: ``fnmatch`` patterns of keys a ``+resume`` may change (where things go, how they show,
#: steps, processes, memory/speed knobs); any other change is refused before a write. Typed
#: settings say so on their field (``setting(resume=True)``); these are the untyped groups'.
RESUME_MAY_CHANGE: tuple[str, ...] = (
    "resume",
    "ckpt_path",
    "print_config",
    "allow_cpu",
    "job_name",
    "run_name",
    "paths.*",
    "callbacks",
    "callbacks.*",
    "logger",
    "logger.*",
    "trainer.max_steps",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.accelerator",
    "trainer.strategy",
    "trainer.strategy.*",
    "trainer.default_root_dir",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
    "trainer.val_check_interval",
    "rollout.engine",
    "rollout.engine.*",
    "rollout.val_max_new_tokens",
    "model.gradient_checkpointing",
    "model.attn_implementation",
    "model.tiny.build_root",
)


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(node, dict) and node:
        for k, v in node.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = node
    return out


def settings_record(cfg: DictConfig) -> str | None:
    """The run's resolved settings, one dotted key per leaf, as JSON (saved in checkpoints);
    None when the config cannot be resolved here."""
    try:
        # paths.* may move between invocations: record what is derived from them by name
        # (``<paths.data_dir>/spider``), so that a moved folder is not a changed setting
        copy = cfg.copy()
        OmegaConf.set_readonly(copy, False)
        with open_dict(copy):
            copy.pop("hydra", None)  # Hydra's own node (present in composed configs)
            for k in list(copy.get("paths") or {}):
                copy.paths[k] = f"<paths.{k}>"
        tree = OmegaConf.to_container(copy, resolve=True)
    except Exception as exc:  # no record is better than no run
        log.debug("settings not recorded: %s", exc)
        return None
    flat = _flatten(tree, "", {})
    from mrtpo.run.batch import global_batch

    # the world size and the global batch it makes: what a resume on other ranks must keep
    record = {"version": 1, "settings": flat, "batch": global_batch(cfg)}
    return json.dumps(record, sort_keys=True, default=str)


def may_change(key: str) -> bool:
    """A typed setting declared ``resume=True``, or a key of ``RESUME_MAY_CHANGE``."""
    from mrtpo.run.settings import resumable

    return key in resumable() or any(fnmatch.fnmatchcase(key, p) for p in RESUME_MAY_CHANGE)


def check_resume_settings(
    ckpt: dict[str, Any], settings: str | None, ckpt_path: str | Path
) -> None:
    """Refuse a resume whose ``settings_record`` differs from the checkpoint's beyond what
    ``may_change``; batch keys compare by the global batch they make (``batch_on_resume``)."""
    raw = ckpt.get(SETTINGS_KEY)
    mine_raw = settings
    if raw is None or mine_raw is None:
        log.warning(
            "%s holds no record of its run's settings (written by an older version): this "
            "resume's settings are not compared with the run's",
            ckpt_path,
        )
        return
    from mrtpo.run.batch import batch_on_resume

    theirs, mine = json.loads(raw), json.loads(mine_raw)
    same_batch, refusal = batch_on_resume(theirs, mine, ckpt_path)  # another world size
    if refusal:
        raise ResumeRefused(refusal)
    theirs, mine = theirs["settings"], mine["settings"]
    missing = "<not set>"
    changed = [
        f"{k}: {theirs.get(k, missing)!r} -> {mine.get(k, missing)!r}"
        for k in sorted(set(theirs) | set(mine))
        if not may_change(k)
        and k not in same_batch
        and theirs.get(k, missing) != mine.get(k, missing)
    ]
    if changed:
        raise ResumeRefused(
            f"this resume changes settings of the run that wrote {ckpt_path}: "
            + "; ".join(changed[:8])
            + (f" (and {len(changed) - 8} more)" if len(changed) > 8 else "")
            + ". A resume continues the same run and may change only where things go, the "
            "step limit, the number of processes and knobs of memory and speed (the list: "
            "RESUME_MAY_CHANGE in mrtpo/run/resume.py, docs/reliability.md). +resume=<run> "
            "alone takes the run's settings (its .hydra/overrides.yaml); or start a new run "
            f"from the checkpoint with ckpt_path={ckpt_path}"
        )


# ---- the command that continues a run ------------------------------------------------------


def resume_command(folder: str | Path) -> str:
    """The shell line that continues the run in ``folder``: what this invocation gave beyond
    the run's saved overrides, then ``+resume=<folder>``."""
    import shlex

    try:
        saved = saved_overrides(Path(folder)) or []
    except ValueError:  # unreadable: the command repeats all that was given
        saved = []
    given = given_overrides() or []  # (outside a Hydra job: the run's own record)
    kept = [
        o
        for o in given
        if not o.lstrip("+~").startswith(NOT_RESUMED) and (o not in saved or names_code(o))
    ]  # a resume takes a saved override that could name code only when it is repeated
    words = ["python", "src/train.py", *kept, f"+resume={folder}"]
    return " ".join(shlex.quote(w) for w in words)


# ---- a resume composed from the run's own overrides ------------------------------------------

#: Keys a resume passes on to the checkpoint's comparison (``check_resume_settings``), which
#: decides them, as it does the batch keys (they may change form when they make the same
#: global batch) and config groups (``trainer=ddp`` changes only keys a resume may change).
_CHECKED_LATER = ("dry_run", "hydra.*")
_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def resume_overrides(argv: Sequence[str]) -> list[str]:
    """``+resume=<run>``'s command line after the run's saved overrides. An override given
    beside it replaces a value a resume may change, is dropped when it repeats the run's, and
    is refused otherwise; ``argv`` is returned as it is without ``+resume`` or saved overrides."""
    from mrtpo.run.batch import BATCH_KEYS
    from mrtpo.run.settings import ConfigError

    words = list(argv)
    resume = next((w for w in words if is_override(w) and override_key(w) == "resume"), None)
    if resume is None:
        return words
    run = Path(resume.split("=", 1)[1])
    saved = saved_overrides(run) if run.is_dir() else None
    if saved is None:
        return words  # the resume's own checks say what is wrong with the folder
    refuse_untrusted(run, saved, words)
    theirs = {override_key(o): o.split("=", 1)[1] for o in saved if "=" in o}
    keep, extra, flags = list(saved), [], []
    for word in words:
        if not is_override(word):
            flags.append(word)
            continue
        key, value = override_key(word), word.split("=", 1)[1]
        if word == resume or (key in theirs and same_value(value, theirs[key])):
            continue
        free = may_change(key) or key in BATCH_KEYS or (_CONFIGS / key).is_dir()
        if free or any(fnmatch.fnmatchcase(key, p) for p in _CHECKED_LATER):
            keep = [o for o in keep if override_key(o) != key]
            extra.append(word)
            continue
        run_value = value_in_run(run, key, theirs)
        if same_value(value, run_value):
            continue
        raise ConfigError(
            f"{key}={value}: the run in {run} has {key}={run_value}, and +resume continues "
            "the run with its own settings (its .hydra/overrides.yaml); beside it give only "
            "what a resume may change (RESUME_MAY_CHANGE: trainer.max_steps, paths, devices, "
            f"memory and speed knobs), or start a new run from its checkpoint with "
            f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
        )
    return [*flags, *keep, *extra, resume]


# ---- a checkpoint at or past the step limit ------------------------------------------------


def _train_longer_command(run: str, step: int) -> str:
    """This resume's command line with ``trainer.max_steps=M`` (to be filled in) for the limit."""
    import shlex

    given = given_overrides()
    if given is None:  # composed outside a Hydra run
        given = [f"+resume={run}"]
    kept = [o for o in given if not o.lstrip("+~").startswith("trainer.max_steps=")]
    words = ["python", "src/train.py", *(shlex.quote(o) for o in kept), "trainer.max_steps=M"]
    return " ".join(words) + f"   (M above {step})"


class NothingToTrain(Exception):
    """A ``+resume`` of a run that already reached ``trainer.max_steps``: nothing was loaded or
    changed. The message says so, and how to train the run longer."""


def check_steps_left(cfg: DictConfig, ckpt_path: str | Path) -> None:
    """Refuse, before anything loads (``global_step`` is peeked), a start that would train no
    step, which Lightning would call completed. A ``+resume`` at ``trainer.max_steps`` raises
    ``NothingToTrain`` with the command that trains longer (settings checked first, so it is
    accepted), unless it stopped while exporting (``pending_export``): then the resume only
    exports. A resume past the limit, or a ``ckpt_path=`` start at or past it (it counts on
    from the checkpoint's step), is refused naming both numbers."""
    from mrtpo.run.checkpointing import peek_checkpoint
    from mrtpo.run.settings import ConfigError

    limit = OmegaConf.select(cfg, "trainer.max_steps", default=None)
    peek = peek_checkpoint(ckpt_path, ("global_step", SETTINGS_KEY))
    if peek is None or not isinstance(peek["global_step"], int) or not isinstance(limit, int):
        return  # unreadable here: the verified read that follows says why
    step = peek["global_step"]
    if step < limit:
        return
    resume = cfg.get("resume")
    if not resume:
        raise ConfigError(
            f"trainer.max_steps={limit} is not above step {step} of ckpt_path={ckpt_path}: "
            "a run from a checkpoint counts on from its step, so it would train nothing. Set "
            f"trainer.max_steps above {step} (trainer.max_steps={step + limit}: {limit} more steps)"
        )
    if step > limit:
        raise ResumeRefused(
            f"trainer.max_steps={limit} is below step {step} of {ckpt_path}: the resume would "
            f"train nothing. To train longer, resume with trainer.max_steps above {step}"
        )
    check_resume_settings(peek, settings_record(cfg), ckpt_path)
    from mrtpo.run.trained_run import pending_export

    owed = pending_export(cfg, step)
    if owed is not None:  # stopped while it exported: the resume trains nothing, exports
        log.warning(
            "run %s finished training at step %d but holds no export of it in %s (stopped "
            "while exporting?): resuming to export the policy of %s",
            *(resume, step, owed, ckpt_path),
        )
        return
    raise NothingToTrain(
        f"run {resume} already finished: {Path(ckpt_path).name} is at step {step} of "
        f"trainer.max_steps={limit}, so there is nothing to train.\n"
        f"To train it longer: {_train_longer_command(str(resume), step)}"
    )
