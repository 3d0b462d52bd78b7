"""Replay's noise floor (``replay.noise_floor``): relevance between two identical contexts.

For a few responses a step, ``P_all`` runs again the update's way (one whole-model forward)
and its JSD to replay's own path (hidden states, shared-prefix cache, float32 head chunks) is
taken per token: pure numerical disagreement, 0 to float32 noise on CPU, on 16-bit GPUs the
level below which relevance is noise. Logs ``train/replay/noise_floor`` (token mean) and
``/max``. Off by default: a forward and ``[rows, T, V]`` logits per checked micro-batch.
"""

from __future__ import annotations

import torch

from mrtpo.core.credit import js_distance_chunked
from mrtpo.core.forward import pad_left, response_logits


class NoiseFloor:
    """Up to ``rows`` responses a step, the first replayed; ``reset`` at each step's start."""

    def __init__(self, rows: int, pad_id: int, chunk: int = 256, shared_prompt: str = "off"):
        self.rows, self.pad_id, self.chunk, self.shared_prompt = rows, pad_id, chunk, shared_prompt
        self.reset()

    def reset(self) -> None:
        self.left, self.total, self.count, self.max = self.rows, 0.0, 0, 0.0

    def add(self, model, chunk, states, head, roll, all_key: str) -> int:
        """Score the micro-batch's ``P_all`` rows (``all_key`` jobs, ``states`` their replay
        states) the update's way, within the step's budget; returns the forwards run (0 or 1).
        """
        picks = [i for i, job in enumerate(chunk) if job.key == all_key][: self.left]
        if not picks:
            return 0
        rows = torch.tensor([chunk[i].response for i in picks])
        mask = roll.response_mask[rows]
        t = max(1, int(mask.sum(-1).max()))
        ctx_ids, ctx_mask = pad_left([chunk[i].ids for i in picks], self.pad_id)
        plain = response_logits(
            model, ctx_ids, ctx_mask, roll.response_ids[rows, :t], mask[:, :t],
            shared_prompt=self.shared_prompt,
        )  # fmt: skip
        for n, i in enumerate(picks):
            x = states[i, :t]
            if head is not None:
                x = head(x)
            d = js_distance_chunked(x, plain[n].to(x.device), self.chunk, roll.temperature)
            d = d[mask[n, :t].to(d.device)]
            self.total += float(d.sum())
            self.count += int(d.numel())
            self.max = max(self.max, float(d.max())) if d.numel() else self.max
        self.left -= len(picks)
        return 1

    def metrics(self) -> dict[str, float]:
        if not self.count:
            return {}
        return {"noise_floor": self.total / self.count, "noise_floor/max": self.max}
