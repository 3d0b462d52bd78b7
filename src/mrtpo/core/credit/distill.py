"""Distillation math for on-policy self-distillation (OPSD): pure tensor functions.

* ``generalized_jsd``: as the OPSD authors' code (after TRL's GKD loss): ``β = 0`` is
  ``KL(teacher ‖ student)``, ``β = 1`` ``KL(student ‖ teacher)``, between them
  ``β KL(teacher ‖ m) + (1 − β) KL(student ‖ m)``, ``m = (1 − β) student + β teacher`` (the
  mixed form tends to 0, not a KL, at the ends: hence the special cases);
* ``generalized_jsd_chunked``: the same from ``[n, T, V]`` logits a chunk at a time (float32
  working set ``chunk x V``; chunks are recomputed in the backward);
* ``sampled_token_scores``: the sampled-token variant's teacher/student log-probs and argmax.
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

__all__ = [
    "TeacherScores",
    "generalized_jsd",
    "generalized_jsd_chunked",
    "sampled_token_scores",
]


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
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return torch.where(p > 0, p * (logp - logq), zero)


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
    zero = torch.zeros((), dtype=dtype, device=s.device)
    ps, pt = s.exp(), t.exp()
    # KL(p || m) = -sum p log(m / p); the student's mixture share is 1 - beta
    kl_t = -torch.where(pt > 0, pt * _log_mixture_ratio(s - t, 1.0 - beta), zero).sum(-1)
    kl_s = -torch.where(ps > 0, ps * _log_mixture_ratio(t - s, beta), zero).sum(-1)
    return beta * kl_t + (1.0 - beta) * kl_s


TeacherLogits = Tensor | Callable[[int, int], Tensor]


def _teacher_chunk(teacher: TeacherLogits, s: int, e: int) -> Tensor:
    return teacher[:, s:e] if isinstance(teacher, Tensor) else teacher(s, e)


def _jsd_piece(
    s_logits: Tensor, s: int, e: int, *, teacher_logits, ids: Tensor, beta, temperature
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``generalized_jsd_chunked`` on positions ``[s, e)`` (a unit of checkpointing)."""
    with torch.no_grad():
        tl = _teacher_chunk(teacher_logits, s, e).to(s_logits.device).float()
        if temperature != 1.0:
            tl = tl / temperature
        lt = torch.log_softmax(tl, dim=-1)
    x = s_logits.float()
    if temperature != 1.0:
        x = x / temperature
    ls = torch.log_softmax(x, dim=-1)
    y = ids[:, s:e, None]
    div = generalized_jsd(ls, lt, beta)
    t_y = lt.gather(-1, y).squeeze(-1)
    s_y = ls.detach().gather(-1, y).squeeze(-1)
    top1 = lt.argmax(-1) == y.squeeze(-1)
    return div, t_y, s_y, top1


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

    divs, t_ys, s_ys, tops = [], [], [], []
    for s in range(0, t, step):
        e = min(t, s + step)
        x = student_logits[:, s:e]
        if grad:
            out = checkpoint(piece, x, s, e, use_reentrant=False)
        else:
            out = piece(x, s, e)
        for acc, v in zip((divs, t_ys, s_ys, tops), out, strict=True):
            acc.append(v)
    div = torch.cat(divs, dim=1) if divs else torch.zeros((n, t), device=dev)
    t_y = torch.cat(t_ys, dim=1) if t_ys else torch.zeros((n, t), device=dev)
    s_y = torch.cat(s_ys, dim=1) if s_ys else torch.zeros((n, t), device=dev)
    top1 = torch.cat(tops, dim=1) if tops else torch.zeros((n, t), dtype=torch.bool, device=dev)
    zero = torch.zeros((), dtype=div.dtype, device=dev)
    return (
        torch.where(valid, div, zero),
        torch.where(valid, t_y, zero),
        torch.where(valid, s_y, zero),
        top1 & valid,
    )


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
    lps, tops = [], []
    with torch.no_grad():
        for s in range(0, t, step):
            e = min(t, s + step)
            x = _teacher_chunk(teacher_logits, s, e).float()
            if temperature != 1.0:
                x = x / temperature
            lt = torch.log_softmax(x, dim=-1)
            y = response_ids[:, s:e, None].to(lt.device)
            lps.append(lt.gather(-1, y).squeeze(-1))
            tops.append(lt.argmax(-1) == y.squeeze(-1))
    dev = lps[0].device if lps else torch.device("cpu")
    valid = mask.to(device=dev, dtype=torch.bool)
    lp = torch.cat(lps, dim=1) if lps else torch.zeros((n, t), device=dev)
    top1 = torch.cat(tops, dim=1) if tops else torch.zeros((n, t), dtype=torch.bool, device=dev)
    return torch.where(valid, lp, torch.zeros((), device=dev)), top1 & valid
