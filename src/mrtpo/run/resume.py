"""Resuming a run in its own folder, without ever losing what the folder already holds
(docs/reliability.md).

``+resume=<run folder>`` continues a run with its own overrides (``resume_overrides``), read
as data from a file only this user may write; one that could name code is taken only when
repeated. Before anything changes, the checkpoint must be readable and of the same task,
method, rewards, model shapes and settings but for ``RESUME_MAY_CHANGE``. An accepted resume
is recorded under ``.hydra/resumes/<time>/`` and in ``.hydra/history.yaml``."""

from __future__ import annotations

import contextlib
import fnmatch
import grp
import json
import logging
import os
import pwd
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from mrtpo.run.config import CONFIG_DIR, given_overrides
from mrtpo.run.config_keys import dig
from mrtpo.run.placement import world_size
from mrtpo.run.settings import PER_RANK_DEFAULTS, ConfigError, RLConfig, resumable
from mrtpo.run.trained_run import pending_export
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
    """Verify and load a checkpoint on the CPU (memory-mapped, weights-only), or refuse it."""
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
    """After a validated resume: save this invocation beside the original config (not via links)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    overrides = given_overrides() or []
    run = Path(run)
    folder = run / ".hydra" / "resumes" / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    make_dirs(folder, run)
    write_atomic(folder / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))
    write_atomic(folder / "config.yaml", OmegaConf.to_yaml(cfg, resolve=False))
    append_history(run / ".hydra", {"resume": True, "overrides": overrides})
    _log_into(run / "train.log")


def _log_into(target: Path) -> None:
    """Append a resume's pending job log (``config.job_log``) to ``target``; log there from now."""
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


#: The rl keys that state the batch, per rank or over all ranks: a resume is compared by the
#: global batch they make (``batch_on_resume``), not key by key.
BATCH_KEYS = tuple(f"rl.{form}{key}" for key in PER_RANK_DEFAULTS for form in ("", "global_"))


def global_batch(cfg, ranks: int | None = None) -> dict[str, int] | None:
    """One RL step over all ranks, whatever form the batch keys take: ``world_size``
    (default: ``cfg.trainer``'s processes), ``prompts_per_step`` and ``mini_batch_size`` (as
    the update counts it: capped at a rank's responses). None without a usable ``rl``/trainer."""
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
    """The global batch of a ``settings_record``: as recorded, or (older records) worked out
    from its ``trainer.*`` and ``rl.*`` settings (``trainer.devices=auto``: this machine's)."""
    if isinstance(record.get("batch"), Mapping):
        return dict(record["batch"])
    tree = OmegaConf.create()
    for key, value in (record.get("settings") or {}).items():
        if key.startswith(("trainer.", "rl.")):
            OmegaConf.update(tree, key, value, force_add=True)
    return global_batch(tree) if "rl" in tree else None


def batch_on_resume(theirs: Mapping, mine: Mapping, ckpt_path) -> tuple[tuple[str, ...], str]:
    """(batch keys the key-by-key comparison skips, refusal or '') for a checkpoint's global
    batch (``theirs``) and a resume's (``mine``): another one on another world size is refused."""
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


#: Where a checkpoint keeps the settings of the run that wrote it (``settings_record``).
SETTINGS_KEY = "mrtpo_settings"

#: ``fnmatch`` patterns of the untyped keys a ``+resume`` may change (where things go, how they
#: show, steps, processes, memory/speed knobs); typed ones say so (``setting(resume=True)``).
RESUME_MAY_CHANGE: tuple[str, ...] = (
    *("resume", "ckpt_path", "print_config", "allow_cpu", "job_name", "run_name", "paths.*"),
    *("callbacks", "callbacks.*", "logger", "logger.*"),
    *(f"trainer.{k}" for k in ("max_steps", "devices", "num_nodes", "accelerator", "strategy")),
    *("trainer.strategy.*", "trainer.default_root_dir", "trainer.val_check_interval"),
    *("trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.log_every_n_steps"),
    *("rollout.engine", "rollout.engine.*", "rollout.val_max_new_tokens"),
    *("model.gradient_checkpointing", "model.attn_implementation", "model.tiny.build_root"),
)


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(node, dict) and node:
        for k, v in node.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = node
    return out


def settings_record(cfg: DictConfig) -> str | None:
    """The run's resolved settings (a dotted key per leaf) as JSON; None if they do not resolve."""
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
    # the world size and the global batch it makes: what a resume on other ranks must keep
    record = {"version": 1, "settings": flat, "batch": global_batch(cfg)}
    return json.dumps(record, sort_keys=True, default=str)


def may_change(key: str) -> bool:
    """A typed setting declared ``resume=True``, or a key of ``RESUME_MAY_CHANGE``."""
    return key in resumable() or any(fnmatch.fnmatchcase(key, p) for p in RESUME_MAY_CHANGE)


def check_resume_settings(
    ckpt: dict[str, Any], settings: str | None, ckpt_path: str | Path
) -> None:
    """Refuse settings changed beyond ``may_change`` (batch keys: by the global batch they make)."""
    raw = ckpt.get(SETTINGS_KEY)
    if raw is None or settings is None:
        log.warning(
            "%s holds no record of its run's settings (written by an older version): this "
            "resume's settings are not compared with the run's",
            ckpt_path,
        )
        return
    theirs, mine = json.loads(raw), json.loads(settings)
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


#: Overrides a resume command leaves out: its own ``+resume``, a start checkpoint (a resume
#: starts from last.ckpt), the dry run, Hydra's own keys.
NOT_RESUMED = ("resume=", "ckpt_path=", "dry_run=", "hydra.")


def override_key(word: str) -> str:
    return word.split("=", 1)[0].lstrip("+~")


def is_override(word: str) -> bool:
    return "=" in word and not word.startswith("-")


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return {}


def value_in_run(run: Path, key: str, saved: dict[str, str]) -> Any:
    """The run's ``key``: its override, group choice or saved config's leaf (``<not set>``)."""
    if key in saved:
        return saved[key]
    choices = dig(_yaml(run / ".hydra" / "hydra.yaml"), "hydra.runtime.choices")
    if isinstance(choices, dict) and key in choices:
        return choices[key]
    node = _yaml(run / ".hydra" / "config.yaml")
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "<not set>"
        node = node[part]
    return node


def same_value(given: str, theirs: Any) -> bool:
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
    *(f"task.{k}" for k in ("rewards", "blocks", "success", "import_dirs")),
    "rollout.engine.server_args",
)
#: Nodes the run instantiates: a ``+`` addition under one may add an object to build.
_BUILT = ("callbacks", "method", "rollout.engine", "logger", "trainer")


def names_code(override: str) -> bool:
    """Whether a saved override could make the run import or run code (a group choice such as
    ``task=custom`` names a committed file: it cannot)."""
    key = override_key(override)
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
    """``path``'s text, refused unless a file (not a link) of this user no one else may write."""
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


def refuse_untrusted(run: Path, saved: list[str], words: list[str]) -> None:
    """Refuse a saved override that could name code (``names_code``) unless the same
    override is given beside ``+resume``: the user says to run it, not the folder."""
    missing = [o for o in saved if names_code(o) and o not in words]
    if missing:
        add = " ".join(shlex.quote(o) for o in missing)
        raise ConfigError(
            f"+resume={run}: its .hydra/overrides.yaml has {', '.join(missing)}, which can "
            f"name code to run; a resume takes such an override only when you repeat it. "
            f"If you trust it, add it: python src/train.py {add} {shlex.quote(f'+resume={run}')}"
        )


def saved_overrides(run: Path) -> list[str] | None:
    """The run's ``.hydra/overrides.yaml``, read as data; None when the folder has none."""
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
    return [o for o in saved if not _skipped(o, NOT_RESUMED)]


def resume_command(folder: str | Path) -> str:
    """``python src/train.py <given beyond the run's saved overrides> +resume=<folder>``."""
    try:
        saved = saved_overrides(Path(folder)) or []
    except ValueError:  # unreadable: the command repeats all that was given
        saved = []
    given = given_overrides() or []  # (outside a Hydra job: the run's own record)
    # a resume takes a saved override that could name code only when it is repeated
    kept = [o for o in given if not _skipped(o, NOT_RESUMED) and (o not in saved or names_code(o))]
    return _command([*kept, f"+resume={folder}"])


def _skipped(override: str, prefixes: tuple[str, ...]) -> bool:
    return override.lstrip("+~").startswith(prefixes)


def _command(overrides: list[str]) -> str:
    return " ".join(shlex.quote(w) for w in ["python", "src/train.py", *overrides])


#: Keys left to ``check_resume_settings``, as are the batch keys and config groups.
_CHECKED_LATER = ("dry_run", "hydra.*")


def resume_overrides(argv: Sequence[str]) -> list[str]:
    """``+resume=<run>``'s command line after the run's saved overrides: one given beside it
    replaces a value a resume may change, is dropped when it repeats the run's, and is
    refused otherwise; ``argv`` as it is without ``+resume`` or saved overrides."""
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
        free = may_change(key) or key in BATCH_KEYS or (CONFIG_DIR / key).is_dir()
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


def _train_longer_command(run: str, step: int) -> str:
    """This resume's command line with ``trainer.max_steps=M`` (to be filled in) for the limit."""
    given = given_overrides()
    if given is None:  # composed outside a Hydra run
        given = [f"+resume={run}"]
    kept = [o for o in given if not _skipped(o, ("trainer.max_steps=",))]
    return _command([*kept, "trainer.max_steps=M"]) + f"   (M above {step})"


class NothingToTrain(Exception):
    """A ``+resume`` of a run already at ``trainer.max_steps``: nothing was loaded or changed."""


def check_steps_left(cfg: DictConfig, ckpt_path: str | Path) -> None:
    """Refuse, before anything loads (``global_step`` is peeked), a start that would train no
    step (docs/reliability.md); a ``+resume`` at ``trainer.max_steps`` raises ``NothingToTrain``
    with the command that trains longer, unless its export is owed (``pending_export``)."""
    from mrtpo.run.checkpointing import peek_checkpoint

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
