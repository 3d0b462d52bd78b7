"""Credit diagnostics of one step (``train/replay/...``: ``q_ratio/{p50,p99,max}``,
``profile_cosine``, ``energy_share/<segment>``), from what the step already holds; what each
means and how it combines over ranks: docs/method.md, "Diagnostics". Profiles are read for
Jensen–Shannon scores only (non-negative).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mrtpo.step.metrics import Reduce, Stat
from mrtpo.tasks.base import Task, token_segments

PREFIX = "replay/"
SHARES = PREFIX + "energy_share/"
#: how each quantile and the cosine combine over ranks (their weights: token, response counts)
_REDUCE = {
    "q_ratio/p50": Reduce.MEAN_BY_TOKENS,
    "q_ratio/p99": Reduce.MEAN_BY_TOKENS,
    "q_ratio/max": Reduce.MAX,
    "profile_cosine": Reduce.MEAN_BY_RESPONSES,
}


def declared(m: dict[str, float], w: dict[str, float]) -> dict[str, Stat]:
    """A part's (metrics, weights) as Stats under ``replay/``, each with its reduction."""
    return {PREFIX + k: Stat(v, _REDUCE[k], w.get(k, 1.0)) for k, v in m.items()}


def share_stats(m: dict[str, float], w: dict[str, float]) -> dict[str, Stat]:
    """``energy_shares``'s (metrics, weights) as Stats under ``replay/``: shares of the rank's
    total energy, whatever a segment is named."""
    return {PREFIX + k: Stat(v, Reduce.SHARE, w[k], family=SHARES) for k, v in m.items()}


def quantiles(x: Tensor, qs: tuple[float, ...]) -> list[float]:
    """The ``qs`` quantiles of the 1-D ``x`` as ``torch.quantile`` defines them (linear
    interpolation between the order statistics around ``q (n - 1)``), by ``kthvalue``: exact,
    and without ``torch.quantile``'s limit of 2^24 elements."""
    n = x.numel()
    out = []
    for q in qs:
        rank = q * (n - 1)
        lo = math.floor(rank)
        below = x.kthvalue(lo + 1).values
        above = x.kthvalue(min(lo + 2, n)).values if rank > lo else below
        out.append(float(torch.lerp(below, above, torch.tensor(rank - lo, dtype=x.dtype))))
    return out


def q_ratio_quantiles(q: Tensor, mask: Tensor, replayed: Tensor) -> tuple[dict, dict]:
    """``q_ratio/{p50,p99,max}`` over replayed pairs' valid tokens (pairs with qbar > 1e-8)."""
    qd = q.detach().to(torch.float64).cpu()
    valid = mask.to(torch.bool).cpu()[:, None, :].expand_as(qd)
    qv = torch.where(valid, qd, torch.zeros((), dtype=qd.dtype))
    qbar = qv.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
    sel = valid & replayed.to(torch.bool).cpu()[:, :, None] & (qbar > 1e-8)
    ratio = (qv / torch.where(qbar > 1e-8, qbar, torch.ones_like(qbar)))[sel]
    if ratio.numel() == 0:
        return {}, {}
    p50, p99 = quantiles(ratio, (0.5, 0.99))
    m = {"q_ratio/p50": p50, "q_ratio/p99": p99, "q_ratio/max": float(ratio.max())}
    return m, {"q_ratio/p50": float(ratio.numel()), "q_ratio/p99": float(ratio.numel())}


def profile_cosine(q: Tensor, mask: Tensor, replayed: Tensor) -> tuple[dict, dict]:
    """``profile_cosine``: each response's mean pairwise cosine between its replayed rewards'
    relevance profiles (over its valid tokens), averaged over the responses that have a pair."""
    if q.shape[1] < 2:
        return {}, {}
    qd = q.detach().to(torch.float64).cpu() * mask.to(torch.float64).cpu()[:, None, :]
    norm = qd.norm(dim=-1)  # [N, K]
    unit = qd / norm.clamp(min=1e-300)[..., None]
    cos = unit @ unit.transpose(1, 2)  # [N, K, K]
    ok = replayed.to(torch.bool).cpu() & (norm > 0)
    k = q.shape[1]
    upper = torch.ones(k, k, dtype=torch.bool).triu(1)
    pairs = ok[:, :, None] & ok[:, None, :] & upper
    count = pairs.sum((1, 2))
    has = count > 0
    if not bool(has.any()):
        return {}, {}
    per = (cos * pairs).sum((1, 2))[has] / count[has]
    return {"profile_cosine": float(per.mean())}, {"profile_cosine": float(has.sum())}


class CreditDiagnostics:
    """The step's diagnostics; keeps each token id's decoded text between steps."""

    def __init__(self, task: Task, tokenizer) -> None:
        self.task, self.tokenizer = task, tokenizer
        self._pieces: dict[int, str] = {}
        #: segment names met so far: logged at every later step, 0 when a step lacks them
        self._names: set[str] = set()

    def _piece(self, i: int) -> str:
        if i not in self._pieces:
            self._pieces[i] = self.tokenizer.decode([i], skip_special_tokens=True)
        return self._pieces[i]

    def _segments(self, ids: list[int]) -> dict[str, list[bool]] | None:
        """Each segment the task declares for a response (its sampled ``ids``, pads left out)
        as a mask over its tokens; None when it declares none."""
        pieces = [self._piece(int(i)) for i in ids]
        spans = self.task.segments("".join(pieces))
        return None if spans is None else token_segments(pieces, spans)

    def record_fields(self, record, j: int) -> dict:
        """What ``relevance.jsonl`` keeps of response ``j`` for the viewer's diagnostics: its
        reallocated credit per token (``realloc``) and its segments' token indices."""
        t = int(record.rollout.response_mask[j].sum())
        out: dict = {}
        if record.realloc is not None:
            out["realloc"] = [round(float(v), 5) for v in record.realloc[j, :t].tolist()]
        segs = self._segments(record.rollout.response_ids[j, :t].tolist())
        if segs is not None:
            out["segments"] = {
                k: [i for i, inside in enumerate(m) if inside] for k, m in segs.items()
            }
        return out

    def energy_shares(self, realloc: Tensor, ids: Tensor, mask: Tensor) -> tuple[dict, dict]:
        """``energy_share/<segment>`` (and ``other``) over this rank's responses."""
        energy = torch.where(mask, realloc.detach().to(torch.float64).cpu(), 0.0).square()
        total = float(energy.sum())
        if total <= 0:
            return {}, {}
        sums: dict[str, float] = {}
        declared = False
        for j in (energy.sum(-1) > 0).nonzero().flatten().tolist():
            t = int(mask[j].sum())
            segs = self._segments(ids[j, :t].tolist())
            if segs is None:
                continue
            declared = True
            seen = torch.zeros(t, dtype=torch.bool)
            for name, tokens in segs.items():
                inside = torch.tensor(tokens, dtype=torch.bool) & ~seen
                sums[name] = sums.get(name, 0.0) + float(energy[j, :t][inside].sum())
                seen |= inside
            sums["other"] = sums.get("other", 0.0) + float(energy[j, :t][~seen].sum())
        if not declared:
            return {}, {}
        self._names.update(sums)
        m = {f"energy_share/{k}": sums.get(k, 0.0) / total for k in sorted(self._names)}
        return m, dict.fromkeys(m, total)

    def __call__(self, record, relevance) -> dict[str, Stat]:
        """This rank's diagnostics, keys under ``replay/``, each declared (``Stat``)."""
        out: dict[str, Stat] = {}
        mask = record.rollout.response_mask.to(torch.bool)
        jsd = relevance is not None and relevance.score == "jsd"
        if jsd and record.q is not None and record.replayed is not None:
            for part in (q_ratio_quantiles, profile_cosine):
                out.update(declared(*part(record.q, mask, record.replayed)))
        if record.realloc is not None:
            ids = record.rollout.response_ids
            out.update(share_stats(*self.energy_shares(record.realloc, ids, mask.cpu())))
        return out
