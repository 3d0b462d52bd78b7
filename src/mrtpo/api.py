"""Training, evaluation and export from Python: the command line's jobs, called as functions.

Each takes the overrides you would type after ``python src/train.py`` (``eval.py``,
``export.py``) and runs the same job: the same run folder, ``.hydra/`` record, logs, checks and
errors; a failure raises the error itself (examples: docs/extending.md section 4). A sweep is
a loop over calls. A job logs and sets CPU threads as the command does; the caller's
logging and torch's thread count are put back afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from mrtpo.evaluate.analysis.runs import read_metrics
from mrtpo.run.config import CONFIG_DIR

__all__ = ["RunResult", "evaluate", "export", "train"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    """What a job left: its folder and the metrics it ended with."""

    run_dir: Path  # the run (or evaluation) folder, as the command would have made it
    metrics: dict[str, Any] = field(default_factory=dict)  # the last logged value of each
    overrides: tuple[str, ...] = ()  # what the job was composed from

    @property
    def checkpoint(self) -> Path | None:
        """``checkpoints/last.ckpt`` of a training run (None when it has none)."""
        path = self.run_dir / "checkpoints" / "last.ckpt"
        return path if path.is_file() else None

    @property
    def policy(self) -> Path | None:
        """``policy/``, the trained policy as a Hugging Face folder (an RL run's)."""
        path = self.run_dir / "policy"
        return path if (path / "config.json").is_file() else None

    def history(self) -> list[dict[str, float]]:
        """Every row of ``csv/metrics.csv`` as floats, unlogged cells left out; malformed
        columns and rows are left out with a warning (``analysis.runs.read_metrics``)."""
        path = self.run_dir / "csv" / "metrics.csv"
        if not path.is_file():
            return []
        warnings: list[str] = []
        rows = read_metrics(path, warnings)
        for w in warnings:
            log.warning("%s", w)
        return rows


def train(
    overrides: Sequence[str] | Mapping[str, Any] = (),
    check: Callable[[DictConfig], None] | None = None,
) -> RunResult:
    """``python src/train.py <overrides>`` (``key=value`` strings or a mapping). ``check`` sees
    the composed config before the run folder is made (its error leaves no folder)."""
    from mrtpo.lightning.pipeline import train as train_job

    return _run("train.yaml", "train", overrides, train_job, check)


def evaluate(overrides: Sequence[str] = ()) -> RunResult:
    """``python src/eval.py <overrides>``: evaluate, return the output folder and metrics."""
    from mrtpo.evaluate.job import run
    from mrtpo.run.placement import configure_threads

    def job(cfg: DictConfig) -> dict[str, float]:
        configure_threads(cfg)
        return run(cfg)

    result = _run("eval.yaml", "eval", overrides, job)
    given = [o.split("=", 1)[1] for o in result.overrides if o.startswith("eval.output=")]
    output = next((Path(v) for v in given if v not in ("", "null")), None)  # else the run folder
    return RunResult(output or result.run_dir, result.metrics, result.overrides)


def export(overrides: Sequence[str] = ()) -> Path:
    """``python src/export.py <overrides>``: export a checkpoint, return the folder written."""
    from mrtpo.evaluate.export import run

    holder: dict[str, Path] = {}

    def job(cfg: DictConfig) -> dict[str, float]:
        holder["out"] = Path(run(cfg))
        return {}

    _run("export.yaml", "export", overrides, job)
    return holder["out"]


def _run(
    config_name: str,
    job_name: str,
    overrides: Sequence[str],
    job: Callable[[DictConfig], dict[str, float] | Any],
    check: Callable[[DictConfig], None] | None = None,
) -> RunResult:
    """Run ``job`` as Hydra runs ``src/<job_name>.py`` (run folder, ``.hydra/``, log file)."""
    if isinstance(overrides, str):
        raise TypeError("overrides is a list of strings: ['method=gdpo', 'seed=1']")
    overrides = as_overrides(overrides)
    flags = [o for o in overrides if o.startswith("-")]
    if flags:
        raise ValueError(
            f"{flags}: mrtpo.api runs one job from overrides (key=value); for a sweep, call it "
            "once per setting"
        )
    with _callers_state():
        sys.argv = [f"src/{job_name}.py", *overrides]  # what the run's records call its command
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(CONFIG_DIR), job_name=job_name, version_base="1.3"):
            ret = _composed_once(GlobalHydra.instance().hydra, config_name, overrides, job, check)
    run_dir = Path(ret.hydra_cfg.hydra.runtime.output_dir)
    metrics = ret.return_value if isinstance(ret.return_value, dict) else {}
    return RunResult(run_dir, {k: _number(v) for k, v in metrics.items()}, tuple(overrides))


def _composed_once(hydra: Any, config_name: str, overrides: list[str], job, check) -> Any:
    """``hydra.run`` on a config composed here once: ``check`` sees a copy of it first (with
    ``${hydra:...}`` resolvable; nothing it does reaches the run), then Hydra's own run takes
    the composed config instead of composing it again."""
    cfg = hydra.compose_config(
        config_name, overrides, run_mode=RunMode.RUN, with_log_configuration=True
    )
    if check is not None:
        checked = copy.deepcopy(cfg)
        HydraConfig.instance().set_config(checked)  # (makes its hydra node read-only)
        check(checked)
    hydra.compose_config = lambda *args, **kwargs: cfg  # this Hydra instance ends with the run
    return hydra.run(config_name=config_name, task_function=job, overrides=overrides)


def _quoted(text: str) -> str:
    """``text`` as a quoted string of Hydra's grammar that the config holds as that string.

    OmegaConf first: ``${`` becomes ``\\${`` (no interpolation), the backslashes right before
    it doubled. Then Hydra's quotes: inside them a backslash escapes only a quote or the
    closing quote, so the backslashes before a ``'`` or at the end are doubled."""
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
    return "'" + text + "'"


def _override_value(key: str, value: Any) -> str:
    """``value`` in Hydra's override grammar; every string quoted, so that ``"true"``,
    ``"123"`` or ``"${x}"`` stays that string rather than a bool, a number or a reference."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _quoted(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(key, v) for v in value) + "]"
    raise TypeError(
        f"overrides: {key}={value!r}: a mapping's values are numbers, strings, booleans, None "
        "or lists of them; give a nested setting by its dotted key ({'optim.lr': 1e-5})"
    )


def as_overrides(overrides: Sequence[str] | Mapping[str, Any]) -> list[str]:
    """A mapping ``{"trainer.max_steps": 20}`` as ``["trainer.max_steps=20"]``; a list as is."""
    if isinstance(overrides, Mapping):
        return [f"{k}={_override_value(str(k), v)}" for k, v in overrides.items()]
    return [str(o) for o in overrides]


def _number(value: Any) -> Any:
    """A metric as a float where it is a number (a tensor's too); anything else as it is."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


@contextlib.contextmanager
def _callers_state() -> Iterator[None]:
    """Give the caller back ``sys.argv``, the root logger's state (closing the job's handlers:
    its log file would otherwise receive the caller's later logs) and torch's thread count
    (a job sets its own: ``mrtpo.run.placement.configure_threads``)."""
    import torch

    root = logging.getLogger()
    argv, before, level = sys.argv, list(root.handlers), root.level
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        yield
    finally:
        sys.argv = argv
        for h in list(root.handlers):
            if h not in before:
                root.removeHandler(h)
                h.close()
        for h in before:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)
        torch.set_num_threads(threads)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env
