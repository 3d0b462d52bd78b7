"""Checking that every configured logger can be built, before anything heavy is loaded.

Lightning's loggers test for their package only when they are constructed, which in a run
happens after the policy has been loaded (minutes for a real model) and the run folder has
been created: a missing ``tensorboard`` or ``wandb`` then costs that time and leaves an
empty folder behind. ``check_loggers`` makes the same test on the config alone and says
which extra of this project installs what is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf


@dataclass(frozen=True)
class _Needs:
    """What a logger class needs: one of ``modules`` importable (with ``requirement``'s
    version), and the extra of this project (or the pip requirement) that installs it."""

    modules: tuple[str, ...]
    requirement: str  # pip requirement of the package installed by the hint
    extra: str | None  # this project's optional-dependency group, when it has one


# Keyed by the class name, so that ``lightning.pytorch.loggers.X`` and
# ``pytorch_lightning.loggers.X`` are treated alike. Versions are Lightning's own minimums.
_NEEDS: dict[str, _Needs] = {
    "TensorBoardLogger": _Needs(("tensorboard", "tensorboardX"), "tensorboard", "tensorboard"),
    "WandbLogger": _Needs(("wandb",), "wandb>=0.12.10", "wandb"),
    "MLFlowLogger": _Needs(("mlflow",), "mlflow>=1.0.0", None),
    "CometLogger": _Needs(("comet_ml",), "comet-ml>=3.44.4", None),
    "NeptuneLogger": _Needs(("neptune",), "neptune>=1.0", None),
}


class LoggerPackageMissing(ImportError):
    """A configured logger cannot be built because its package is not installed."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or a broken module spec
        return False


def _version_ok(module: str, requirement: str) -> bool:
    """True unless the installed distribution is known to be too old for ``requirement``."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if module != req.name.replace("-", "_") or not req.specifier:
        return True
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return True  # importable without metadata (a source tree on the path): trust it
    return req.specifier.contains(version, prereleases=True)


def _problem(key: str, target: str) -> str | None:
    """Why the logger ``key`` (class ``target``) cannot be built; None when it can."""
    module_name, _, cls = target.rpartition(".")
    needs = _NEEDS.get(cls)
    if needs is None:
        # A logger this table does not know: at least its own module must be importable.
        if module_name and not _importable(module_name):
            return (
                f"logger.{key}: its _target_ {target} cannot be imported (no module "
                f"{module_name!r}); install the package that provides it, or drop this logger"
            )
        return None
    found = [m for m in needs.modules if _importable(m)]
    if found and any(_version_ok(m, needs.requirement) for m in found):
        return None
    what = " or ".join(f"`{m}`" for m in needs.modules)
    state = "is too old" if found else "is not installed"
    how = (
        f"pip install -e .[{needs.extra}]  (or pip install '{needs.requirement}')"
        if needs.extra
        else f"pip install '{needs.requirement}'"
    )
    return (
        f"logger.{key} ({cls}) needs the {what} package ({needs.requirement}), which {state}: {how}"
    )


def _nodes(logger_cfg) -> list[tuple[str, Mapping]]:
    if logger_cfg is None or logger_cfg is False:
        return []
    if isinstance(logger_cfg, DictConfig):
        logger_cfg = OmegaConf.to_container(logger_cfg, resolve=False)
    if not isinstance(logger_cfg, Mapping):
        raise TypeError(
            f"logger must be a mapping of name -> logger config, got {type(logger_cfg).__name__}"
        )
    if "_target_" in logger_cfg:  # a single logger node rather than a group of them
        return [("_", logger_cfg)]
    return [(str(k), v) for k, v in logger_cfg.items() if v]


def check_loggers(logger_cfg) -> None:
    """Raise ``LoggerPackageMissing`` if any logger of the composed ``logger`` node cannot be
    built because a package is missing; the message names each such logger and the install
    command. Reads the config only: no logger is constructed, nothing is written."""
    problems = []
    for key, node in _nodes(logger_cfg):
        target = node.get("_target_") if isinstance(node, Mapping) else None
        if not target:
            continue
        problem = _problem(key, str(target))
        if problem:
            problems.append(problem)
    if problems:
        raise LoggerPackageMissing(
            "cannot start: "
            + "; ".join(problems)
            + ". Or choose another logger (logger=csv needs nothing extra)."
        )
