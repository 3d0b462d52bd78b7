"""``RunRecorder``, a Hydra callback (``hydra.callbacks`` in configs/hydra/default.yaml).

It writes ``job.json`` beside each job's metrics (what ``.hydra/config.yaml`` leaves
unresolved: run name, seed, overrides, status, wall time) and rewrites the sweep's summary after
every job and at the end (a failed job makes Hydra stop before ``on_multirun_end``).
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mrtpo.evaluate.analysis.jobs import RUN_JSON, SEED, read_json
from mrtpo.evaluate.analysis.runs import write_file
from mrtpo.evaluate.analysis.summary import write_summary


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def _sweep_dir(config: DictConfig) -> Path | None:
    """The sweep folder of a multirun job: its output folder minus ``hydra.sweep.subdir``
    (which may hold slashes when an override value is a path)."""
    out = OmegaConf.select(config, "hydra.runtime.output_dir")
    sub = OmegaConf.select(config, "hydra.sweep.subdir")
    if not out or sub is None:
        return None
    n = len(Path(str(sub)).parts)
    out = Path(str(out))
    return out.parents[n - 1] if 0 < n <= len(out.parents) else None


def _run_dir(config: DictConfig) -> Path:
    """Where the job's metrics go: ``paths.output_dir``."""
    try:
        out = OmegaConf.select(config, "paths.output_dir")
    except Exception:
        out = None
    return Path(str(out or OmegaConf.select(config, "hydra.runtime.output_dir")))


class RunRecorder(Callback):
    """Hydra turns an exception here into a warning, so recording never fails a run. A job
    stopped by SIGTERM/SIGINT (``RunInterrupted``) is recorded ``"interrupted"`` and ends its
    sweep."""

    def __init__(self, summary: bool = True) -> None:
        self.summary = summary
        self._started: dict[str, tuple[float, str]] = {}

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._started[str(_run_dir(config))] = (time.monotonic(), _now())

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if any(os.environ.get(v, "0") != "0" for v in ("LOCAL_RANK", "RANK")):
            return  # a DDP worker re-ran the entry point: the launching process records the run
        out = _run_dir(config)
        failed = getattr(getattr(job_return, "status", None), "name", "") == "FAILED"
        # the property re-raises a failed job's exception; the field holds it
        error = getattr(job_return, "_return_value", None) if failed else None
        status = getattr(error, "job_status", "failed") if failed else "completed"
        refused = failed and not getattr(error, "trained", False)  # (interrupted: it trained)
        if refused and OmegaConf.select(config, "resume", default=None):
            return  # a refused resume leaves the run folder exactly as it was
        if not out.is_dir():
            return
        t0, started = self._started.pop(str(out), (None, None))
        wall = time.monotonic() - t0 if t0 is not None else None
        choices = OmegaConf.select(config, "hydra.runtime.choices", default={}) or {}
        try:
            run_name = str(OmegaConf.select(config, "run_name"))
        except Exception:  # an interpolation that cannot resolve here: keep it as written
            run_name = None
        invocation = {
            "started": started,
            "finished": _now(),
            "wall_s": None if wall is None else round(wall, 3),
            "status": status,
            "error": repr(error)[:2000] if failed else None,
            "overrides": [str(o) for o in getattr(job_return, "overrides", None) or []],
        }
        previous = read_json(out / RUN_JSON).get("invocations", [])
        invocations = [*previous, invocation]  # a resumed run continues in the same folder
        first = invocations[0]
        record = {
            "run_name": run_name,
            **{group: choices.get(group) for group in ("task", "method", "model")},
            SEED: OmegaConf.select(config, SEED, default=None),
            "job_num": OmegaConf.select(config, "hydra.job.num", default=None),
            # the overrides the run was created with; a resume's own are in its invocation
            "overrides": first["overrides"],
            "status": invocation["status"],
            "error": invocation["error"],
            "wall_s": round(sum(i.get("wall_s") or 0.0 for i in invocations), 3),
            "started": first["started"],
            "finished": invocation["finished"],
            "invocations": invocations,
        }
        write_file(out / RUN_JSON, json.dumps(record, indent=2) + "\n")
        mode = OmegaConf.select(config, "hydra.mode", default=None)
        multirun = getattr(mode, "name", str(mode)).endswith("MULTIRUN")
        if self.summary and multirun and (sweep := _sweep_dir(config)) is not None:
            write_summary(sweep)
        if multirun and status == "interrupted":  # the signal was for the sweep: no next job
            raise SystemExit(getattr(error, "exit_status", 1))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.summary:
            return
        root = Path(str(config.hydra.sweep.dir))
        written = write_summary(root) if root.is_dir() else None
        if written:
            print(f"sweep summary: {written[1]}  (compare: python src/report.py {root})")
