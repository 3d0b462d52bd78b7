"""A sweep's run folders read back (``job.json``, else ``.hydra/``; ``csv/metrics.csv``) and
grouped by overrides minus the seed and plumbing. "final" is the mean of the last
``FINAL_WINDOW`` steps and "best" the highest ``SMOOTH``-step moving average (the toy
replication's definitions): one step's value, a mean over a few responses, is too noisy.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mrtpo.evaluate.analysis.runs import read_metrics, rl_curves
from mrtpo.evaluate.analysis.stats import FINAL_WINDOW, SMOOTH, finite, smooth
from mrtpo.safe_files import pid_alive as _alive

#: Written by each job beside its metrics (``run.json`` is taken: the replication's log folder).
RUN_JSON = "job.json"
METRICS = Path("csv") / "metrics.csv"
#: Override keys that change where and how a run is recorded, not what it learns: left out of
#: the groups (a sweep repeated with another ``paths.log_dir`` is the same experiment).
PLUMBING_PREFIXES = ("paths.", "hydra.", "callbacks.", "logger.")
PLUMBING_KEYS = frozenset({"logger", "callbacks", "ckpt_path", "resume", "print_config"})
SEED = "seed"


def override_key(override: str) -> str:
    """``+a.b=1`` / ``++a.b=1`` / ``a.b=1`` -> ``a.b``; ``~a.b`` stays ``~a.b``."""
    return override.split("=", 1)[0].lstrip("+")


def experiment_overrides(overrides: Iterable[str]) -> tuple[str, ...]:
    """The overrides that define what a run learns, minus the seed: a group's key. The last
    of a key wins (as in Hydra); sorted, so typing order does not split a group."""
    by_key: dict[str, str] = {}
    for o in overrides:
        k = override_key(o)
        if k != SEED and k not in PLUMBING_KEYS and not k.startswith(PLUMBING_PREFIXES):
            by_key[k] = f"{k}={o.split('=', 1)[1]}" if "=" in o else o
    return tuple(sorted(by_key.values()))


@dataclass
class Run:
    """One run folder: what it was started with and what it logged."""

    path: Path
    overrides: list[str] | None  # None: the folder records none (a run composed in code)
    seed: str | None
    status: str | None  # "completed" / "failed" from job.json; None when unknown
    wall_s: float | None
    run_name: str | None
    curves: dict[str, list[float]] = field(default_factory=dict)
    job_num: int | None = None
    error: str | None = None
    max_steps: int | None = None  # trainer.max_steps it was last started with (None: unknown)
    warnings: list[str] = field(default_factory=list)  # what of its records was ignored, why

    @property
    def steps(self) -> int:
        return max((len(c) for c in self.curves.values()), default=0)

    @property
    def incomplete(self) -> bool:
        """Short of ``trainer.max_steps`` and not recorded as completed: still running, or
        stopped (killed, interrupted) before its last step."""
        done = self.status in ("completed", "failed")
        return not done and self.max_steps is not None and self.steps < self.max_steps

    @property
    def progress(self) -> str:
        """Whether an incomplete run still runs: ``run.lock`` (gone when a run ends) names a
        live process on this machine."""
        holder = _lock_holder(self.path)
        if holder is None:
            return "stopped before its last step"
        pid, host = holder
        if host != _HOST:
            return f"running on {host} (process {pid}), or stopped there"
        return f"still running (process {pid})" if _alive(pid) else "stopped (its process died)"

    @property
    def group(self) -> tuple[str, ...]:
        """Its overrides minus seed and plumbing; a run that recorded none (no job.json, no
        .hydra/) is grouped with the other runs of its parent folder (``<method>/s<seed>``)."""
        if self.overrides is None:
            return (f"folder={self.path.parent}",)
        return experiment_overrides(self.overrides)

    @property
    def seed_key(self) -> str:
        """What pairs runs across groups: the seed, else the folder (pairs with nothing)."""
        return self.seed if self.seed is not None else f"?{self.path}"

    def final_best(self, metric: str) -> tuple[float, float]:
        return final_best(self.curves.get(metric, []))


_HOST = socket.gethostname()


def _lock_holder(folder: Path) -> tuple[int, str] | None:
    """(pid, host) that ``run.lock`` of a run folder names (None: no holder recorded)."""
    try:
        info = json.loads((folder / "run.lock").read_text(encoding="utf-8"))
        return int(info["pid"]), str(info["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def final_best(curve: Sequence[float]) -> tuple[float, float]:
    """(mean of the last ``FINAL_WINDOW`` steps, highest ``SMOOTH``-step moving average) over
    the finite steps (NaN: a reward that applied to no response); NaNs when none is."""
    v = finite(curve)
    if not v:
        return math.nan, math.nan
    tail = v[-FINAL_WINDOW:]
    return sum(tail) / len(tail), max(smooth(v, SMOOTH))


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _saved_setting(run: Path, key: str) -> Any:
    """``key`` of the run's newest start (``.hydra/resumes/<time>-<pid>/``, else its own)."""
    hydra = run / ".hydra"
    resumes = sorted((hydra / "resumes").glob("*/config.yaml"), key=lambda p: p.parent.name)
    for p in [*reversed(resumes), hydra / "config.yaml"]:
        with contextlib.suppress(Exception):  # absent or unreadable: the next one
            return OmegaConf.select(OmegaConf.load(p), key, default=None)
    return None


def beta_short(run: Path) -> str | None:
    """A note when ``train/beta`` never reached ``method.beta`` (a warm-up longer than the
    run): it then differs less from GDPO than the setting says."""
    beta = _saved_setting(run, "method.beta")
    path = run / METRICS
    if not is_number(beta) or beta <= 0 or not path.is_file():
        return None
    try:
        logged = [r["train/beta"] for r in read_metrics(path) if "train/beta" in r]
    except (OSError, ValueError):
        return None
    top = max((b for b in logged if math.isfinite(b)), default=None)
    if top is None or top >= beta * (1 - 1e-6):
        return None
    warmup = _saved_setting(run, "method.beta_warmup_steps")
    return (
        f"beta never reached method.beta={beta:g} (at most {top:.3g}; method.beta_warmup_steps="
        f"{warmup} is longer than its {len(logged)} steps): {run}"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (_is_int(v) and abs(v) < 2**53) or (isinstance(v, float) and math.isfinite(v))


#: The keys of job.json that are read, what each must be, and its name in a warning.
JOB_KEYS = (
    ("overrides", lambda v: isinstance(v, list) and all(isinstance(o, str) for o in v),
     "a list of strings"),
    (SEED, lambda v: isinstance(v, str) or _is_int(v), "a number or a string"),
    ("status", lambda v: isinstance(v, str), "a string"),
    ("wall_s", is_number, "a number"),
    ("run_name", lambda v: isinstance(v, str), "a string"),
    ("job_num", _is_int, "a whole number"),
    ("error", lambda v: isinstance(v, str), "a string"),
)  # fmt: skip


def kind_of(value: Any) -> str:
    """``an int``, ``a list``: what a JSON value is, for a message."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def read_job(folder: Path) -> tuple[dict[str, Any], list[str]]:
    """The keys of ``job.json`` of the right type, and a warning per key left out (read then
    from ``.hydra/``). ({}, []) without one."""
    path = folder / RUN_JSON
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, []
    except json.JSONDecodeError as exc:
        return {}, [f"{path}: not valid JSON (line {exc.lineno}: {exc.msg}); ignored"]
    except (OSError, ValueError, RecursionError) as exc:  # a folder, not UTF-8, too deep
        return {}, [f"{path}: cannot be read ({type(exc).__name__}: {exc}); ignored"[:400]]
    if not isinstance(info, dict):
        return {}, [f"{path}: not a JSON object ({kind_of(info)}); ignored"]
    kept: dict[str, Any] = {}
    warnings: list[str] = []
    for key, ok, what in JOB_KEYS:
        value = info.get(key)
        if value is None or ok(value):
            kept[key] = value
        else:
            warnings.append(f'{path}: "{key}" is not {what} ({kind_of(value)}); ignored')
    return kept, warnings


def load_run(folder: str | Path) -> Run:
    """A run folder: its ``job.json``, else Hydra's saved overrides and config, and curves."""
    folder = Path(folder)
    info, warnings = read_job(folder)
    overrides, hydra = info.get("overrides"), folder / ".hydra"
    with contextlib.suppress(Exception):  # Hydra's records, absent or unreadable: None
        if overrides is None:
            overrides = [str(o) for o in OmegaConf.load(hydra / "overrides.yaml")]
    seed = next((o.split("=", 1)[1] for o in overrides or [] if override_key(o) == SEED), None)
    if seed is None and info.get(SEED) is not None:
        seed = str(info[SEED])
    with contextlib.suppress(Exception):
        if seed is None and (saved := OmegaConf.load(hydra / "config.yaml").get(SEED)) is not None:
            seed = str(saved)
    wall, cfg, metrics = info.get("wall_s"), folder / ".hydra" / "config.yaml", folder / METRICS
    if wall is None and cfg.is_file() and metrics.is_file():
        # a run from before job.json: from its first to its last file write
        wall = max(0.0, metrics.stat().st_mtime - cfg.stat().st_mtime)
    max_steps = _saved_setting(folder, "trainer.max_steps")  # of its newest start
    curves: dict[str, list[float]] = {}
    if metrics.is_file():
        try:
            curves = rl_curves(metrics, warnings)
        except (OSError, ValueError) as exc:  # not a CSV table, unreadable
            warnings.append(f"{exc}; the run's metrics are left out")
    return Run(path=folder, overrides=overrides, seed=seed, status=info.get("status"),
               wall_s=None if wall is None else float(wall), run_name=info.get("run_name"),
               curves=curves, job_num=info.get("job_num"), error=info.get("error"),
               max_steps=max_steps if _is_int(max_steps) and max_steps > 0 else None,
               warnings=warnings)  # fmt: skip


def _natural(path: Path) -> list:
    """Sort key: ``2_...`` before ``10_...``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_runs(sources: Iterable[str | Path]) -> list[Run]:
    """Every run folder (``csv/metrics.csv``, or ``job.json`` of a job that failed before
    logging) under folders or globs; runs nested in another's (its warm starts) are not listed."""
    folders: set[Path] = set()
    for src in sources:
        matches = sorted(glob.glob(str(src))) if glob.has_magic(str(src)) else [str(src)]
        if not matches or not all(Path(m).exists() for m in matches):
            raise FileNotFoundError(
                f"{src}: no such folder (give a run or sweep folder, or a glob)"
            )
        for m in map(Path, matches):
            if m.is_file() and m.name == "metrics.csv":
                folders.add(m.parent.parent.resolve())
            elif m.is_dir():
                folders.update(p.parent.parent.resolve() for p in m.rglob(str(METRICS)))
                folders.update(p.parent.resolve() for p in m.rglob(RUN_JSON))
    tops = [f for f in folders if not any(a in folders for a in f.parents)]
    return [load_run(f) for f in sorted(tops, key=_natural)]


def group_runs(runs: Iterable[Run]) -> dict[tuple[str, ...], list[Run]]:
    """Runs by their overrides minus the seed, in the order the groups first appear."""
    groups: dict[tuple[str, ...], list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    return groups


def labels(keys: Sequence[tuple[str, ...]]) -> tuple[dict[tuple[str, ...], str], list[str]]:
    """A label per group (the overrides that differ) and the overrides all groups share."""
    common = [o for o in (keys[0] if keys else ()) if all(o in k for k in keys)]
    out = {}
    for k in keys:
        own = [o for o in k if o not in common]
        out[k] = " ".join(own) if own else ("(defaults)" if not k else "(all runs)")
    return out, common


#: Each task's headline, first found wins: success (the synthetic and custom tasks' every
#: check met; instruction following's all-constraints rate, its constraint slots c0..c12 being
#: rewards), text-to-SQL's execution match, tool calling's correctness.
HEADLINE = ("success", "execution", "correctness")


def headline(names: Iterable[str]) -> str | None:
    names = list(names)
    return next((h for h in HEADLINE if h in names), None)


def metric_names(runs: Iterable[Run], metrics: Sequence[str] = ()) -> list[str]:
    """The ``--metric`` names, else the headline first, then each reward in logged order."""
    names = list(dict.fromkeys(m for r in runs for m in r.curves))
    if metrics:
        unknown = [m for m in metrics if m not in names]
        if unknown:
            raise ValueError(
                f"--metric {' '.join(unknown)}: not logged by these runs; they log "
                f"{', '.join(names)}"
            )
        return list(metrics)
    first = headline(names)
    return sorted(names, key=lambda m: m != first)
