"""Distillation math for on-policy self-distillation (OPSD): pure tensor functions.

``generalized_jsd`` follows the OPSD authors' code (after TRL's GKD loss): the mixed form
tends to 0, not a KL, at ``β = 0`` and ``1``, hence the special cases there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from mrtpo.core.credit.advantages import compute_dtype


@dataclass
class TeacherScores:
    """The frozen teacher's view of a batch's sampled tokens (OPSD's ``CreditInputs.extra``)."""

    logp: Tensor  # [N, T] log p_teacher(y_t | teacher context, y_<t), 0 on pads
    student_logp: Tensor  # [N, T] log pi_old(y_t | P0, y_<t), at the same temperature
    top1: Tensor  # [N, T] bool: y_t is the teacher's most likely next token
    rows: Tensor  # [N] bool: responses whose example has a teacher context (a reference)


def _xlogy_ratio(logp: Tensor, logq: Tensor) -> Tensor:
    """``p (log p - log q)`` elementwise, 0 where ``p`` is 0 (``-inf`` log-probs allowed)."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), 0.0)


def _log_mixture_ratio(d: Tensor, w_other: float) -> Tensor:
    """``log(m / p)``, ``m = (1 - w) p + w q``, from ``d = log q - log p``: ``log1p(expm1)`` near
    0 (exactly 0 for identical inputs), ``logaddexp`` far from it (no overflow)."""
    near = torch.log1p(w_other * torch.expm1(d.clamp(max=1.0)))
    far = torch.logaddexp(torch.full_like(d, math.log1p(-w_other)), d + math.log(w_other))
    return torch.where(d.abs() < 1.0, near, far)


def generalized_jsd(logp_student: Tensor, logp_teacher: Tensor, beta: float = 0.5) -> Tensor:
    """Generalized JSD between two log-prob tensors ``[..., V]`` -> ``[...]`` (nats).

    ``beta = 0``: ``KL(teacher ‖ student)``; ``beta = 1``: ``KL(student ‖ teacher)``;
    otherwise ``β KL(teacher ‖ m) + (1 − β) KL(student ‖ m)``, ``m = (1 − β) p_s + β p_t``.
    Computed in float32 (float64 when an input is float64); identical inputs give exactly 0.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"method.beta must be in [0, 1], got {beta}")
    dtype = compute_dtype(logp_student, logp_teacher)
    s = logp_student.to(dtype)
    t = logp_teacher.to(dtype)
    if beta == 0.0:
        return _xlogy_ratio(t, s).sum(-1)
    if beta == 1.0:
        return _xlogy_ratio(s, t).sum(-1)
    ps, pt = s.exp(), t.exp()
    # KL(p || m) = -sum p log(m / p); the student's mixture share is 1 - beta
    kl_t = -torch.where(pt > 0, pt * _log_mixture_ratio(s - t, 1.0 - beta), 0.0).sum(-1)
    kl_s = -torch.where(ps > 0, ps * _log_mixture_ratio(t - s, beta), 0.0).sum(-1)
    return beta * kl_t + (1.0 - beta) * kl_s


TeacherLogits = Tensor | Callable[[int, int], Tensor]


def _log_softmax(logits: Tensor, temperature: float) -> Tensor:
    """``log_softmax(logits / temperature)`` in float32 (no division at temperature 1)."""
    x = logits.float()
    return torch.log_softmax(x / temperature if temperature != 1.0 else x, dim=-1)


def _teacher_piece(teacher: TeacherLogits, s: int, e: int, ids, temperature, device=None):
    """The teacher's log-probs at positions ``[s, e)`` (no grad, on ``device`` if given), its
    log-prob of each ``y_t`` and whether ``y_t`` is its argmax."""
    with torch.no_grad():
        x = teacher[:, s:e] if isinstance(teacher, Tensor) else teacher(s, e)
        lt = _log_softmax(x if device is None else x.to(device), temperature)
        y = ids[:, s:e].to(lt.device)
        return lt, lt.gather(-1, y[..., None]).squeeze(-1), lt.argmax(-1) == y


def _jsd_piece(
    s_logits: Tensor, s: int, e: int, *, teacher_logits, ids: Tensor, beta, temperature
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``generalized_jsd_chunked`` on positions ``[s, e)`` (a unit of checkpointing)."""
    lt, t_y, top1 = _teacher_piece(teacher_logits, s, e, ids, temperature, s_logits.device)
    ls = _log_softmax(s_logits, temperature)
    s_y = ls.detach().gather(-1, ids[:, s:e, None]).squeeze(-1)
    return generalized_jsd(ls, lt, beta), t_y, s_y, top1


def _masked_cat(parts, valid: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-chunk ``[n, c]`` pieces joined along positions, 0 (False) off ``valid``."""
    x = torch.cat(parts, dim=1) if parts else torch.zeros_like(valid, dtype=dtype)
    if x.dtype == torch.bool:
        return x & valid
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=valid.device))


def generalized_jsd_chunked(
    student_logits: Tensor,
    teacher_logits: TeacherLogits,
    mask: Tensor,
    response_ids: Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk: int = 256,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token generalized JSD between ``softmax(student_logits / τ)`` and the teacher's.

    ``teacher_logits``: ``[n, T, V]`` or ``f(s, e) -> [n, e - s, V]`` (under no_grad, so the caller
    can apply an LM head per chunk). ``chunk // n`` positions at a time in float32; with gradient
    each chunk is checkpointed. Returns (divergence, teacher log-prob of y_t, detached student
    log-prob of y_t, y_t is the teacher's argmax), each ``[n, T]``, 0/False off ``mask``.
    """
    n, t = response_ids.shape
    dev = student_logits.device
    valid = mask.to(device=dev, dtype=torch.bool)
    ids = response_ids.to(dev)
    step = max(1, int(chunk) // max(n, 1))
    grad = torch.is_grad_enabled() and student_logits.requires_grad

    piece = functools.partial(
        _jsd_piece, teacher_logits=teacher_logits, ids=ids, beta=beta, temperature=temperature
    )

    pieces = []
    for s in range(0, t, step):
        e = min(t, s + step)
        args = (student_logits[:, s:e], s, e)
        pieces.append(checkpoint(piece, *args, use_reentrant=False) if grad else piece(*args))
    div, t_y, s_y, top1 = list(zip(*pieces, strict=True)) or [()] * 4
    parts = (_masked_cat(div, valid), _masked_cat(t_y, valid), _masked_cat(s_y, valid))
    return (*parts, _masked_cat(top1, valid, torch.bool))


def sampled_token_scores(
    teacher_logits: TeacherLogits,
    response_ids: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    chunk: int = 256,
) -> tuple[Tensor, Tensor]:
    """``(log p_teacher(y_t) [n, T] float32, y_t is the teacher's argmax [n, T] bool)`` from
    the teacher's logits (tensor or ``f(s, e)``), chunk by chunk, 0/False off ``mask``."""
    n, t = response_ids.shape
    step = max(1, int(chunk) // max(n, 1))
    pieces = [
        _teacher_piece(teacher_logits, s, min(t, s + step), response_ids, temperature)[1:]
        for s in range(0, t, step)
    ]
    lps, tops = list(zip(*pieces, strict=True)) or [(), ()]
    valid = mask.to(device=lps[0].device if lps else "cpu", dtype=torch.bool)
    return _masked_cat(lps, valid), _masked_cat(tops, valid, torch.bool)
