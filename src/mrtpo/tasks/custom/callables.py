"""Config import strings (``mymod.r1``, ``pkg.mod:Scorer.check``, ``path/to/mymod.py:r1``) as
callables, with errors naming the config key and what was not found. A module is looked for
where Python looks, then in the launch folder (``launch_dir``), so ``python src/train.py ...
task.rewards=[myrewards.r1]`` run beside ``myrewards.py`` finds it without ``PYTHONPATH=.``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def launch_dir() -> Path:
    """The folder the command was started in: the current one, unless Hydra changed into the
    run folder (``hydra.job.chdir=true``), then the one it started from. Hydra's record is
    read only when it changed folder: a process that composed a config earlier (a test, a
    notebook) keeps a stale record after it moved on."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized() and HydraConfig.get().job.chdir:
            return Path(HydraConfig.get().runtime.cwd)
    except Exception:  # not under Hydra (a library caller), or an older Hydra
        pass
    return Path(os.getcwd())


def on_import_path(folder: str | Path, *, first: bool) -> Path:
    """Put ``folder`` on ``sys.path`` once: ``first`` ahead of installed modules (a folder the
    user named), else after them. The path, not a loader, so that worker processes started
    by spawn (which copy ``sys.path``) import the same module by name."""
    folder = Path(folder).expanduser().resolve()
    if str(folder) not in sys.path:
        if first:
            sys.path.insert(0, str(folder))
        else:
            sys.path.append(str(folder))
    return folder


def _module_from_file(text: str, key: str) -> tuple[str, str]:
    """``path/to/mod.py:attr`` -> (``mod``, ``attr``), with the file's folder on ``sys.path``
    (a relative path is taken from the launch folder)."""
    file_part, _, attr_path = text.rpartition(":")
    path = Path(file_part).expanduser()
    path = (path if path.is_absolute() else launch_dir() / path).resolve()
    if not path.is_file():
        raise ImportError(f"{key}={text!r}: no such file {path}")
    if not attr_path:
        raise ValueError(f"{key}={text!r}: name the function after the file: {file_part}:func")
    name = path.stem
    loaded = sys.modules.get(name)
    where = getattr(loaded, "__file__", None)
    if loaded is not None and (not where or Path(where).resolve() != path):
        raise ImportError(
            f"{key}={text!r}: a module named {name!r} is already imported from "
            f"{where or 'a built-in'}; rename {path.name}"
        )
    on_import_path(path.parent, first=True)
    return name, attr_path


def label(fn: Callable) -> str:
    """A readable dotted name of a callable, for logs and errors."""
    target = getattr(fn, "func", fn)  # functools.partial
    mod = getattr(target, "__module__", None)
    qual = getattr(target, "__qualname__", None) or type(target).__name__
    return f"{mod}.{qual}" if mod else qual


def short_name(fn: Callable) -> str | None:
    """The callable's own name (a reward's default name); None for lambdas and the like."""
    target = getattr(fn, "func", fn)
    name = getattr(target, "__name__", None) or type(target).__name__
    return None if not name or name.startswith("<") else name


def _candidates(text: str, key: str) -> list[tuple[str, list[str]]]:
    """The (module, attribute path) readings of an import string, the likeliest first."""
    if text.rpartition(":")[0].endswith(".py"):
        module_name, attr_path = _module_from_file(text, key)
        return [(module_name, attr_path.split("."))]
    if ":" in text:
        module_name, _, attr_path = text.partition(":")
        return [(module_name, attr_path.split("."))]
    parts = text.split(".")
    if len(parts) < 2:
        raise ValueError(
            f"{key}={text!r} is not an import string: write 'module.function' or "
            "'path/to/module.py:function'"
        )
    # The longest importable prefix is the module; the rest are attributes.
    return [(".".join(parts[:i]), parts[i:]) for i in range(len(parts) - 1, 0, -1)]


def _import(module_name: str, text: str, key: str) -> Any:
    """The module; ModuleNotFoundError when that very module is absent (the caller tries a
    shorter prefix); any other failure to import it, a missing dependency *inside* the user's
    module included, is an ImportError naming the key."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise
        raise ImportError(
            f"{key}={text!r}: importing module {module_name!r} failed: {exc}"
        ) from exc
    except Exception as exc:
        raise ImportError(
            f"{key}={text!r}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _attribute(obj: Any, module_name: str, attrs: list[str], text: str, key: str) -> Callable:
    """``obj.<attrs...>``, which must exist and be callable."""
    for i, attr in enumerate(attrs):
        if not hasattr(obj, attr):
            where = ".".join([module_name, *attrs[:i]])
            public = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
            raise ImportError(
                f"{key}={text!r}: {where!r} has no attribute {attr!r} (it has: "
                f"{', '.join(public) or 'nothing public'})"
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{key}={text!r} is a {type(obj).__name__}, not a callable")
    return obj


def resolve(spec: Any, key: str) -> Callable:
    """``spec`` as a callable: a callable as is, or an import string ``module.attr`` /
    ``module:attr.path``. ``key`` is the config key that gave it (``task.rewards[0]``)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise TypeError(f"{key} must be an import string like 'mymodule.my_reward', got {spec!r}")
    text = spec.strip()
    first_error: ModuleNotFoundError | None = None
    for module_name, attrs in _candidates(text, key):
        try:
            module = _import(module_name, text, key)
        except ModuleNotFoundError as exc:  # that module is absent: a shorter prefix next
            first_error = first_error or exc
            continue
        return _attribute(module, module_name, attrs, text, key)
    missing = getattr(first_error, "name", None) or text.split(".")[0]
    raise ImportError(
        f"{key}={text!r}: no module {missing!r} in the folder the command was started in "
        f"({launch_dir()}), in task.import_dirs or on PYTHONPATH. Start the command in the "
        f"folder that holds {missing.split('.')[0]}.py, add that folder with "
        f"task.import_dirs=[<folder>], or give the file: {key}=path/to/"
        f"{missing.split('.')[0]}.py:<function>"
    )
