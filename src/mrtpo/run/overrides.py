"""Command-line checks made before Hydra composes: a replaced key names its successor, a
``method.<key>`` the chosen method lacks names the method's keys, and an unknown key of a typed
section names the valid ones. What each setting was called before is declared on its field
(``mrtpo.run.settings.setting(old=...)``); nothing here lists keys."""

from __future__ import annotations

from collections.abc import Sequence

from mrtpo.core.errors import ConfigError
from mrtpo.run import settings


def check_renamed(key: str) -> None:
    """Refuse a replaced key (a setting's old name), naming the one to use."""
    old = key.lstrip("+~")
    new = settings.renamed().get(old)
    if new is None:
        return
    note = settings.declaration(new).metadata.get("old_note")
    raise ConfigError(
        f"{old} was replaced by {new}{f' ({note})' if note else ''}: set that instead"
    )


def _method_keys(name: str, depth: int = 0) -> set[str] | None:
    """The keys ``configs/method/<name>.yaml`` sets, with those of the methods it builds on
    (its ``defaults``); None when there is no such file or it cannot be read here."""
    from pathlib import Path

    import yaml

    # the project's configs/ (as mrtpo.run.config.CONFIG_DIR, which imports the settings)
    path = Path(__file__).resolve().parents[3] / "configs" / "method" / f"{name}.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or depth > 4:
        return None
    keys = {k for k in data if k != "defaults"}
    for base in data.get("defaults") or []:
        if base == "_self_":
            continue
        more = _method_keys(str(base), depth + 1) if isinstance(base, str) else None
        if more is None:
            return None  # a form of defaults not read here: Hydra decides
        keys |= more
    return keys


def check_method_keys(argv: Sequence[str]) -> None:
    """Refuse ``method.<key>=...`` for a method without that key (``method=gdpo
    method.beta=0.5``), naming the method and its keys: Hydra would advise ``+method.beta``,
    which gives GDPO a beta it never reads. The method is the last ``method=`` given, else
    the default (``mrtpo``); under an ``experiment=`` preset without ``method=`` Hydra decides."""
    words = [a for a in argv if "=" in a and not a.startswith("-")]
    chosen = [a.split("=", 1)[1] for a in words if a.split("=", 1)[0].lstrip("+") == "method"]
    if not chosen and any(a.split("=", 1)[0].lstrip("+") == "experiment" for a in words):
        return
    name = chosen[-1] if chosen else "mrtpo"
    keys = _method_keys(name)
    if keys is None:
        return  # an unknown method: Hydra names the choices
    for arg in words:
        key = arg.split("=", 1)[0]
        if not key.startswith("method.") or key.startswith(("+", "~")):
            continue
        leaf = key.split(".")[1]
        if leaf in keys:
            continue
        why = (
            " (beta is MRTPO's share of the credit placed by relevance; this method gives "
            "every token its response's credit): drop method.beta, or choose method=mrtpo"
            if leaf == "beta"
            else f": its keys are {sorted(k for k in keys if not k.startswith('_'))}"
        )
        raise ConfigError(f"{arg}: method={name} has no {leaf}{why}")


def check_overrides(argv: Sequence[str]) -> None:
    """Refuse ``rl.nope=1`` listing the section's valid keys, and a replaced key naming its
    successor (Hydra only says the key is missing, and suggests ``+rl.nope=1``)."""
    check_method_keys(argv)
    for arg in argv:
        if "=" in arg:
            check_renamed(arg.split("=", 1)[0])
        if "=" not in arg or arg.startswith(("+", "~", "-")):
            continue
        key = arg.split("=", 1)[0]
        for name, schema in settings.SCHEMAS.items():
            prefix = name + "."
            if key.startswith(prefix):
                leaf = key[len(prefix) :].split(".")[0]
                if leaf not in schema.field_names():
                    raise ConfigError(
                        f"unknown key {key!r}: '{name}' has no key {leaf!r}; valid keys: "
                        f"{sorted(schema.field_names())}"
                    )
