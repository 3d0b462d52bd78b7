"""What a resume takes from the run folder it continues: the run's saved overrides, read as
data from a file of this user's that no one else may write, and never a saved override that
could make the run import or run code unless the user repeats it beside ``+resume``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Overrides a resume command leaves out: its own ``+resume``, a start checkpoint (a resume
#: starts from last.ckpt), the dry run, Hydra's own keys.
NOT_RESUMED = ("resume=", "ckpt_path=", "dry_run=", "hydra.")


def override_key(word: str) -> str:
    return word.split("=", 1)[0].lstrip("+~")


def is_override(word: str) -> bool:
    return "=" in word and not word.startswith("-")


def value_in_run(run: Path, key: str, saved: dict[str, str]) -> Any:
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


def same_value(given: str, theirs: Any) -> bool:
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


def names_code(override: str) -> bool:
    """Whether a saved override could make the run import or run code: an interpolation, an
    instantiation key, an addition under a node the run builds, a Hydra key or group, or a
    key of ``_CODE_KEYS``. A config group choice (``task=custom``) names a committed file."""
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


def refuse_untrusted(run: Path, saved: list[str], words: list[str]) -> None:
    """Refuse a saved override that could name code (``names_code``) unless the same
    override is given beside ``+resume``: the user says to run it, not the folder."""
    import shlex

    from mrtpo.run.settings import ConfigError

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
    return [o for o in saved if not o.lstrip("+~").startswith(NOT_RESUMED)]
