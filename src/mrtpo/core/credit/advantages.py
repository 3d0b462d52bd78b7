"""Response-level advantages: group normalization, GRPO, GDPO and SAW reward weights.

Pure tensor math on ``rewards [N, K]`` (NaN: does not apply) and ``group [N]``, groups whole
on a rank in fixed-order reductions; batch statistics over the *global* batch (all-reduced over
``process_group``) in two float64 passes, so splitting over ranks changes float64 rounding only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half-precision inputs are upcast)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def all_reduce_sum(t: Tensor, process_group: Any = None) -> Tensor:
    """Sum ``t`` over the ranks of ``process_group`` in place; a no-op outside DDP."""
    if process_group is None:
        return t
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=process_group)
    return t


def global_row_index(n: int, process_group: Any = None, device=None) -> Tensor:
    """``[n]`` long: each local row's index in the global batch, ranks in order (rank 0's
    rows first); ``arange(n)`` outside DDP. One all-gather of the row counts."""
    offset = 0
    if process_group is not None and dist.is_available() and dist.is_initialized():
        mine = torch.tensor([n], dtype=torch.long, device=device)
        counts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(process_group))]
        dist.all_gather(counts, mine, group=process_group)
        offset = int(sum(int(c) for c in counts[: dist.get_rank(process_group)]))
    return torch.arange(offset, offset + n)


def batch_moments(
    x: Tensor, valid: Tensor | None = None, process_group: Any = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Global count, mean and unbiased std of ``x`` over dim 0 where ``valid``, in float64 (two
    passes, no cancellation); std 0 below two entries, mean 0 with none."""
    x64 = x.to(torch.float64)
    if valid is None:
        valid = torch.ones_like(x, dtype=torch.bool)
    x64 = torch.where(valid, x64, torch.zeros_like(x64))
    first = torch.stack([valid.sum(0).to(torch.float64), x64.sum(0)])
    first = all_reduce_sum(first, process_group)
    count, total = first[0], first[1]
    mean = total / count.clamp(min=1.0)
    centred = torch.where(valid, x64 - mean, torch.zeros_like(x64))
    ss = all_reduce_sum(centred.square().sum(0), process_group)
    var = ss / (count - 1.0).clamp(min=1.0)
    std = torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))
    return count, mean, std


def _grouped(values: Tensor, group: Tensor, dtype: torch.dtype):
    """``values [N, K]`` (N > 0) as a dense NaN-padded ``[groups, size, K]`` (reductions over
    dim 1 have a fixed order, deterministic on GPU too, unlike scatter-add, and follow the
    responses' order in each group); its present mask; whether each group's present values
    differ (``[groups, 1, K]``); each response's group and position in it."""
    group = group.to(values.device)
    _, inv, counts = torch.unique(group, return_inverse=True, return_counts=True)
    order = torch.argsort(inv, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(inv)
    pos[order] = torch.arange(group.shape[0], device=group.device) - starts[inv[order]]
    shape = (int(counts.numel()), int(counts.max().item()), values.shape[1])
    padded = torch.full(shape, float("nan"), dtype=dtype, device=values.device)
    padded[inv, pos] = values.to(dtype)
    present = ~torch.isnan(padded)
    hi = torch.where(present, padded, torch.full_like(padded, -float("inf"))).amax(1, True)
    lo = torch.where(present, padded, torch.full_like(padded, float("inf"))).amin(1, True)
    return padded, present, hi > lo, inv, pos


def group_advantages(
    rewards: Tensor, group: Tensor, eps: float = 1e-4, process_group: Any = None
) -> Tensor:
    """Per-reward group normalization ``[N, K] -> [N, K]`` (GDPO's first step), unbiased std over
    the group's present members. NaN, fewer than two present values, or all equal (tested
    exactly, so rounding cannot leak a tiny advantage) give 0. ``process_group`` is ignored (a
    group is whole on one rank); it keeps the signature uniform.
    """
    del process_group
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, K], got shape {tuple(rewards.shape)}")
    dtype = compute_dtype(rewards)
    if rewards.shape[0] == 0:
        return torch.zeros_like(rewards, dtype=dtype)
    padded, present, differ, inv, pos = _grouped(rewards, group, dtype)
    vals = torch.where(present, padded, 0.0)
    count = present.sum(1, keepdim=True)
    mean = vals.sum(1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(present, padded - mean, 0.0)
    var = centred.square().sum(1, keepdim=True) / (count - 1).clamp(min=1)
    varies = (count >= 2) & differ
    adv = centred / (var.sqrt() + eps)
    adv = torch.where(present & varies, adv, 0.0)
    return adv[inv, pos]


def reward_weight_vector(
    weights: Tensor | Sequence[float] | None, k: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Reward coefficients ``c_k`` as a ``[K]`` tensor (ones when not given)."""
    if weights is None:
        return torch.ones(k, dtype=dtype, device=device)
    c = torch.as_tensor(weights, dtype=dtype, device=device)
    if c.shape != (k,):
        raise ValueError(f"reward weights must have shape ({k},), got {tuple(c.shape)}")
    return c


def grpo_advantages(
    rewards: Tensor,
    group: Tensor,
    weights: Tensor | Sequence[float] | None = None,
    eps: float = 1e-4,
) -> Tensor:
    """GRPO: normalize the weighted reward sum (NaN counts as 0) within each group -> ``[N]``."""
    dtype = compute_dtype(rewards)
    r = torch.nan_to_num(rewards.to(dtype), nan=0.0)
    c = reward_weight_vector(weights, r.shape[1], dtype, r.device)
    total = (r * c).sum(-1, keepdim=True)
    return group_advantages(total, group, eps)[:, 0]


def gdpo_parts(
    rewards: Tensor,
    group: Tensor,
    weights: Tensor | Sequence[float] | None = None,
    eps: float = 1e-4,
    process_group: Any = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """GDPO's ``A_k [N, K]``, ``S [N]``, ``mu``, ``sigma + eps`` and ``A [N]``; MRTPO reuses these
    exact tensors, which is why β = 0 reproduces GDPO bit for bit."""
    a_k = group_advantages(rewards, group, eps)
    c = reward_weight_vector(weights, a_k.shape[1], a_k.dtype, a_k.device)
    s = (a_k * c).sum(-1)
    _, mu, sigma = batch_moments(s, None, process_group)
    mu = mu.to(s.dtype)
    denom = sigma.to(s.dtype) + eps
    # Only reachable with eps = 0 and a constant S, where S - mu = 0 anyway.
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    adv = (s - mu) / denom
    return a_k, s, mu, denom, adv


def gdpo_advantages(
    rewards: Tensor,
    group: Tensor,
    weights: Tensor | Sequence[float] | None = None,
    eps: float = 1e-4,
    process_group: Any = None,
) -> Tensor:
    """GDPO advantages ``[N]``; the batch std is unbiased over the global count (0 for one)."""
    return gdpo_parts(rewards, group, weights, eps, process_group)[4]


def saw_weights(
    rewards: Tensor,
    process_group: Any = None,
    lower_bounds: Tensor | Sequence[float] | None = None,
) -> Tensor:
    """SAW reward weights ``[K]``: ``K' CV_k / sum CV`` (1 each if every CV is 0; 0 below two
    present values), ``CV_k = std_k / (|mean_k| + 1e-8)`` over the global batch (docs/method.md).
    A reward whose ``lower_bounds`` (``Task.reward_ranges``) is below 0 is shifted by ``-lower``
    first, as the official SAW code adds 3 to ToolRL's correctness: else ``|mean|`` near 0 blows
    the CV up."""
    dtype = compute_dtype(rewards)
    present = ~torch.isnan(rewards)
    count, mean, std = batch_moments(rewards, present, process_group)
    if lower_bounds is not None:
        lo = torch.as_tensor(lower_bounds, dtype=torch.float64, device=mean.device)
        if lo.shape != mean.shape:
            raise ValueError(
                f"lower_bounds must have shape {tuple(mean.shape)}, got {tuple(lo.shape)}"
            )
        mean = mean - torch.clamp(lo, max=0.0)  # the mean of the shifted values
    defined = count >= 2
    cv = torch.where(defined, std / (mean.abs() + 1e-8), torch.zeros_like(std))
    k_eff = defined.sum().to(torch.float64)
    total = cv.sum()
    w = torch.where(
        total > 0,
        k_eff * cv / torch.where(total > 0, total, torch.ones_like(total)),
        defined.to(torch.float64),
    )
    return w.to(dtype)


def replay_mask(rewards: Tensor, group: Tensor, has_block: Tensor | None = None) -> Tensor:
    """bool ``[N, K]``: pairs that are present, not all equal within their group and (with
    ``has_block``) have an information block; any other pair keeps weight 1 anyway."""
    present = ~torch.isnan(rewards)
    if rewards.shape[0] == 0:
        return present
    differ, inv = _grouped(rewards, group, rewards.dtype)[2:4]
    out = present & differ[inv, 0]
    if has_block is not None:
        out = out & has_block.to(device=out.device, dtype=torch.bool)
    return out
