"""Sample tables and relevance dumps, written under the run folder every N steps."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from rich.console import Console
from rich.table import Table

from mrtpo.safe_files import no_follow  # never append through a link planted in the folder


def _run_dir(trainer) -> Path:
    # The run folder itself (as the README says), not a logger's subfolder. Not
    # `trainer.log_dir`: under DDP it is a collective (a broadcast), and these callbacks write
    # on rank 0 only, so the other ranks would never join it.
    d = Path(trainer.default_root_dir)
    d.mkdir(parents=True, exist_ok=True)
    return d


def relevance_record(
    scored, j: int, q, w, replayed, names, tokenizer, step: int, beta: float
) -> dict:
    """One line of ``relevance.jsonl``: response ``j`` of ``scored`` with, for each replayed
    reward, its per-token relevance ``q`` and weight ``w`` (``[N, K, T]`` tensors; ``names``
    label their K axis, ``replayed [N, K]`` says which pairs have one).

    The one builder of this record: the training callback and the replication harness's
    direct replay both write it, and the analysis reads both the same way.
    """
    roll = scored.rollout
    t = int(roll.response_mask[j].sum())
    ids = roll.response_ids[j, :t].tolist()
    rows = [(k, n) for k, n in enumerate(names) if replayed[j, k]]
    return {
        "step": step,
        "id": roll.examples[j].id,
        "beta": beta,
        "prompt": roll.examples[j].messages[-1]["content"],
        "tokens": [tokenizer.decode([i]) for i in ids],
        "token_ids": ids,
        "rewards": scored.scores[j].rewards,
        "q": {n: torch.round(q[j, k, :t], decimals=5).tolist() for k, n in rows},
        "w": {n: torch.round(w[j, k, :t], decimals=5).tolist() for k, n in rows},
    }


class SampleTable(L.Callback):
    """Every ``every`` steps: ``samples.jsonl`` gets prompt, response and each reward of a few
    responses, and a short rich table is printed."""

    def __init__(self, every: int = 10, num: int = 4, print_table: bool = True) -> None:
        self.every, self.num, self.print_table = every, num, print_table

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scored = pl_module.last
        step = pl_module.iteration
        if scored is None or not trainer.is_global_zero or self.every <= 0:
            return
        if (step - 1) % self.every != 0:
            return
        roll = scored.rollout
        rows = []
        for i in range(min(self.num, roll.n)):
            s = scored.scores[i]
            rows.append(
                {
                    "step": step,
                    "id": roll.examples[i].id,
                    "prompt": roll.examples[i].messages[-1]["content"],
                    "response": roll.texts[i],
                    "rewards": s.rewards,
                    "reasons": s.reasons,
                }
            )
        with open(
            _run_dir(trainer) / "samples.jsonl", "a", encoding="utf-8", opener=no_follow
        ) as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        if self.print_table:
            t = Table(title=f"samples at step {step}", show_lines=False)
            t.add_column("response", overflow="fold", max_width=60)
            t.add_column("rewards")
            for r in rows:
                rw = " ".join(
                    f"{k}={'-' if v is None else f'{v:g}'}" for k, v in r["rewards"].items()
                )
                t.add_row(r["response"][:200], rw)
            Console(stderr=True).print(t)


class RelevanceDump(L.Callback):
    """Every ``every`` steps: ``relevance.jsonl`` gets, for a few replayed responses, the
    response tokens with each reward's relevance q and weight w (input to the pictures)."""

    def __init__(self, every: int = 10, num: int = 4) -> None:
        self.every, self.num = every, num

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scored = pl_module.last
        if scored is None or scored.q is None or not trainer.is_global_zero or self.every <= 0:
            return
        step = pl_module.iteration
        if (step - 1) % self.every != 0:
            return
        roll, tok = scored.rollout, pl_module.tokenizer
        beta = pl_module.method.beta(step - 1)
        # the method's own weights (MRTPO's from JSD, CoRT's from log-likelihood contrasts)
        w = pl_module.method.token_weights(scored.q, roll.response_mask, scored.replayed, step - 1)
        names = scored.reward_names if scored.q.shape[1] == len(scored.reward_names) else ("joint",)
        picked = scored.replayed.any(-1).nonzero().flatten().tolist()[: self.num]
        with open(
            _run_dir(trainer) / "relevance.jsonl", "a", encoding="utf-8", opener=no_follow
        ) as f:
            for j in picked:
                rec = relevance_record(
                    scored, j, scored.q, w, scored.replayed, names, tok, step=step, beta=beta
                )
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
