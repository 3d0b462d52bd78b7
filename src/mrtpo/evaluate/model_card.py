"""The model card (``README.md``) of an exported policy: base model, task, method and settings,
rewards, steps, final metrics and the commands that made it (issue 41, item 6), all from the
run's own records (``.hydra/``, ``job.json``, ``csv/metrics.csv``). A missing or unreadable
record leaves its part of the card out, saying so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

log = logging.getLogger(__name__)

#: The metrics a card shows, by prefix of their metrics.csv name.
SHOWN = ("train/reward/", "train/success", "train/extra/", "train/response_len/mean")
#: The settings sections a card shows besides the method.
SETTINGS = ("rl", "optim", "replay")


def _load(path: Path):
    try:
        return OmegaConf.load(path) if path.is_file() else None
    except Exception as exc:  # a damaged record costs its part of the card only
        log.warning("model card: cannot read %s (%s)", path, exc)
        return None


def _plain(node) -> Any:
    """A config node as plain data, interpolations resolved where they can be."""
    try:
        return OmegaConf.to_container(node, resolve=True)
    except Exception:
        return OmegaConf.to_container(node, resolve=False)


def run_records(run_dir: Path) -> dict[str, Any]:
    """What a run folder says about itself: ``config``, ``choices``, ``job``, ``rows``."""
    config = _load(run_dir / ".hydra" / "config.yaml")
    hydra = _load(run_dir / ".hydra" / "hydra.yaml")
    choices = OmegaConf.select(hydra, "hydra.runtime.choices", default=None) if hydra else None
    job: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):  # no job.json: the card says so
        job = json.loads((run_dir / "job.json").read_text(encoding="utf-8"))
    from mrtpo.evaluate.analysis.runs import read_metrics

    metrics = run_dir / "csv" / "metrics.csv"
    return {
        "config": config,
        "choices": _plain(choices) if choices is not None else {},
        "job": job if isinstance(job, dict) else {},
        "rows": read_metrics(metrics) if metrics.is_file() else [],
    }


def final_metrics(rows: Sequence[Mapping[str, float]], step: int | None) -> dict[str, float]:
    """The last logged value of each shown metric over the RL steps up to ``step``."""
    out: dict[str, float] = {}
    for r in rows:
        it = r.get("train/iteration")
        if step is not None and it is not None and it > step:
            continue
        for k, v in r.items():
            if k.startswith(SHOWN) and not math.isnan(v):
                out[k] = v
    return out


def _reward_names(rows: Sequence[Mapping[str, float]]) -> list[str]:
    names = dict.fromkeys(
        k.removeprefix("train/reward/").removesuffix("/mean")
        for r in rows
        for k in r
        if k.startswith("train/reward/") and k.endswith("/mean")
    )
    return [n for n in names if n != "total"]


def _command(script: str, overrides: Sequence[str]) -> str:
    return " ".join(["python", script, *(shlex.quote(str(o)) for o in overrides)])


def render(
    run_dir: Path,
    *,
    base_model: str,
    step: int | None,
    checkpoint: Path,
    export_overrides: Sequence[str] = (),
) -> str:
    """The card's Markdown for the export of ``checkpoint`` (of run ``run_dir``) at ``step``."""
    rec = run_records(run_dir)
    choices, cfg, job, rows = rec["choices"], rec["config"], rec["job"], rec["rows"]
    task = choices.get("task", job.get("task")) or "unknown"
    method = choices.get("method", job.get("method")) or "unknown"
    rewards = _reward_names(rows)
    head = [
        "---",
        "library_name: transformers",
        f"tags: [mrtpo, reinforcement-learning, {method}]",
        "---",
        f"# {job.get('run_name') or run_dir.name}",
        "",
        f"A policy trained with the MRTPO framework: method `{method}` on task `{task}`, "
        f"exported from step {step} of the run `{run_dir}`.",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base_model}` (model={choices.get('model', '?')}) |",
        f"| task | `{task}` |",
        f"| rewards | {', '.join(f'`{r}`' for r in rewards) or '(none logged)'} |",
        f"| method | `{method}` |",
        f"| steps | {step} |",
        f"| seed | {OmegaConf.select(cfg, 'seed', default='?') if cfg else '?'} |",
        f"| checkpoint | `{checkpoint}` |",
    ]
    return "\n".join(head + _settings(cfg) + _metrics(rows, step) + _commands(job, checkpoint,
                                                                                export_overrides)) + "\n"  # fmt: skip


def _settings(cfg) -> list[str]:
    if cfg is None:
        return ["", "## Method and settings", "", "(the run's .hydra/config.yaml is missing)"]
    shown = {k: _plain(cfg[k]) for k in ("method", *SETTINGS) if k in cfg}
    if "warm_start" in cfg and cfg.warm_start:
        shown["warm_start"] = _plain(cfg.warm_start)
    text = OmegaConf.to_yaml(OmegaConf.create(shown)).rstrip()
    return ["", "## Method and settings", "", "```yaml", text, "```"]


def _metrics(rows, step: int | None) -> list[str]:
    final = final_metrics(rows, step)
    if not final:
        return ["", "## Final metrics", "", "(no RL step metrics in the run's csv/metrics.csv)"]
    out = ["", f"## Final metrics (the last logged step up to {step})", "", "| metric | value |",
           "|---|---|"]  # fmt: skip
    out += [f"| `{k}` | {v:.4g} |" for k, v in sorted(final.items())]
    return out


def _commands(
    job: Mapping[str, Any], checkpoint: Path, export_overrides: Sequence[str]
) -> list[str]:
    runs = [i.get("overrides") for i in job.get("invocations") or [] if isinstance(i, dict)]
    runs = [r for r in runs if isinstance(r, list)] or [job.get("overrides")]
    lines = [_command("src/train.py", r) for r in runs if isinstance(r, list)]
    if not lines:
        lines = ["# (the run's job.json is missing: its command is not known)"]
    lines.append(_command("src/export.py", export_overrides or [f"ckpt_path={checkpoint}"]))
    return ["", "## How it was made", "", "```bash", *lines, "```", ""]
