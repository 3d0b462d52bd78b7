"""The evaluation job behind ``src/eval.py``: score given responses, or generate and score."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def _show(metrics: dict[str, float], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in sorted(metrics):
        v = metrics[k]
        t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    Console().print(t)


def load_checkpoint_weights(policy, ckpt_path: str) -> None:
    import torch

    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)["state_dict"]
    weights = {k[len("policy.") :]: v for k, v in state.items() if k.startswith("policy.")}
    missing, unexpected = policy.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ValueError(
            f"checkpoint {ckpt_path} does not match model: missing={missing[:5]} "
            f"unexpected={unexpected[:5]}"
        )


def run(cfg: DictConfig) -> dict[str, float]:
    from hydra.utils import instantiate

    from mrtpo.evaluation import evaluate_examples, score_responses, write_results

    ev = cfg.eval
    task = instantiate(cfg.task)
    options = OmegaConf.to_container(ev, resolve=True)
    examples = list(task.eval_examples(ev.split, options))
    if ev.limit:
        examples = examples[: int(ev.limit)]
    out = Path(ev.output)
    if ev.responses:
        metrics = score_responses(task, examples, ev.responses, out)
        _show(metrics, f"{task.name} / {ev.split} (scored {ev.responses})")
        return metrics

    import torch
    from rich.progress import Progress

    from mrtpo.models import eos_token_ids, load_policy
    from mrtpo.rollout.base import SamplingConfig
    from mrtpo.rollout.build import build_rollout

    torch.manual_seed(cfg.seed)
    policy, tokenizer = load_policy(**OmegaConf.to_container(cfg.model, resolve=True))
    if cfg.get("ckpt_path"):
        load_checkpoint_weights(policy, cfg.ckpt_path)
    policy.eval()
    engine = instantiate(cfg.rollout.engine)
    eos = eos_token_ids(tokenizer, policy)
    if hasattr(engine, "bind"):
        engine.bind(policy, tokenizer, eos)
    base = dict(OmegaConf.to_container(cfg.rollout.sampling, resolve=True))
    if ev.max_new_tokens:
        base["max_new_tokens"] = int(ev.max_new_tokens)
    n = int(ev.n_samples)
    sampling = SamplingConfig(**base, greedy=bool(ev.greedy) and n == 1)
    all_ex, texts = [], []
    with Progress() as progress:
        bar = progress.add_task(f"generating {task.name}/{ev.split}", total=len(examples))
        for s in range(0, len(examples), int(ev.batch_size)):
            chunk = examples[s : s + int(ev.batch_size)]
            roll = build_rollout(engine, tokenizer, chunk, n, sampling, cfg.seed + s, eos)
            all_ex.extend(roll.examples)
            texts.extend(roll.texts)
            progress.advance(bar, len(chunk))
    metrics, rows = evaluate_examples(task, all_ex, texts)
    for i, row in enumerate(rows):
        row["sample"] = i % n
    write_results(out, metrics, rows)
    _show(metrics, f"{task.name} / {ev.split} ({n} sample(s) per prompt)")
    log.info("wrote %s", out / "metrics.json")
    return metrics
