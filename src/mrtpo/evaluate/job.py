"""The evaluation job of ``src/eval.py``: score given responses, or generate and score.

The checkpoint's model and task come from its training run (``mrtpo.run.trained_run``). Code
calls this to evaluate; ``mrtpo.evaluate.cli`` is only the command line around it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mrtpo.core.evaluation import check_outputs, evaluate_examples, score_responses, write_results
from mrtpo.core.models import eos_token_ids
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.run.checks import check_seed
from mrtpo.run.cli import load_model
from mrtpo.run.trained_run import from_training_run, load_checkpoint_weights

log = logging.getLogger(__name__)


class SplitDataMissing(FileNotFoundError):
    """The evaluation split's data files are not there (raised before any model loads)."""


def _show(metrics: dict[str, float], title: str) -> None:
    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in sorted(metrics.items()):
        t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    Console().print(t)


def _positive_int(ev, key: str, allow_null: bool = False) -> int | None:
    value = ev.get(key)
    if value is None and allow_null:
        return None
    try:
        n = int(value)
        ok = n >= 1 and float(value) == n
    except (TypeError, ValueError):
        ok = False
    if not ok:
        allowed = "an integer >= 1" + (" or null" if allow_null else "")
        raise ValueError(f"eval.{key}={value!r} is not allowed: use {allowed}")
    return n


def eval_sampling(cfg: DictConfig, n: int):
    """The whole sampling of an evaluation (greedy for ``eval.greedy`` and one sample), from
    ``rollout.sampling`` and ``eval.temperature``: none of the checkpoint's defaults apply."""
    ev = cfg.eval
    base = dict(OmegaConf.to_container(cfg.rollout.sampling, resolve=True))
    if ev.get("max_new_tokens"):
        base["max_new_tokens"] = int(ev.max_new_tokens)
    temperature = ev.get("temperature")
    if temperature is not None:
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"eval.temperature={temperature!r} is not allowed: >= 0 or null")
        base["temperature"] = float(temperature)
    greedy = (bool(ev.get("greedy", True)) and n == 1) or float(base.get("temperature", 1)) == 0
    return SamplingConfig(**base, greedy=greedy)


def _split_examples(task, ev, limit: int | None) -> tuple[list, list[str]]:
    """The split's examples (its first ``limit``) and the ids beyond the limit; a split whose
    data is absent is ``SplitDataMissing``."""
    try:
        examples = list(task.eval_examples(ev.split, OmegaConf.to_container(ev, resolve=True)))
    except FileNotFoundError as exc:
        raise SplitDataMissing(str(exc)) from exc
    beyond = [str(e.id) for e in examples[limit:]] if limit else []
    return (examples[:limit] if limit else examples), beyond


def _policy(cfg: DictConfig, source: dict, models: dict | None):
    """(tokenizer, bound engine, eos ids, checkpoint step); ``models`` caches them by config for
    several splits (src/table.py); engines seed each call, so the numbers are the same."""
    parts = (cfg.model, cfg.rollout.engine)
    key = repr([*(OmegaConf.to_container(c, resolve=True) for c in parts), cfg.get("ckpt_path")])
    if models is not None and key in models:
        return models[key]
    policy, tokenizer = load_model(cfg)
    step = None
    if cfg.get("ckpt_path"):
        step = load_checkpoint_weights(policy, cfg.ckpt_path, source.get("model_source", ""))
    policy.eval()
    engine = instantiate(cfg.rollout.engine)
    eos = eos_token_ids(tokenizer, policy)
    if hasattr(engine, "bind"):
        engine.bind(policy, tokenizer, eos)
    if models is not None:
        models[key] = (tokenizer, engine, eos, step)
    return tokenizer, engine, eos, step


def run(
    cfg: DictConfig, overrides: list[str] | None = None, models: dict | None = None
) -> dict[str, float]:
    """Evaluate as ``src/eval.py`` does; ``overrides``: the command line behind ``cfg`` when a
    caller composed it (what decides which groups a checkpoint's run supplies); ``models``:
    where loaded policies are kept for the caller's next splits (``_policy``)."""
    check_seed(cfg)  # seed=abc is named, not an int() error
    ev = cfg.eval
    limit = _positive_int(ev, "limit", allow_null=True)
    batch_size = _positive_int(ev, "batch_size")
    n = _positive_int(ev, "n_samples")
    cfg, source = from_training_run(cfg, overrides)
    task = instantiate(cfg.task)
    examples, beyond = _split_examples(task, ev, limit)
    out = Path(ev.output or cfg.paths.output_dir)
    # before anything is scored or written: the predictions file is input only
    check_outputs(out, {"eval.responses": ev.responses})
    scored: dict[str, Any] = {
        "task": task.name,
        "split": ev.split,
        "limit": limit,
        "split_examples": len(examples) + len(beyond),  # the whole split, before eval.limit
        "seed": int(cfg.seed),
        "checkpoint": str(Path(cfg.ckpt_path).resolve()) if cfg.get("ckpt_path") else None,
        **source,
    }
    if not ev.responses:
        return _generate_and_score(
            cfg, task, examples, (n, batch_size), out, scored, source, models
        )
    scored["mode"] = "responses"  # score the file eval.responses names
    metrics = score_responses(task, examples, ev.responses, out,
                              require_complete=bool(ev.get("require_complete", False)),
                              scored=scored, beyond_limit=beyond, limit=limit)  # fmt: skip
    _show(metrics, f"{task.name} / {ev.split} (scored {ev.responses})")
    return metrics


def _generate_and_score(cfg, task, examples, sizes: tuple[int, int], out: Path, scored: dict,
                        source: dict, models: dict | None) -> dict[str, float]:  # fmt: skip
    """Generate ``n`` samples per example (``sizes``: n, prompts per call), score, write ``out``."""
    n, batch_size = sizes
    torch.manual_seed(cfg.seed)
    tokenizer, engine, eos, step = _policy(cfg, source, models)
    if cfg.get("ckpt_path"):
        scored["checkpoint_step"] = step
    sampling = eval_sampling(cfg, n)
    log.info("eval sampling: %s", sampling)
    all_ex, texts = [], []
    with Progress() as progress:
        bar = progress.add_task(f"generating {task.name}/{cfg.eval.split}", total=len(examples))
        for s in range(0, len(examples), batch_size):
            chunk = examples[s : s + batch_size]
            roll = build_rollout(engine, tokenizer, chunk, n, sampling, cfg.seed + s, eos)
            all_ex.extend(roll.examples)
            texts.extend(roll.texts)
            progress.advance(bar, len(chunk))
    metrics, rows = evaluate_examples(task, all_ex, texts)
    for i, row in enumerate(rows):
        row["sample"] = i % n
    metrics["coverage"] = 1.0
    scored.update(mode="generate", model=str(cfg.model.get("name_or_path")), n_samples=n,
                  sampling=asdict(sampling), examples=len(examples), responses_scored=len(texts),
                  coverage=1.0)  # fmt: skip
    write_results(out, metrics, rows, scored)
    _show(metrics, f"{task.name} / {cfg.eval.split} ({n} sample(s) per prompt)")
    log.info("wrote %s", out / "metrics.json")
    return metrics
