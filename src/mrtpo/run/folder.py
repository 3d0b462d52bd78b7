"""Run folders and resuming into them, without ever losing what a folder already holds.

``+resume=<run folder>`` continues a run in place. Before anything in that folder changes
(metrics, checkpoints, the saved overrides), the resume is validated: the checkpoint must be
readable, and it must have been trained with the same task, method, reward set and model
shapes as the resuming config. A refused resume leaves the folder byte for byte as it was.

Hydra does not write the resuming command's config into the folder (``hydra.output_subdir``
is null for a resume, see configs/hydra/default.yaml); once the resume is validated it is
recorded beside the original under ``.hydra/resumes/<time>/`` and appended to
``.hydra/history.yaml``. The original ``.hydra/overrides.yaml`` is never rewritten.

One process at a time runs in a run folder (``RunFolderLock``, an ``flock`` on the folder
itself that the kernel drops with its process; ``run.lock`` says who holds it), and a resume
may change only the settings of ``RESUME_MAY_CHANGE``: every checkpoint records its run's
settings (``settings_record``). Nothing the run writes in its folder goes through a link
someone else put there (``mrtpo.safe_files``): such a folder is refused before it is used.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from mrtpo.run.cli import log_to_files
from mrtpo.safe_files import (
    NoFollowFileHandler,
    UnsafePath,
    check_folders,
    make_dirs,
    no_follow,
    open_fd,
    refuse_unsafe,
    write_atomic,
)

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
    its folder (``mrtpo.run.checkpointing``), not with torch's internal messages. The read is
    weights-only: a pickle that would call a function is refused naming it, and never runs.
    """
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
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except Exception:
        overrides = []
    run = Path(run)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    folder = run / ".hydra" / "resumes" / f"{stamp}-{os.getpid()}"
    make_dirs(folder, run)
    write_atomic(folder / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))
    write_atomic(folder / "config.yaml", OmegaConf.to_yaml(cfg, resolve=False))
    entry = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "resume": True, "overrides": overrides}
    with open(run / ".hydra" / "history.yaml", "a", encoding="utf-8", opener=no_follow) as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create([entry])))
    _log_into(run / "train.log")


def _log_into(target: Path) -> None:
    """Hydra's job log of a resume went outside the folder until now (mrtpo.run.config.job_log):
    move what it holds to the end of ``target`` (the run's own log) and log there from here
    on."""
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
                with open(target, "ab", opener=no_follow) as out:
                    out.write(pending.read_bytes())
                pending.unlink()
                with contextlib.suppress(OSError):  # kept while another resume is pending
                    pending.parent.rmdir()
    handler = NoFollowFileHandler(target, encoding="utf-8")
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
    with open(folder / "history.yaml", "a", encoding="utf-8", opener=no_follow) as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create([entry])))


# ---- the settings a resume may change ------------------------------------------------------

#: Where a checkpoint keeps the settings of the run that wrote it (``settings_record``).
SETTINGS_KEY = "mrtpo_settings"

#: Keys (``fnmatch`` patterns over dotted keys) that a ``+resume`` may change: where things go
#: and how they are shown, how many steps, processes and nodes, and knobs that change memory
#: or speed but not what is computed. Every other setting must equal the run's (the
#: checkpoint records them); a resume that changes one is refused before anything is written.
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
    "rl.micro_batch_size",
    "rl.max_nonfinite_steps",
    "rl.max_consecutive_score_failures",
    "rl.replay_oom_retries",
    "rl.measure_logp_gap",
    "rl.shared_prompt_forward",
    "replay.token_budget",
    "replay.jsd_chunk",
    "replay.noise_floor",
    "data.val_prompts",
    "data.val_batch_size",
)


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(node, dict) and node:
        for k, v in node.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = node
    return out


def settings_record(cfg: DictConfig) -> str | None:
    """The run's resolved settings, one dotted key per leaf, as JSON (saved in checkpoints).

    None when the config cannot be resolved here (a library caller's partial config).
    """
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
    from mrtpo.run.settings import global_batch

    # the world size and the global batch it makes: what a resume on other ranks must keep
    record = {"version": 1, "settings": flat, "batch": global_batch(cfg)}
    return json.dumps(record, sort_keys=True, default=str)


def may_change(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in RESUME_MAY_CHANGE)


def check_resume_settings(
    ckpt: dict[str, Any], settings: str | None, ckpt_path: str | Path
) -> None:
    """Refuse a resume whose settings (``settings_record`` of its config, taken before the
    run derives anything from it) differ from the checkpoint's, except ``RESUME_MAY_CHANGE``.
    The batch keys are compared by the global batch they make on each world size
    (``mrtpo.run.settings.batch_on_resume``)."""
    raw = ckpt.get(SETTINGS_KEY)
    mine_raw = settings
    if raw is None or mine_raw is None:
        log.warning(
            "%s holds no record of its run's settings (written by an older version): this "
            "resume's settings are not compared with the run's",
            ckpt_path,
        )
        return
    from mrtpo.run.settings import batch_on_resume

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
            "RESUME_MAY_CHANGE in mrtpo/run/folder.py, docs/reliability.md). +resume=<run> "
            "alone takes the run's settings (its .hydra/overrides.yaml); or start a new run "
            f"from the checkpoint with ckpt_path={ckpt_path}"
        )


# ---- the command that continues a run ------------------------------------------------------

#: Overrides a resume command leaves out: its own ``+resume``, a start checkpoint (a resume
#: starts from last.ckpt), the dry run, Hydra's own keys.
_NOT_RESUMED = ("resume=", "ckpt_path=", "dry_run=", "hydra.")


def resume_command(folder: str | Path) -> str:
    """The command that continues the run in ``folder``, as a shell line: ``+resume=<folder>``
    (the resume takes the run's own overrides from its ``.hydra/overrides.yaml``,
    ``resume_overrides``) after what this invocation gave beyond those (a resumed run's new
    ``trainer.max_steps``)."""
    import shlex

    try:
        saved = _saved_overrides(Path(folder)) or []
    except ValueError:  # unreadable: the command repeats all that was given
        saved = []
    try:
        from hydra.core.hydra_config import HydraConfig

        given = [str(o) for o in HydraConfig.get().overrides.task]
    except Exception:  # not inside a Hydra job: the run's own record
        given = []
    kept = [
        o
        for o in given
        if not o.lstrip("+~").startswith(_NOT_RESUMED) and (o not in saved or _names_code(o))
    ]  # a resume takes a saved override that could name code only when it is repeated
    words = ["python", "src/train.py", *kept, f"+resume={folder}"]
    return " ".join(shlex.quote(w) for w in words)


# ---- a resume composed from the run's own overrides ------------------------------------------

#: Keys a resume passes on to the checkpoint's comparison (``check_resume_settings``), which
#: decides them, as it does the batch keys (they may change form when they make the same
#: global batch) and config groups (``trainer=ddp`` changes only keys a resume may change).
_CHECKED_LATER = ("dry_run", "hydra.*")
_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _override_key(word: str) -> str:
    return word.split("=", 1)[0].lstrip("+~")


def _is_override(word: str) -> bool:
    return "=" in word and not word.startswith("-")


def _run_value(run: Path, key: str, saved: dict[str, str]) -> Any:
    """The run's value of ``key``: as its overrides gave it, else its config group's choice
    (``.hydra/hydra.yaml``), else the leaf of its saved config; ``<not set>`` when none."""
    import yaml

    if key in saved:
        return saved[key]
    hydra_dir = run / ".hydra"
    for name, path in (("choices", "hydra.yaml"), ("config", "config.yaml")):
        try:
            data = yaml.safe_load((hydra_dir / path).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            continue
        node: Any = data.get("hydra", {}).get("runtime", {}).get("choices", {})
        if name == "choices":
            if isinstance(node, dict) and key in node:
                return node[key]
            continue
        node = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return "<not set>"
            node = node[part]
        return node
    return "<not set>"


def _same(given: str, theirs: Any) -> bool:
    import yaml

    try:
        value = yaml.safe_load(given)
    except yaml.YAMLError:
        value = given
    if isinstance(theirs, str):
        with contextlib.suppress(yaml.YAMLError):
            theirs = yaml.safe_load(theirs)
    return value == theirs or str(value) == str(theirs)


#: Keys whose value names code a run imports or runs: the custom task's functions and import
#: folders (tasks/custom/task.py), and a started vLLM server's arguments.
_CODE_KEYS = (
    "task.rewards",
    "task.blocks",
    "task.success",
    "task.import_dirs",
    "rollout.engine.server_args",
)
#: Nodes the run instantiates: a ``+`` addition under one may add an object to build.
_BUILT = ("callbacks", "method", "rollout.engine", "logger", "trainer")


def _names_code(override: str) -> bool:
    """Whether a saved override could make the run import or run code: an interpolation, an
    instantiation key, an addition under a node the run builds, a Hydra key or group, or a
    key of ``_CODE_KEYS``. A config group choice (``task=custom``) names a committed file."""
    key = _override_key(override)
    return (
        "${" in override
        or any(m in override for m in ("_target_", "_args_", "_partial_"))
        or (override.startswith("+") and _under(key.split("@", 1)[-1], _BUILT))
        or key == "hydra"
        or key.startswith(("hydra/", "hydra."))
        or _under(key, _CODE_KEYS)
    )


def _under(key: str, names: Sequence[str]) -> bool:
    return any(key == n or key.startswith((f"{n}.", f"{n}[")) for n in names)


def _others_may_write(st: os.stat_result) -> bool:
    """World-writable, or group-writable by a group other than the user's own private group
    (umask 002 gives every file of a user-private-group system the group's write bit)."""
    import grp
    import pwd

    if st.st_mode & 0o002:
        return True
    if not st.st_mode & 0o020:
        return False
    try:
        group, user = grp.getgrgid(st.st_gid), pwd.getpwuid(os.getuid())
    except KeyError:
        return True
    return not (group.gr_name == user.pw_name and st.st_gid == user.pw_gid and not group.gr_mem)


def _owned_text(path: Path) -> str:
    """``path``'s text, refused unless it is a file (not a link) of this user that no one
    else may write: a resume takes its overrides from it."""
    from mrtpo.run.settings import ConfigError

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or _others_may_write(st):
            raise ConfigError(
                f"{path} is not yours or others may write it (mode {st.st_mode & 0o777:o}, "
                f"owner uid {st.st_uid}): a resume takes the run's overrides from it; check "
                f"it, then chown it to you and chmod go-w it"
            )
        return f.read().decode("utf-8")


def _untrusted(run: Path, saved: list[str], words: list[str]) -> None:
    """Refuse a saved override that could name code (``_names_code``) unless the same
    override is given beside ``+resume``: the user says to run it, not the folder."""
    import shlex

    from mrtpo.run.settings import ConfigError

    missing = [o for o in saved if _names_code(o) and o not in words]
    if missing:
        add = " ".join(shlex.quote(o) for o in missing)
        raise ConfigError(
            f"+resume={run}: its .hydra/overrides.yaml has {', '.join(missing)}, which can "
            f"name code to run; a resume takes such an override only when you repeat it. "
            f"If you trust it, add it: python src/train.py {add} {shlex.quote(f'+resume={run}')}"
        )


def _saved_overrides(run: Path) -> list[str] | None:
    """The run's ``.hydra/overrides.yaml``, read as data; None when the folder has none."""
    import yaml

    from mrtpo.run.settings import ConfigError

    path = run / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    try:
        saved = yaml.safe_load(_owned_text(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"+resume={run}: cannot read {path} ({type(exc).__name__})") from None
    if saved is None:
        return []
    if not isinstance(saved, list) or not all(isinstance(o, str) for o in saved):
        raise ConfigError(f"+resume={run}: {path} is not a list of overrides")
    return [o for o in saved if not o.lstrip("+~").startswith(_NOT_RESUMED)]


def resume_overrides(argv: Sequence[str]) -> list[str]:
    """The command line of ``+resume=<run>`` completed with the run's own overrides.

    The run's ``.hydra/overrides.yaml`` comes first; an override given beside ``+resume``
    replaces the run's value of a key a resume may change (``RESUME_MAY_CHANGE``), is dropped
    when it repeats the run's value, and is refused naming the run's value otherwise. Without
    ``+resume``, or for a folder that records no overrides, ``argv`` is returned as it is."""
    from mrtpo.run.settings import BATCH_KEYS, ConfigError

    words = list(argv)
    resume = next((w for w in words if _is_override(w) and _override_key(w) == "resume"), None)
    if resume is None:
        return words
    run = Path(resume.split("=", 1)[1])
    saved = _saved_overrides(run) if run.is_dir() else None
    if saved is None:
        return words  # the resume's own checks say what is wrong with the folder
    _untrusted(run, saved, words)
    theirs = {_override_key(o): o.split("=", 1)[1] for o in saved if "=" in o}
    keep, extra, flags = list(saved), [], []
    for word in words:
        if not _is_override(word):
            flags.append(word)
            continue
        key, value = _override_key(word), word.split("=", 1)[1]
        if word == resume or (key in theirs and _same(value, theirs[key])):
            continue
        free = may_change(key) or key in BATCH_KEYS or (_CONFIGS / key).is_dir()
        if free or any(fnmatch.fnmatchcase(key, p) for p in _CHECKED_LATER):
            keep = [o for o in keep if _override_key(o) != key]
            extra.append(word)
            continue
        run_value = _run_value(run, key, theirs)
        if _same(value, run_value):
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

    try:
        from hydra.core.hydra_config import HydraConfig

        given = [str(o) for o in HydraConfig.get().overrides.task]
    except Exception:  # composed outside a Hydra run
        given = [f"+resume={run}"]
    kept = [o for o in given if not o.lstrip("+~").startswith("trainer.max_steps=")]
    words = ["python", "src/train.py", *(shlex.quote(o) for o in kept), "trainer.max_steps=M"]
    return " ".join(words) + f"   (M above {step})"


class NothingToTrain(Exception):
    """A ``+resume`` of a run that already reached ``trainer.max_steps``: nothing was loaded or
    changed. The message says so, and how to train the run longer."""


def check_steps_left(cfg: DictConfig, ckpt_path: str | Path) -> None:
    """Refuse, before anything loads, a start from ``ckpt_path`` that would train no step
    (Lightning would train none and call the run completed). The checkpoint's
    ``global_step`` is read without reading its tensors.

    A ``+resume`` whose checkpoint is at ``trainer.max_steps`` (the run finished) raises
    ``NothingToTrain`` with the command that trains longer (its settings are checked first,
    so that command is accepted), unless the run was stopped while it exported its policy
    (``mrtpo.run.trained_run.pending_export``): then it returns, and the resume trains no
    step and writes the export. A checkpoint past ``trainer.max_steps`` (a resume), or at
    or past it for a new run from ``ckpt_path=`` (which counts on from the checkpoint's
    step), is refused naming both numbers.
    """
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


def _only_info(log_file: Path) -> bool:
    """Whether every line of a log written with the project's format is an INFO line."""
    try:
        lines = log_file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return False
    return all("][INFO] - " in line for line in lines if line.strip())


def drop_pending_log() -> None:
    """After a resume that did nothing: close its pending log (``mrtpo.run.config.job_log``) and
    remove it if it holds no warning or error (a start-up note such as the thread count is
    not worth a file), with its folder if that is then empty."""
    root = logging.getLogger()
    for h in list(root.handlers):
        name = Path(getattr(h, "baseFilename", "") or ".")
        if not isinstance(h, logging.FileHandler) or name.parent.name != "resume-logs":
            continue
        h.close()
        root.removeHandler(h)
        if name.is_file() and _only_info(name):
            name.unlink()
            with contextlib.suppress(OSError):  # kept while another resume is pending
                name.parent.rmdir()


# ---- one process at a time in a run folder -------------------------------------------------

#: The record of a run folder: who runs there while a run does (absent otherwise). The lock
#: itself is an ``flock`` on the folder, which deleting this file cannot break.
LOCK_NAME = "run.lock"

#: What a run writes in its folder, besides its checkpoints: a run starting in a folder where
#: one of these is a link, or not a regular file, is refused before anything is written.
RUN_FILES = (
    LOCK_NAME,
    "train.log",
    ".hydra/history.yaml",
    "csv/metrics.csv",
    "samples.jsonl",
    "relevance.jsonl",
    "curves.png",
    "job.json",
)

#: The folders they go in (checkpoints/ is ``mrtpo.run.checkpointing``'s).
RUN_FOLDERS = (".hydra", ".hydra/resumes", "csv")

_HELD: dict[str, tuple[int, ...]] = {}  # resolved run folder -> its open descriptors, here


class RunFolderBusy(ResumeRefused):
    """Another live process runs in this run folder; nothing was changed."""


class RunFolderUnusable(ResumeRefused):
    """The run folder cannot take a run: read-only, or a name the run writes is a link, a
    FIFO or a folder. Nothing was changed."""


def _close_held_in_child() -> None:
    # A forked child (a worker pool) must not keep the parent's lock alive after the parent
    # dies; closing its copy does not release the parent's lock.
    for fds in _HELD.values():
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


def _secondary_process() -> bool:
    """A worker of a multi-process run (DDP rank > 0, another node): the launching process
    of the run holds the folder's lock for all of them."""
    keys = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")
    return any(os.environ.get(k, "0").strip() not in ("", "0") for k in keys)


def _holder() -> bytes:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }
    return (json.dumps(info) + "\n").encode()


def _flock(fd: int) -> bool | None:
    """Lock ``fd`` exclusively without waiting: True, False (another process holds it), or
    None (this filesystem has no ``flock`` for it)."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _flock_owner(fd: int) -> int | None:
    """The pid holding an ``flock`` on ``fd``'s file, from ``/proc/locks`` (Linux)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        f = line.split()
        if len(f) > 5 and f[1] == "FLOCK" and f[5] == ident and f[4].isdigit():
            return int(f[4])
    return None


def _busy_message(folder: Path, dir_fd: int | None = None) -> str:
    """Who holds ``folder``: the record in its run.lock, else the pid the kernel knows."""
    data = b""
    with contextlib.suppress(OSError, ValueError):
        fd = open_fd(folder / LOCK_NAME, os.O_RDONLY)
        data = os.pread(fd, 1 << 16, 0)
        os.close(fd)
    try:
        h = json.loads(data.decode())
        who = f"process {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        pid = _flock_owner(dir_fd) if dir_fd is not None else None
        gone = not os.path.lexists(folder / LOCK_NAME)
        who = (
            "a process that is still starting (it has not recorded itself yet)"
            if pid is None
            else f"process {pid} on this machine"
            + (f", whose record in {LOCK_NAME} was deleted" if gone else "")
        )
    return (
        f"run folder {folder} is in use by another run ({who}); two runs in one folder would "
        f"mix their metrics and checkpoints. Wait for it to end or stop it, then resume. "
        "The lock is released by the system when its process dies: there is nothing to delete"
    )


def _cannot_write(folder: Path, exc: OSError) -> RunFolderUnusable:
    """A one-line refusal for a run folder that cannot be written (read-only, no
    permission); any other error is raised as it is."""
    if exc.errno == errno.EROFS:
        return RunFolderUnusable(
            f"run folder {folder} is on a read-only filesystem, and a run writes its "
            f"metrics, checkpoints and log there. Copy it somewhere writable (cp -a {folder} "
            "<new place>) and resume the copy"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return RunFolderUnusable(
            f"run folder {folder} cannot be written by this user ({exc.strerror}): give this "
            "user write permission, or copy the folder somewhere writable and resume the copy"
        )
    raise exc


def check_planted(folder: Path) -> None:
    """Refuse a folder where a name a run writes (``RUN_FILES``, ``RUN_FOLDERS``) is a link
    or not what it should be: nothing written there may land elsewhere."""
    try:
        for name in RUN_FOLDERS:
            check_folders(folder / name, folder)
        for name in RUN_FILES:
            check_folders((folder / name).parent, folder)
            refuse_unsafe(folder / name)
    except UnsafePath as exc:
        raise RunFolderUnusable(str(exc)) from None


class RunFolderLock:
    """An exclusive lock on a run folder for the ``with`` block (a no-op in worker ranks).

    Taken with ``flock`` on the folder itself, so the kernel releases it when the process
    dies however it dies (a stale lock needs no cleaning), and deleting ``run.lock`` does not
    free it. The holder records itself in ``run.lock``; another process gets
    ``RunFolderBusy`` naming it. A folder that is read-only, or where a name the run writes
    is a link, a FIFO or a folder, is refused (``RunFolderUnusable``). Until ``accept()`` is
    called, leaving the block by an exception puts ``run.lock`` back as it was, so a refused
    run changes nothing; otherwise ``run.lock`` is removed when the block ends (while the
    folder is still locked), so no record of a holder outlives its run.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.fd: int | None = None  # run.lock, while held
        self.dir_fd: int | None = None  # the folder, locked
        self.previous: bytes | None = None  # None: this lock created run.lock
        self.accepted = False

    def accept(self) -> None:
        self.accepted = True

    def _open_record(self) -> tuple[int, bool]:
        """run.lock, opened for writing (created when missing); never through a link."""
        path = self.folder / LOCK_NAME
        try:
            try:
                return open_fd(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                return open_fd(path, os.O_RDWR), False
        except UnsafePath as exc:
            raise RunFolderUnusable(str(exc)) from None
        except OSError as exc:
            raise _cannot_write(self.folder, exc) from exc

    def __enter__(self) -> RunFolderLock:
        key = str(self.folder.resolve())
        if _secondary_process() or key in _HELD or not self.folder.is_dir():
            return self
        try:
            dir_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise _cannot_write(self.folder, exc) from exc
        fd, created = None, False
        try:
            locked = _flock(dir_fd)
            if locked is False:
                raise RunFolderBusy(_busy_message(self.folder, dir_fd))
            check_planted(self.folder)
            fd, created = self._open_record()
            if locked is None:  # no flock on folders here: lock run.lock itself
                locked = _flock(fd)
                if locked is False:
                    raise RunFolderBusy(_busy_message(self.folder))
                if locked is None:
                    log.warning("cannot lock run folder %s; running without", self.folder)
        except BaseException:
            if fd is not None:
                os.close(fd)
                if created:
                    (self.folder / LOCK_NAME).unlink(missing_ok=True)
            os.close(dir_fd)
            raise
        self.previous = None if created else os.pread(fd, os.fstat(fd).st_size, 0)
        self.fd, self.dir_fd = fd, dir_fd
        _HELD[key] = (fd, dir_fd)
        self._write(_holder())
        return self

    def _write(self, data: bytes) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.fd is None:
            return
        try:
            if exc_type is not None and not self.accepted and self.previous is not None:
                self._write(self.previous)  # a refused run changes nothing
            else:  # the run ended (or made run.lock): no holder is left to name
                (self.folder / LOCK_NAME).unlink(missing_ok=True)
        finally:
            _HELD.pop(str(self.folder.resolve()), None)
            os.close(self.fd)
            os.close(self.dir_fd)  # releases the flock
            self.fd = self.dir_fd = None


def run_folder_of(cfg: DictConfig) -> Path | None:
    """The folder a training config runs in: the resumed run's, or ``paths.output_dir``."""
    if cfg.get("resume"):
        return Path(str(cfg.resume))
    out = OmegaConf.select(cfg, "paths.output_dir", default=None)
    return Path(str(out)) if out else None


def park_refused_log(cfg: DictConfig, reason: BaseException | None = None) -> Path | None:
    """After a refused resume: write the reason into its pending log (``mrtpo.run.config.job_log``,
    ``<paths.log_dir>/<job>/resume-logs/``), first moving the log there when an older hydra
    config put it beside the resumed folder's parent (anywhere on the disk for a folder that
    is not a run); the emptied folder is removed. Returns the log's path, or None."""
    log_dir = OmegaConf.select(cfg, "paths.log_dir", default=None)
    if not log_dir:
        return None
    home = Path(str(log_dir)).resolve() / str(cfg.get("job_name") or "train") / "resume-logs"
    root = logging.getLogger()
    moved = None
    for h in list(root.handlers):
        name = Path(getattr(h, "baseFilename", "") or ".")
        if not isinstance(h, logging.FileHandler) or name.parent.name != "resume-logs":
            continue
        if name.parent.resolve().is_relative_to(home.parent.parent):
            log_to_files(logging.ERROR, f"resume refused: {reason} (this log: {name})")
            moved = name  # already inside the log folder
            continue
        h.flush()
        h.close()
        root.removeHandler(h)
        home.mkdir(parents=True, exist_ok=True)
        moved = home / name.name
        if name.is_file():
            shutil.move(name, moved)
        with contextlib.suppress(OSError):
            name.parent.rmdir()
        handler = NoFollowFileHandler(moved, encoding="utf-8")
        handler.setFormatter(h.formatter)
        root.addHandler(handler)
        log_to_files(logging.ERROR, f"resume refused: {reason} (this log: {moved})")
    return moved


# ---- a new run never writes into a folder that holds anything -------------------------------

#: Folders chosen with ``hydra.run.dir``/``paths.output_dir`` for a new run, checked before
#: Hydra wrote into them: resolved folder -> (it existed, the folders above it that did not).
#: A run refused before it trained removes what was made for it (``discard_refused_folder``).
#: The current run's only: a process runs one at a time, each check starts it afresh.
_CHOSEN: dict[str, tuple[bool, list[str]]] = {}

#: The values these keys have when not set: a new folder of this process (``unique_dir``),
#: or the resumed run's.
_DEFAULT_FOLDERS = {"hydra.run.dir": "${mrtpo.run_dir:", "paths.output_dir": "${hydra:runtime"}


def _chosen_folder(cfg: DictConfig, key: str) -> Path | None:
    """The folder ``key`` names when the user set it; None when it has its default."""
    parent, leaf = key.rsplit(".", 1)
    node = OmegaConf.select(cfg, parent, default=None)
    if node is None:
        return None
    # (never ``leaf in node``: it would resolve the default and make a new run folder)
    raw = OmegaConf.to_container(node, resolve=False).get(leaf)
    if raw is None or str(raw).startswith(_DEFAULT_FOLDERS[key]):
        return None
    return Path(str(OmegaConf.select(cfg, key)))


def check_new_run_folder(cfg: DictConfig) -> None:
    """Refuse, before Hydra writes its ``.hydra/`` and log there, a new run whose chosen
    folder (``hydra.run.dir``, ``paths.output_dir``) already holds anything: it would replace
    a finished run's metrics and checkpoints, or edit a user's files. A resume continues its
    run in place (``+resume=<folder>``); a DDP worker runs in its launcher's folder."""
    from mrtpo.run.settings import ConfigError, check_names

    check_names(cfg)
    _CHOSEN.clear()
    if cfg.get("resume") or _secondary_process():
        return
    for key in _DEFAULT_FOLDERS:
        folder = _chosen_folder(cfg, key)
        if folder is None:
            continue
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise ConfigError(f"{key}={folder} is not a folder: name a new or empty folder")
        if folder.is_dir() and any(folder.iterdir()):
            raise ConfigError(
                f"{key}={folder} already holds files, and a new run there would replace or "
                "append to them: name a new or empty folder, or continue the run in it with "
                f"+resume={folder}"
            )
        missing = [p for p in [folder, *folder.parents] if not p.exists()]
        _CHOSEN[str(folder.resolve())] = (folder.exists(), [str(p) for p in missing[1:]])


def _refuse_early(check, config: DictConfig) -> None:
    """Run ``check`` on the composed config as Hydra starts; its refusal is one line."""
    from hydra.core.hydra_config import HydraConfig

    from mrtpo.run import cli
    from mrtpo.run.settings import ConfigError

    HydraConfig.instance().set_config(config)  # ${hydra:...} in run_name resolves
    try:
        check(config)
    except ConfigError as exc:
        if not cli.COMMAND_LINE:
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - the bare GPU runner has no Hydra
    Callback = object  # type: ignore[assignment,misc]


class NewRunFolderCheck(Callback):
    """Hydra callback (configs/hydra/default.yaml): ``check_new_run_folder`` before Hydra
    makes or writes the run folder, and the names of a sweep before its jobs start."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_early(check_new_run_folder, config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from mrtpo.run.settings import check_names

        _refuse_early(check_names, config)


# ---- a new run refused before it trained leaves no folder -----------------------------------

#: What a new run's folder holds before its first step: Hydra's config (``.hydra/``), the
#: run's record of its command (``history.yaml``), its job log and empty folders its loggers
#: made (``csv/``). A folder holding anything else is a run's, and is kept.
HYDRA_START_FILES = frozenset({"config.yaml", "hydra.yaml", "overrides.yaml", "history.yaml"})


def _empty_tree(folder: Path) -> bool:
    return all(p.is_dir() and not p.is_symlink() and _empty_tree(p) for p in folder.iterdir())


def _only_hydra_start(folder: Path) -> bool:
    for entry in folder.iterdir():
        if entry.is_symlink():
            return False
        if entry.name == ".hydra" and entry.is_dir():
            if not all(p.name in HYDRA_START_FILES and p.is_file() for p in entry.iterdir()):
                return False
        elif entry.is_dir():
            if not _empty_tree(entry):
                return False
        elif not (entry.is_file() and entry.suffix == ".log"):
            return False
    return True


def is_refusal(exc: BaseException) -> bool:
    """A run refused before it started: a config value that cannot work (``ConfigError``:
    a bad value, a key nothing reads, the paper's data missing, GPUs the machine lacks) or a
    file that is not there, as such or wrapped by Hydra's ``instantiate``. Their one line
    says it all (``mrtpo.run.cli.run_job`` points at no traceback); after any other error (a
    model that cannot load) the run folder keeps the log holding its traceback."""
    from hydra.errors import InstantiationException

    from mrtpo.run.settings import ConfigError

    if isinstance(exc, InstantiationException):
        exc = exc.__cause__
    return isinstance(exc, (ConfigError, FileNotFoundError))


def discard_refused_folder(cfg: DictConfig) -> Path | None:
    """After a new run that stopped before it trained (refused, or ``dry_run=true``): remove
    the run folder this process created for it (``mrtpo.run.config.unique_dir``) and the empty
    folders it created above it, so a refused command leaves nothing on the disk. A folder
    named with ``hydra.run.dir``/``paths.output_dir`` goes the same way when this run made
    it, and is emptied of Hydra's files when it was an empty folder before
    (``check_new_run_folder``). A resume's folder, a sweep's job folder (its ``job.json``
    records the failure) and a folder holding anything but Hydra's config and log are kept.
    Returns the removed (or emptied) folder, or None."""
    from mrtpo.run.config import made_here

    if cfg.get("resume") or _secondary_process():
        return None
    folder = run_folder_of(cfg)
    made = made_here(folder) if folder is not None else None
    entry = _CHOSEN.pop(str(folder.resolve()), None) if folder is not None else None
    existed, chosen = entry or (False, [])
    if not made and entry is not None:
        made = [folder, *map(Path, chosen)]  # a folder the user named, made for this run
    if not made or not made[0].is_dir() or not _only_hydra_start(made[0]):
        return None
    root = logging.getLogger()
    for h in list(root.handlers):  # the job log: closed before its file goes
        name = getattr(h, "baseFilename", "")
        if isinstance(h, logging.FileHandler) and Path(name).parent == made[0].resolve():
            h.close()
            root.removeHandler(h)
    if existed:  # an empty folder the user named: emptied again, kept
        for entry in made[0].iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        return made[0]
    shutil.rmtree(made[0], ignore_errors=True)
    for parent in made[1:]:
        with contextlib.suppress(OSError):  # not empty: something else lives there
            parent.rmdir()
    return made[0]
