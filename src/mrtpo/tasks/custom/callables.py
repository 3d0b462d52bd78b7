"""Turning the import strings of a config (``mymod.r1``, ``pkg.mod:Scorer.check``) into
callables, with errors that name the config key and say what could not be found."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


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


def resolve(spec: Any, key: str) -> Callable:
    """``spec`` as a callable: a callable as is, or an import string ``module.attr`` /
    ``module:attr.path``. ``key`` is the config key that gave it (``task.rewards[0]``)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise TypeError(f"{key} must be an import string like 'mymodule.my_reward', got {spec!r}")
    text = spec.strip()
    if ":" in text:
        module_name, _, attr_path = text.partition(":")
        candidates = [(module_name, attr_path.split("."))]
    else:
        parts = text.split(".")
        if len(parts) < 2:
            raise ValueError(
                f"{key}={text!r} is not an import string: write 'module.function' (the module "
                "must be importable: installed, on PYTHONPATH, or in task.import_dirs)"
            )
        # The longest importable prefix is the module; the rest are attributes.
        candidates = [(".".join(parts[:i]), parts[i:]) for i in range(len(parts) - 1, 0, -1)]
    first_error: Exception | None = None
    for module_name, attrs in candidates:
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only "this very module is absent" means "try a shorter prefix"; a missing
            # dependency *inside* the user's module is the real error and is reported.
            if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                first_error = first_error or exc
                continue
            raise ImportError(
                f"{key}={text!r}: importing module {module_name!r} failed: {exc}"
            ) from exc
        except Exception as exc:
            raise ImportError(
                f"{key}={text!r}: importing module {module_name!r} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
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
    raise ImportError(
        f"{key}={text!r}: cannot import it ({first_error}); the module must be importable: "
        "installed, on PYTHONPATH, or in a folder listed in task.import_dirs"
    )
