"""Clipped surrogate on token advantages, KL to a reference, aggregation (method.md §7).

Token advantages ``[N, T]`` arrive from whatever method produced them; the loss does not
know or care whether they are uniform over the response (GRPO/GDPO) or not (MRTPO).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def token_logprobs(
    logits: Tensor, targets: Tensor, chunk: int = 1024, temperature: float = 1.0
) -> Tensor:
    """``log softmax(logits / temperature)[target]`` ``[N, T, V] -> [N, T]`` in float32, without a
    whole float32 ``[.., V]`` copy; at temperature 1 there is no division (bit for bit)."""
    out = []
    for s in range(0, logits.shape[1], chunk):
        lg = logits[:, s : s + chunk].float()
        if temperature != 1.0:
            lg = lg / temperature
        out.append(lg.gather(-1, targets[:, s : s + chunk, None]).squeeze(-1) - lg.logsumexp(-1))
    return torch.cat(out, dim=1)


def aggregate(values: Tensor, mask: Tensor, mode: str, denom: float | None = None) -> Tensor:
    """Aggregate per-token ``values`` [N, T] over ``mask``. ``denom`` is the whole (global) batch's
    normalizer (token-mean: its valid tokens, seq-mean: its responses), so micro-batch losses
    sum to the batch loss."""
    m = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * m).sum() / (denom if denom is not None else m.sum().clamp_min(1.0))
    if mode == "seq-mean-token-mean":
        per_seq = (values * m).sum(-1) / m.sum(-1).clamp_min(1.0)
        return per_seq.sum() / (denom if denom is not None else max(values.shape[0], 1))
    raise ValueError(f"rl.loss_agg={mode!r} is not supported; use one of {AGGREGATIONS}")


def policy_loss(
    logp: Tensor,  # [N, T] current policy
    old_logp: Tensor,  # [N, T] sampling policy
    advantages: Tensor,  # [N, T]
    mask: Tensor,  # [N, T] bool
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    denom: float | None = None,
    ref_logp: Tensor | None = None,  # [N, T] frozen reference
    kl_coef: float = 0.0,
    tis_weights: Tensor | None = None,  # [N, T] detached min(pi_old / pi_engine, cap)
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped surrogate (+ k3 KL), aggregated; and its statistics. ``tis_weights``
    multiply the surrogate only (the engine sampled from a slightly different policy than
    ``pi_old``). ``clip_frac``: share of valid tokens where the minimum takes the *clipped* term
    (no surrogate gradient), as TRL and verl count it."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if tis_weights is not None:
        per_token = per_token * tis_weights.detach()
    stats: dict[str, Tensor] = {}
    if ref_logp is not None and kl_coef > 0:
        # k3 estimator of KL(pi || ref): unbiased, non-negative.
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
        stats["kl"] = _masked_mean(kl.detach(), mask)
    loss = aggregate(per_token, mask, agg, denom)
    with torch.no_grad():
        stats["clip_frac"] = _masked_mean((clipped < unclipped).float(), mask)
        stats["ratio_mean"] = _masked_mean(ratio, mask)
        stats["approx_kl_old"] = _masked_mean(0.5 * (logp - old_logp) ** 2, mask)
    return loss, stats


def engine_gap(
    trainer_logp: Tensor,  # [N, T] the trainer's log pi_old of the sampled tokens
    engine_logp: Tensor,  # [N, T] the engine's, for the same tokens
    mask: Tensor,  # [N, T] bool
    tis_cap: float | None = None,
    stale: bool = False,
) -> tuple[dict[str, float], Tensor | None]:
    """How far the engine's sampling distribution is from the trainer's (``EngineGap.metrics``;
    vLLM bf16 reads ~1e-2 nats), and with ``tis_cap`` the detached weights
    ``min(pi_trainer / pi_engine, tis_cap)`` (0 on pads). ``EngineGap`` does it over row blocks."""
    totals = EngineGap(tis_cap)
    weights = totals.add(trainer_logp, engine_logp, mask)
    return totals.metrics(stale), weights


class EngineGap:
    """``engine_gap`` accumulated over blocks of whole rows: ``add`` each block (it returns
    the block's TIS weights), then ``metrics``. The totals are exact (sums in float64, max of
    maxima, a sequence's ratio from its own block), so any split of the rows gives the same
    metrics as one call over all of them, to float rounding."""

    def __init__(self, tis_cap: float | None = None) -> None:
        self.tis_cap = None if tis_cap is None else float(tis_cap)
        self.tokens = 0
        self.gap_sum, self.gap_max = 0.0, 0.0
        self.seqs, self.seq_sum = 0, 0.0
        self.seq_min, self.seq_max = math.inf, -math.inf
        self.weight_sum, self.capped = 0.0, 0

    @torch.no_grad()
    def add(self, trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> Tensor | None:
        """Count the rows of one block; their TIS weights [n, T] (None without a cap)."""
        m = mask.to(torch.bool)
        d = trainer_logp.detach().float() - engine_logp.to(trainer_logp.device).float()
        d = d.masked_fill(~m, 0.0)
        gap = d.abs()[m]
        self.tokens += gap.numel()
        if gap.numel():
            self.gap_sum += float(gap.double().sum())
            self.gap_max = max(self.gap_max, float(gap.max()))
        seq = torch.exp(d.double().sum(-1))
        self.seqs += seq.numel()
        if seq.numel():
            self.seq_sum += float(seq.sum())
            self.seq_min = min(self.seq_min, float(seq.min()))
            self.seq_max = max(self.seq_max, float(seq.max()))
        if self.tis_cap is None:
            return None
        ratio = torch.exp(d)
        weights = ratio.clamp(max=self.tis_cap).masked_fill(~m, 0.0)
        self.weight_sum += float(weights[m].double().sum())
        self.capped += int((ratio[m] > self.tis_cap).sum())
        return weights

    def metrics(self, stale: bool = False) -> dict[str, float]:
        """``logp_gap/{mean,max}`` of ``|log pi_trainer - log pi_engine|``,
        ``seq_ratio/{mean,min,max}`` of ``pi_trainer(y) / pi_engine(y)`` and with TIS
        ``tis_weight/mean`` and ``tis_capped_frac``; ``stale``: the rows were sampled by older
        weights than the trainer's, so the gap holds staleness too (``rollout/stale/...``)."""
        n, s = self.tokens, self.seqs
        nan = float("nan")
        stats = {
            "rollout/logp_gap/mean": self.gap_sum / n if n else 0.0,
            "rollout/logp_gap/max": self.gap_max if n else 0.0,
            "rollout/seq_ratio/mean": self.seq_sum / s if s else nan,
            "rollout/seq_ratio/min": self.seq_min if s else nan,
            "rollout/seq_ratio/max": self.seq_max if s else nan,
        }
        if self.tis_cap is not None:
            stats["rollout/tis_weight/mean"] = self.weight_sum / n if n else 1.0
            stats["rollout/tis_capped_frac"] = self.capped / n if n else 0.0
        if stale:
            return {k.replace("rollout/", "rollout/stale/", 1): v for k, v in stats.items()}
        return stats


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)
