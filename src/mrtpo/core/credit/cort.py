"""CoRT, reconstructed from its abstract (Zhang et al., arXiv 2607.25659; no code released):
rubric-contrast weights spread GRPO's advantage, ``A_t = A w_t`` (at β = 0 exactly GRPO). The
formulas and reconstruction decisions: docs/method.md, "CoRT".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor

from mrtpo.core.credit.advantages import compute_dtype, grpo_advantages, replay_mask
from mrtpo.core.credit.methods import (
    CreditInputs,
    CreditOutput,
    MethodServices,
    RelevanceRequest,
    _adv_stats,
    _BetaRamp,
    _broadcast,
    _check_q,
    _replayed_share,
    _RewardWeighted,
    checked_beta,
)

#: CoRT's replay: one criteria-free context per response, the sampled token's log-likelihood.
JOINT_LOGP_DIFF = RelevanceRequest("joint", "logp_diff")


def cort_weights(
    d: Tensor,
    mask: Tensor,
    replayed: Tensor | None,
    beta: float,
    contrast_clip: float = 2.0,
    max_weight: float = 4.0,
) -> Tensor:
    """Token weights ``[N, T]`` from contrasts ``d`` (``[N, 1, T]`` or ``[N, T]``): ``(1 - β) + β
    v_t / mean(v)`` on replayed valid tokens (module docstring), averaging 1 per response, in
    ``[(1 - β) + β / max_weight, (1 - β) + β max_weight]``; exactly 1 elsewhere and at β = 0.
    ``contrast_clip > 0`` and ``max_weight >= 1`` are the caller's to check (``CoRT`` does)."""
    if d.dim() == 3:
        if d.shape[1] != 1:
            raise ValueError(f"CoRT contrasts must be [N, 1, T] (joint), got {tuple(d.shape)}")
        d = d[:, 0, :]
    dtype = compute_dtype(d)
    dd = d.to(dtype)
    valid = mask.to(device=dd.device, dtype=torch.bool)
    u = torch.where(valid, dd.abs().clamp(max=contrast_clip) / contrast_clip, 0.0)
    v = torch.where(valid, 1.0 + (max_weight - 1.0) * u, 0.0)
    n_tok = valid.sum(-1, keepdim=True)
    vbar = v.sum(-1, keepdim=True) / n_tok.clamp(min=1).to(dtype)
    # v >= 1 on valid tokens, so vbar >= 1 wherever a response has a token: no division by ~0
    w = (1.0 - beta) + beta * (v / vbar.clamp(min=1.0))
    ok = valid & (n_tok > 0)
    if replayed is not None:
        r = replayed.to(device=dd.device, dtype=torch.bool)
        ok = ok & (r[:, 0] if r.dim() == 2 else r)[:, None]
    return torch.where(ok, w, torch.ones_like(w))


class CoRT(_BetaRamp, _RewardWeighted):
    """CoRT: GRPO's response advantage spread over tokens by rubric-contrast weights."""

    config_name = "cort"
    relevance: ClassVar[RelevanceRequest | None] = JOINT_LOGP_DIFF

    def __init__(
        self,
        beta: float = 1.0,
        beta_warmup_steps: int = 30,
        contrast_clip: float = 2.0,
        max_weight: float = 4.0,
        eps: float = 1e-4,
        reward_weights: Mapping[str, float] | None = None,
    ):
        super().__init__(eps=eps, reward_weights=reward_weights)
        self.beta_max, self.beta_warmup_steps = checked_beta(beta, beta_warmup_steps)
        if not contrast_clip > 0:
            raise ValueError(f"method.contrast_clip must be > 0 (nats), got {contrast_clip}")
        if not max_weight >= 1:
            raise ValueError(f"method.max_weight must be >= 1, got {max_weight}")
        self.contrast_clip = float(contrast_clip)
        self.max_weight = float(max_weight)

    def setup(self, task, services: MethodServices | None = None) -> None:
        super().setup(task, services)
        if not getattr(task, "info_in_prompt", False):
            name = getattr(task, "name", type(task).__name__)
            raise ValueError(
                f"method=cort needs a task whose rubric is part of the prompt (it rescores each "
                f"response under the sampling prompt and under that prompt without its "
                f"criteria), but task={name} gives its information as per-response verifier "
                f"blocks (info_in_prompt=False); use task=ifeval or task=synthetic with "
                f"method=cort, or method=mrtpo / method=grpo with task={name}"
            )

    def replay_pairs(self, rewards: Tensor, group: Tensor, has_block: Tensor) -> Tensor:
        """``[N, 1]``: responses whose GRPO advantage can be non-zero (their group's summed
        reward varies) and that have a criteria-free context to compare with."""
        r = torch.nan_to_num(rewards.to(compute_dtype(rewards)), nan=0.0)
        total = (r * self._c_vector(r.shape[1], r.dtype, r.device)).sum(-1, keepdim=True)
        info = has_block.to(torch.bool).any(-1, keepdim=True)
        return replay_mask(total, group, info)

    def token_weights(self, q, mask, replayed, step: int):
        """CoRT's weights (one profile for the response), as ``[N, 1, T]``."""
        w = cort_weights(q, mask, replayed, self.beta(step), self.contrast_clip, self.max_weight)
        return w[:, None, :]

    def __call__(self, inputs: CreditInputs) -> CreditOutput:
        beta = self.beta(inputs.step)
        c, stats = self._coefficients(inputs)
        adv = grpo_advantages(inputs.rewards, inputs.group, c, self.eps)
        n = inputs.rewards.shape[0]
        q, replayed = inputs.q, inputs.replayed
        _check_q(q, n, 1, "cort expects log-likelihood contrasts q")
        weights = None
        if q is None or beta == 0.0:
            # GRPO's own path: nothing to reweight, so the output is GRPO's to the last bit.
            tok = _broadcast(adv, inputs.mask)
        else:
            weights = self.token_weights(q, inputs.mask, replayed, inputs.step)
            w = weights[:, 0, :]
            valid = inputs.mask.to(device=adv.device, dtype=torch.bool)
            tok = torch.where(valid, adv[:, None] * w.to(device=adv.device, dtype=adv.dtype), 0.0)
            stats.update(self._weight_stats(q, w, valid, replayed))
        stats.update(_adv_stats(tok, inputs.mask))
        stats["beta"] = beta
        stats["replayed_share"] = _replayed_share(inputs, joint=True)
        return CreditOutput(tok, stats, weights=weights)

    @staticmethod
    def _weight_stats(q: Tensor, w: Tensor, valid: Tensor, replayed: Tensor | None):
        sel = valid.to(q.device)
        if replayed is not None:
            sel = sel & replayed.to(device=q.device, dtype=torch.bool).reshape(-1, 1)
        if not bool(sel.any()):
            return {}
        d = q[:, 0, :].to(torch.float32)[sel]
        ws = w.to(torch.float32)[sel.to(w.device)]
        return {
            "contrast_mean": float(d.mean()),
            "contrast_abs_mean": float(d.abs().mean()),
            "weight_min": float(ws.min()),
            "weight_max": float(ws.max()),
        }
