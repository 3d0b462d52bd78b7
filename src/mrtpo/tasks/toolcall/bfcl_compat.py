"""Import BFCL's official AST checker without the rest of ``bfcl-eval``.

``pip install bfcl-eval`` pins ``numpy==1.26.4`` and pulls in a dozen API clients, which would
break this environment; ``pip install --no-deps bfcl-eval==2026.3.23`` installs cleanly. But
``ast_checker.py`` imports ``bfcl_eval.constants.model_config``, which imports every model
handler. The checker reads one field of it, ``MODEL_CONFIG_MAPPING[model].underscore_to_dot``,
for dotted function names (did a provider turn "." into "_"); our model sees the original names,
so it is always ``False``.

``load_ast_checker`` puts a stand-in for that module into ``sys.modules`` only during the import,
then restores what was there. No other part of ``bfcl_eval`` is imported (notably not
``bfcl_eval.constants.eval_config``, which creates folders inside site-packages on import).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

BFCL_VERSION = "2026.3.23"
INSTALL_HINT = (
    f"pip install --no-deps bfcl-eval=={BFCL_VERSION}  (the --no-deps route keeps numpy 2.x; "
    "the package's full dependency set pins numpy==1.26.4 and many API clients, none of "
    "which the AST checker needs)"
)
#: The model name we pass to the checker; only used to look up the stand-in config below.
CHECKER_MODEL_NAME = "mrtpo"

_STANDIN = "bfcl_eval.constants.model_config"


class BFCLMissingError(ImportError):
    """``bfcl-eval`` is not installed; the message says how to install it."""


@dataclass(frozen=True)
class _StandInModelConfig:
    underscore_to_dot: bool = False


class _AnyModel(dict):
    """Mapping that answers every model name with ``underscore_to_dot=False``."""

    def __missing__(self, key: str) -> _StandInModelConfig:
        return _StandInModelConfig()


def _require_bfcl() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BFCLMissingError(
            "BFCL evaluation (task=toolcall eval.split=bfcl) needs the bfcl-eval package, which "
            f"is not installed. Install it with:\n  {INSTALL_HINT}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def bfcl_package_dir() -> Path:
    """Folder of the installed ``bfcl_eval`` package (raises a clear error when absent)."""
    return _require_bfcl()


@dataclass(frozen=True)
class Checker:
    """The pieces of BFCL's checker this project calls."""

    ast_checker: Any  # bfcl_eval.eval_checker.ast_eval.ast_checker.ast_checker
    Language: Any  # bfcl_eval.constants.enums.Language


@cache
def load_ast_checker() -> Checker:
    """Import ``ast_checker`` with a temporary stand-in for ``constants.model_config``."""
    _require_bfcl()
    module_name = "bfcl_eval.eval_checker.ast_eval.ast_checker"
    if module_name in sys.modules:
        mod = sys.modules[module_name]
    else:
        previous = sys.modules.get(_STANDIN)
        standin = types.ModuleType(_STANDIN)
        standin.__doc__ = "Stand-in installed by mrtpo.tasks.toolcall.bfcl_compat (import only)."
        standin.MODEL_CONFIG_MAPPING = _AnyModel()  # type: ignore[attr-defined]
        sys.modules[_STANDIN] = standin
        try:
            mod = importlib.import_module(module_name)
        finally:
            if previous is None:
                sys.modules.pop(_STANDIN, None)
            else:
                sys.modules[_STANDIN] = previous
    enums = importlib.import_module("bfcl_eval.constants.enums")
    return Checker(ast_checker=mod.ast_checker, Language=enums.Language)
