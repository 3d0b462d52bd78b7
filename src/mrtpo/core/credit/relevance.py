"""MRTPO's token-level credit: relevance scores, token weights, the cap and the β schedule
(docs/method.md, "MRTPO", steps 3–5: the weights, the four forms of the cap and their
statistics). GDPO's mean and std normalize the result, so at β = 0 it *is* GDPO's, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mrtpo.core.credit.advantages import (
    all_reduce_sum,
    compute_dtype,
    gdpo_parts,
    reward_weight_vector,
)

LN2 = math.log(2.0)


def _log_ratio_to_mixture(d: Tensor) -> Tensor:
    """``log(p / m)``, ``m = (p + q) / 2``, from ``d = log q - log p``: ``-log((1 + e^d) / 2)``,
    ``log1p(expm1)`` near 0 (exactly 0 at 0), softplus far from it (no overflow)."""
    near = -torch.log1p(0.5 * torch.expm1(d.clamp(max=1.0)))
    far = LN2 - F.softplus(d)
    return torch.where(d.abs() < 1.0, near, far)


def js_distance(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    """Jensen–Shannon distance ``sqrt(JSD / ln 2)`` between log-prob tensors ``[..., V]`` (any
    leading shape; float32, or float64 for float64 input), as ``scipy``'s ``jensenshannon(p, q,
    base=2)``: identical inputs give exactly 0, disjoint supports 1; ``-inf`` log-probs are handled.
    """
    dtype = compute_dtype(logp_a, logp_b)
    a = logp_a.to(dtype)
    b = logp_b.to(dtype)
    # Per element, with hi/lo the larger/smaller of the two log-probs and gap = hi - lo >= 0:
    # log(p_hi / m) = -log((1 + e^-gap) / 2) lies in [0, ln 2] (well conditioned), and
    # log(p_lo / m) = log(p_hi / m) - gap. One mixture log-ratio per element instead of two
    # halves the transcendental work (the kernel's cost at large vocabularies), and the result
    # depends on the pair, not its order, so the distance is exactly symmetric.
    hi = torch.maximum(a, b)
    lo = torch.minimum(a, b)
    gap = hi - lo
    p_hi = hi.exp()
    p_lo = lo.exp()
    log_hi_m = _log_ratio_to_mixture(-gap)
    # p * log(p/m) + q * log(q/m), each term dropped where its probability is 0 (where both
    # are 0, gap is NaN and both terms are dropped).
    terms = torch.where(p_hi > 0, p_hi * log_hi_m, 0.0)
    terms = terms + torch.where(p_lo > 0, p_lo * (log_hi_m - gap), 0.0)
    jsd = 0.5 * terms.sum(-1)
    return (jsd / LN2).clamp(0.0, 1.0).sqrt()


def js_distance_chunked(
    logits_a: Tensor, logits_b: Tensor, chunk: int = 128, temperature: float = 1.0
) -> Tensor:
    """Jensen–Shannon distance between logit tensors ``[T, V]`` -> ``[T]`` (float32), log-softmax
    taken a chunk of positions at a time (peak extra memory a few ``[chunk, V]`` float32 buffers).
    ``temperature`` divides the logits first (the sampling one measures the sampled distribution).
    """
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"shape mismatch {tuple(logits_a.shape)} vs {tuple(logits_b.shape)}")
    dtype = compute_dtype(logits_a, logits_b)
    lead = logits_a.shape[:-1]
    flat_a = logits_a.reshape(-1, logits_a.shape[-1])
    flat_b = logits_b.reshape(-1, logits_b.shape[-1])
    out = torch.empty(flat_a.shape[0], dtype=dtype, device=logits_a.device)
    for start in range(0, flat_a.shape[0], max(int(chunk), 1)):
        sl = slice(start, start + max(int(chunk), 1))
        la = torch.log_softmax(flat_a[sl].to(dtype) / temperature, dim=-1)
        lb = torch.log_softmax(flat_b[sl].to(dtype) / temperature, dim=-1)
        out[sl] = js_distance(la, lb)
    return out.reshape(lead)


def relevance_weights(q: Tensor, mask: Tensor, replayed: Tensor | None, beta: float) -> Tensor:
    """Token weights ``[N, K, T]``: ``(1 - β) + β q / qbar`` (``qbar``: the response's mean) on
    replayed pairs' valid tokens; 1 on pads, unreplayed pairs and where ``qbar <= 1e-8``."""
    dtype = compute_dtype(q)
    qd = q.to(dtype)
    valid = mask.to(torch.bool)[:, None, :].expand_as(qd)
    qv = torch.where(valid, qd, 0.0)
    n_tok = valid.sum(-1, keepdim=True).clamp(min=1).to(dtype)
    qbar = qv.sum(-1, keepdim=True) / n_tok
    ok = valid & (qbar > 1e-8)
    if replayed is not None:
        ok = ok & replayed.to(device=qd.device, dtype=torch.bool)[:, :, None]
    safe_qbar = torch.where(qbar > 1e-8, qbar, torch.ones_like(qbar))
    w = (1.0 - beta) + beta * (qv / safe_qbar)
    return torch.where(ok, w, torch.ones_like(w))


def shuffle_weights(
    w: Tensor,
    mask: Tensor,
    replayed: Tensor | None = None,
    generator: torch.Generator | None = None,
    row_index: Tensor | None = None,
) -> Tensor:
    """Shuffle ablation: permute each (response, reward)'s weights over its valid tokens (the
    multiset is kept; pads and unreplayed pairs are left). Each response's permutation is seeded
    by one draw from ``generator`` and its global index (``row_index [N]``; default its row here),
    so a 2-process run permutes as a 1-process run over the same batch.
    """
    n, k, t = w.shape
    valid_tok = mask.to(device=w.device, dtype=torch.bool)
    valid = valid_tok[:, None, :].expand(n, k, t)
    if replayed is not None:
        valid = valid & replayed.to(device=w.device, dtype=torch.bool)[:, :, None]
    base = int(torch.randint(0, 2**62, (1,), generator=generator))
    rows = torch.arange(n) if row_index is None else row_index.detach().cpu().long()
    keys = torch.full((n, k, t), 2.0)
    lengths = valid_tok.sum(-1).cpu().tolist()
    cols = [valid_tok[j].nonzero().flatten().cpu() for j in range(n)]
    for j in range(n):
        g = torch.Generator().manual_seed((base + int(rows[j])) % 2**63)
        keys[j][:, cols[j]] = torch.rand((k, int(lengths[j])), generator=g)
    keys = keys.to(w.device)
    # Valid positions first, in random order (source) / in position order (destination).
    src = torch.argsort(torch.where(valid, keys, torch.full_like(keys, 2.0)), dim=-1)
    dst = torch.argsort((~valid).to(torch.uint8), dim=-1, stable=True)
    moved = torch.empty_like(w).scatter_(-1, dst, torch.gather(w, -1, src))
    return torch.where(valid, moved, w)


def beta_schedule(beta: float, step: int, warmup_steps: int) -> float:
    """``β · (3u² − 2u³)`` with ``u = min(step / warmup, 1)``: a smooth ramp from 0 to β."""
    if warmup_steps <= 0:
        return float(beta)
    u = min(max(step, 0) / warmup_steps, 1.0)
    return float(beta) * (3.0 * u * u - 2.0 * u * u * u)


CAPS = ("batch", "token", "response", "none")


def check_cap(cap: str, key: str = "cap") -> str:
    """``cap`` if it names a form of the cap, else one clear error naming ``key``."""
    if cap not in CAPS:
        raise ValueError(f"{key}={cap!r}: use one of {', '.join(CAPS)} (docs/method.md, the cap)")
    return cap


def _reallocation(a_k: Tensor, s_resp: Tensor, w: Tensor | None, weights, joint) -> Tensor | None:
    """``R_t = sum_k c_k A_k (w_kt - 1)`` ``[N, T]`` (joint: ``S (w_t - 1)``); None for no ``w``."""
    if w is None:
        return None
    wd = w.to(device=a_k.device, dtype=a_k.dtype)
    if joint is None:
        joint = wd.shape[1] == 1 and a_k.shape[1] != 1
    if joint:
        if wd.shape[1] != 1:
            raise ValueError(f"joint weights must be [N, 1, T], got {tuple(wd.shape)}")
        return s_resp[:, None] * (wd[:, 0, :] - 1.0)
    if wd.shape[1] != a_k.shape[1]:
        raise ValueError(
            f"per-reward weights must be [N, {a_k.shape[1]}, T], got {tuple(wd.shape)}"
        )
    c = reward_weight_vector(weights, a_k.shape[1], a_k.dtype, a_k.device)
    return ((a_k * c)[:, :, None] * (wd - 1.0)).sum(1)


def _batch_factor(s_resp: Tensor, realloc: Tensor, valid: Tensor, process_group) -> dict:
    """cap=batch: ``s = min(1, sqrt(sum S^2 / sum R^2))`` over the global batch's tokens."""
    s2 = (s_resp.to(torch.float64).square() * valid.sum(-1).to(torch.float64)).sum()
    sums = all_reduce_sum(
        torch.stack([s2, realloc.to(torch.float64).square().sum()]), process_group
    )
    sum_s2, sum_r2 = float(sums[0]), float(sums[1])
    cap = min(1.0, math.sqrt(sum_s2 / sum_r2)) if sum_r2 > 0 else 1.0
    return {"cap_s": cap, "sum_S2": sum_s2, "sum_R2": sum_r2}


def _capped(adv: Tensor, realloc: Tensor, denom: Tensor, valid: Tensor, cap: str, factor: float):
    """The reallocation as added to ``A(j)``, in normalized units, under form ``cap``."""
    if cap == "batch":
        # written as today's (s R) / (sigma + eps), so that its numbers stay the same
        return (factor * realloc) / denom
    x = realloc / denom
    bound = adv.abs()[:, None].expand_as(x)
    if cap == "token":
        return torch.minimum(torch.maximum(x, -bound), bound)
    if cap == "response":
        # the largest f <= 1 with |f x_t| <= |A| on every valid token of the response
        ratio = torch.where(valid & (x != 0), bound / x.abs(), torch.full_like(x, math.inf))
        scaled = ratio.amin(-1, keepdim=True).clamp(max=1.0) * x
        # f x_t at the bound can round past it by an ulp, and A + f x_t then cross zero
        return torch.minimum(torch.maximum(scaled, -bound), bound)
    return x


def _cap_stats(tok, adv, x, moved, valid, process_group) -> dict[str, float]:
    """``cap_bound_share`` (changed by more than 1e-6 of ``|x_t| + |A(j)|``: rounding does not
    count), ``sign_flip_share`` and ``credit_change``, over the global batch (docs/method.md)."""
    dt = torch.float64
    a = adv[:, None].expand_as(tok)
    n_tok = valid.sum(-1).to(dt)
    total = torch.where(valid, tok, torch.zeros_like(tok)).sum(-1).to(dt)
    uniform = n_tok * adv.to(dt)
    has = (n_tok > 0) & (adv.abs() > 1e-6)  # A ~ 0: no credit to change (nor to divide by)
    rel = torch.where(has, (total - uniform).abs() / uniform.abs().clamp(min=1e-300), 0.0)
    sums = torch.stack(
        [
            # moved by more than rounding (a tolerance relative to the token's own scale)
            (valid & ((x - moved).abs() > 1e-6 * (x.abs() + a.abs()))).sum().to(dt),
            (valid & (tok * a < 0)).sum().to(dt),
            n_tok.sum(),
            rel.sum(),
            has.sum().to(dt),
        ]
    )
    sums = all_reduce_sum(sums, process_group)
    bound, flips, tokens, rel_sum, rows = (float(v) for v in sums)
    return {
        "cap_bound_share": bound / tokens if tokens else 0.0,
        "sign_flip_share": flips / tokens if tokens else 0.0,
        "credit_change": rel_sum / rows if rows else 0.0,
    }


def mrtpo_advantages_from_weights(
    rewards: Tensor,
    group: Tensor,
    w: Tensor | None,
    mask: Tensor,
    weights: Tensor | Sequence[float] | None = None,
    eps: float = 1e-4,
    process_group: Any = None,
    joint: bool | None = None,
    return_stats: bool = False,
    cap: str = "batch",
) -> Tensor | tuple[Tensor, dict[str, Any]]:
    """Token advantages ``[N, T]`` from token weights ``w`` (``[N, K, T]`` or joint ``[N, 1, T]``;
    ``None``: uniform, i.e. GDPO), 0 on pads. ``joint`` (default: ``w.shape[1] == 1`` while K > 1)
    weights the summed ``S``. ``cap`` bounds ``x_t = R_t / (sigma + eps)`` (module docstring);
    ``return_stats`` adds ``realloc`` (``x_t`` before any cap) to the statistics."""
    check_cap(cap)
    a_k, s_resp, _, denom, adv = gdpo_parts(rewards, group, weights, eps, process_group)
    valid = mask.to(device=adv.device, dtype=torch.bool)
    realloc = _reallocation(a_k, s_resp, w, weights, joint)
    if realloc is None:
        realloc = torch.zeros(valid.shape, dtype=adv.dtype, device=adv.device)
    realloc = torch.where(valid, realloc, 0.0)
    stats: dict[str, Any] = {"norm_denom": float(denom)}
    if cap == "batch":
        stats.update(_batch_factor(s_resp, realloc, valid, process_group))
    moved = _capped(adv, realloc, denom, valid, cap, stats.get("cap_s", 1.0))
    # GDPO's A plus the capped reallocation, so that R = 0 (beta = 0, no replay) leaves
    # GDPO's advantages untouched to the last bit
    tok = torch.where(valid, adv[:, None] + moved, 0.0)
    if not return_stats:
        return tok
    x = torch.where(valid, realloc / denom, 0.0)
    stats.update(_cap_stats(tok, adv, x, moved, valid, process_group))
    stats["realloc"] = x
    return tok, stats


def mrtpo_advantages(
    rewards: Tensor,
    group: Tensor,
    q: Tensor | None,
    mask: Tensor,
    replayed: Tensor | None,
    beta: float,
    weights: Tensor | Sequence[float] | None = None,
    eps: float = 1e-4,
    process_group: Any = None,
    return_stats: bool = False,
    joint: bool | None = None,
    cap: str = "batch",
) -> Tensor | tuple[Tensor, dict[str, Any]]:
    """MRTPO token advantages ``[N, T]`` from relevance ``q`` (``None``: GDPO broadcast); with
    ``return_stats`` also the cap's statistics (``mrtpo_advantages_from_weights``), ``norm_denom``
    (``sigma + eps``) and for ``batch`` ``cap_s``, ``sum_S2``, ``sum_R2``."""
    w = None if q is None else relevance_weights(q, mask, replayed, beta)
    return mrtpo_advantages_from_weights(
        rewards, group, w, mask, weights, eps, process_group, joint, return_stats, cap
    )
