"""Clipped surrogate on token advantages, KL to a reference, aggregation (method.md §7).

Token advantages ``[N, T]`` arrive from whatever method produced them; the loss does not
know or care whether they are uniform over the response (GRPO/GDPO) or not (MRTPO).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def token_logprobs(logits: Tensor, targets: Tensor, chunk: int = 1024) -> Tensor:
    """log p(target) per position, in float32, without a full [.., V] float32 copy at once.

    logits: [N, T, V]; targets: [N, T] -> [N, T]
    """
    out = []
    for s in range(0, logits.shape[1], chunk):
        lg = logits[:, s : s + chunk].float()
        out.append(lg.gather(-1, targets[:, s : s + chunk, None]).squeeze(-1) - lg.logsumexp(-1))
    return torch.cat(out, dim=1)


def aggregate(values: Tensor, mask: Tensor, mode: str, denom: float | None = None) -> Tensor:
    """Aggregate per-token ``values`` [N, T] over ``mask``.

    ``denom`` is the normalizer of the *whole* (global) batch when the caller splits it into
    micro-batches: token-mean divides by the number of valid tokens of the batch, seq-mean by
    its number of responses, so summing micro-batch losses gives the batch loss.
    """
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
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    denom: float | None = None,
    ref_logp: Tensor | None = None,  # [N, T] frozen reference
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    stats: dict[str, Tensor] = {}
    if ref_logp is not None and kl_coef > 0:
        # k3 estimator of KL(pi || ref): unbiased, non-negative.
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
        stats["kl"] = _masked_mean(kl.detach(), mask)
    loss = aggregate(per_token, mask, agg, denom)
    with torch.no_grad():
        stats["clip_frac"] = _masked_mean((unclipped != clipped).float(), mask)
        stats["ratio_mean"] = _masked_mean(ratio, mask)
        stats["approx_kl_old"] = _masked_mean(0.5 * (logp - old_logp) ** 2, mask)
    return loss, stats


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def sft_loss(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the masked (response) positions."""
    ce = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    return _masked_mean(ce, mask)
