"""Self-replay: score each sampled token by how much a verifier's information moves it.

For every response–reward pair the method asks for, the sampled response is fed after two
contexts that differ only in that reward's information (``P_all`` and ``P_\\k``, built by the
task) and the next-token distributions are compared by Jensen–Shannon distance (method.md
§§1–3). ``P_all`` is run once per response and shared by all its rewards.

Cost and memory: contexts are tokenized with the chat template, the response ids are reused
as sampled, and forwards are packed into micro-batches by a token budget. The LM head runs on
response positions only; log-softmax and JSD run in float32 on chunks of positions, so the
float32 working set is ``chunk x V`` per pair, whatever the response length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mrtpo.batch import ScoredBatch
from mrtpo.credit import js_distance
from mrtpo.forward import pad_left, response_logits
from mrtpo.rollout.build import chat_ids
from mrtpo.tasks.base import Contexts, Task

log = logging.getLogger(__name__)

ALL = "__all__"
NONE = "__none__"


@dataclass
class _Job:
    response: int  # row in the batch
    key: str  # ALL, NONE or a reward name
    ids: list[int]  # context token ids


@dataclass
class ReplayResult:
    q: Tensor  # [N, K, T] (per_reward) or [N, 1, T] (joint), 0 where not replayed
    replayed: Tensor  # [N, K] / [N, 1] bool
    forwards: int = 0  # context forwards run
    tokens: int = 0  # tokens through those forwards
    stats: dict[str, float] = field(default_factory=dict)


class Replayer:
    """Runs the replays of one batch under the current (= sampling) parameters."""

    def __init__(self, tokenizer, token_budget: int = 16384, jsd_chunk: int = 256) -> None:
        self.tokenizer = tokenizer
        self.token_budget = token_budget  # max (rows x padded length) per forward
        self.jsd_chunk = jsd_chunk  # positions per float32 log-softmax / JSD chunk

    @torch.no_grad()
    def run(self, model, task: Task, batch: ScoredBatch, pairs: Tensor, mode: str) -> ReplayResult:
        """``pairs``: bool [N, K] (per_reward) or [N, 1] (joint) — which pairs to replay."""
        roll = batch.rollout
        n, t = roll.response_ids.shape
        kq = pairs.shape[1]
        q = torch.zeros((n, kq, t), dtype=torch.float32)
        replayed = torch.zeros_like(pairs, dtype=torch.bool)
        names = batch.reward_names
        jobs_by_resp: dict[int, list[_Job]] = {}
        for j in pairs.any(-1).nonzero().flatten().tolist():
            ctx: Contexts = task.contexts(roll.examples[j], batch.scores[j])
            if mode == "joint":
                wanted = [(NONE, ctx.none)]
            else:
                wanted = [
                    (names[k], ctx.without[names[k]])
                    for k in pairs[j].nonzero().flatten().tolist()
                    if names[k] in ctx.without
                ]
            if not wanted:
                continue
            jobs = [_Job(j, ALL, chat_ids(self.tokenizer, ctx.all))]
            jobs += [_Job(j, key, chat_ids(self.tokenizer, m)) for key, m in wanted]
            jobs_by_resp[j] = jobs

        was_training = model.training
        model.eval()
        forwards = tokens = 0
        try:
            for chunk in self._pack(jobs_by_resp, roll.response_mask):
                logits = self._forward(model, chunk, roll.response_ids, roll.response_mask)
                forwards += len(chunk)
                tokens += sum(
                    len(job.ids) + int(roll.response_mask[job.response].sum()) for job in chunk
                )
                self._score(chunk, logits, roll.response_mask, names, mode, q, replayed)
        finally:
            model.train(was_training)
        return ReplayResult(q=q, replayed=replayed, forwards=forwards, tokens=tokens)

    # -- packing ------------------------------------------------------------------------
    def _pack(self, jobs_by_resp: dict[int, list[_Job]], mask: Tensor) -> list[list[_Job]]:
        """Micro-batches of whole responses (P_all with its P_\\k) within the token budget.

        A response whose own jobs exceed the budget gets a micro-batch of its own (split
        further only by ``_forward``'s caller if memory demands: the budget is a target).
        """
        chunks: list[list[_Job]] = []
        cur: list[_Job] = []
        cur_width = 0
        order = sorted(jobs_by_resp, key=lambda j: max(len(x.ids) for x in jobs_by_resp[j]))
        for j in order:
            jobs = jobs_by_resp[j]
            t = int(mask[j].sum())
            width = max(cur_width, max(len(x.ids) for x in jobs) + t)
            if cur and (len(cur) + len(jobs)) * width > self.token_budget:
                chunks.append(cur)
                cur, width = [], max(len(x.ids) for x in jobs) + t
            cur.extend(jobs)
            cur_width = width
        if cur:
            chunks.append(cur)
        return chunks

    def _forward(self, model, chunk: list[_Job], response_ids: Tensor, response_mask: Tensor):
        rows = torch.tensor([job.response for job in chunk])
        resp_mask = response_mask[rows]
        t = max(1, int(resp_mask.sum(-1).max()))
        pad = self.tokenizer.pad_token_id
        ctx_ids, ctx_mask = pad_left([job.ids for job in chunk], pad)
        return response_logits(
            model, ctx_ids, ctx_mask, response_ids[rows, :t], resp_mask[:, :t]
        )  # [rows, t, V]

    # -- scoring ------------------------------------------------------------------------
    def _score(self, chunk, logits, mask, names, mode, q, replayed) -> None:
        base_row = {}
        for i, job in enumerate(chunk):
            if job.key == ALL:
                base_row[job.response] = i
        for i, job in enumerate(chunk):
            if job.key == ALL:
                continue
            j = job.response
            a = base_row[j]
            tj = int(mask[j].sum())
            k = 0 if mode == "joint" else names.index(job.key)
            for s in range(0, tj, self.jsd_chunk):
                e = min(tj, s + self.jsd_chunk)
                la = torch.log_softmax(logits[a, s:e].float(), dim=-1)
                lb = torch.log_softmax(logits[i, s:e].float(), dim=-1)
                q[j, k, s:e] = js_distance(la, lb).cpu()
            replayed[j, k] = True


def mass_share(q: Tensor, mask: Tensor, replayed: Tensor, frac: float = 0.8) -> list[float]:
    """Per reward: mean share of a response's tokens that holds ``frac`` of its distance.

    q [N, K, T], mask [N, T], replayed [N, K] -> K floats (NaN where nothing was replayed).
    Small values mean the reward's relevance is concentrated on few tokens.
    """
    k = q.shape[1]
    out = []
    for r in range(k):
        vals = []
        for j in replayed[:, r].nonzero().flatten().tolist():
            qj = q[j, r][mask[j]]
            total = float(qj.sum())
            if qj.numel() == 0 or total <= 0:
                continue
            c = qj.sort(descending=True).values.cumsum(0)
            need = int((c < frac * total).sum()) + 1
            vals.append(need / qj.numel())
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out
