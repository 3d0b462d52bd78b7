"""OPSD: on-policy self-distillation (Zhao et al., arXiv 2601.18734; github.com/siyan-zhao/OPSD).

No reward credit: ``method.variant`` ``full`` adds a generalized JSD to the frozen teacher
(the ``token_loss`` hook), ``sampled`` uses ``log p_teacher(y_t) − log p_student(y_t)`` as the
advantage; docs/method.md, "OPSD", has the details.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch import Tensor

from mrtpo.core.credit.distill import TeacherScores, generalized_jsd_chunked
from mrtpo.core.credit.methods import (
    AdvantageMethod,
    CreditInputs,
    CreditOutput,
    MethodServices,
    StepView,
    TeacherRequest,
    _adv_stats,
)
from mrtpo.core.credit.teacher import Teacher
from mrtpo.core.loss import aggregate

log = logging.getLogger(__name__)


class OPSD(AdvantageMethod):
    """On-policy self-distillation from the frozen initial model with the reference in view."""

    config_name = "opsd"
    VARIANTS: ClassVar[tuple[str, ...]] = ("full", "sampled")

    def __init__(
        self, variant: str = "full", beta: float = 0.5, coef: float = 1.0, chunk: int = 256
    ) -> None:
        if variant not in self.VARIANTS:
            raise ValueError(f"method.variant={variant!r}; valid: {list(self.VARIANTS)}")
        if not 0.0 <= float(beta) <= 1.0:
            raise ValueError(
                f"method.beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}"
            )
        if not float(coef) > 0:
            raise ValueError(f"method.coef must be > 0, got {coef}")
        if int(chunk) < 1:
            raise ValueError(f"method.chunk must be >= 1 (row, position) pairs, got {chunk}")
        self.variant = variant
        self.jsd_beta = float(beta)
        self.coef = float(coef)
        self.chunk = int(chunk)
        self.teacher = TeacherRequest(sampled=variant == "sampled", full=variant == "full")
        self.wants_logits = self.teacher.full
        self.frozen: Teacher | None = None  # built by setup, given services
        self._task = None

    # ---- start-up --------------------------------------------------------------------
    def setup(self, task, services: MethodServices | None = None) -> None:
        super().setup(task, services)
        if hasattr(task, "examples"):  # a task, not only its reward set (``RewardSet``)
            self._check_references(task)
        if services is not None:
            model, adapters_off = services.frozen_policy()
            self.frozen = Teacher(
                model,
                services.tokenizer,
                adapters_off=adapters_off,
                token_budget=services.token_budget,
                shared_prompt=services.shared_prompt,
            )
            self._task, self._chunk = services.task, services.chunk

    def _check_references(self, task) -> None:
        name = getattr(task, "name", type(task).__name__)
        examples = list(task.examples("train"))
        # A task may refuse here with its own config key (text2sql: task.reference_solutions).
        have = sum(task.teacher_messages(e) is not None for e in examples)
        if not have:
            raise ValueError(
                f"method=opsd needs a reference solution per training example (the frozen "
                f"teacher reads it as an earlier answer), but task={name} has none among its "
                f"{len(examples)} training examples (Task.teacher_messages gave None); use a "
                f"task with references (task=synthetic, task=text2sql with "
                f"task.reference_solutions) or another method"
            )
        if have < len(examples):
            log.warning(
                f"method=opsd: {len(examples) - have} of {len(examples)} training examples of "
                f"task={name} have no reference; their responses get no distillation signal "
                "(train/adv/teacher_share counts them)"
            )

    def _bound(self) -> Teacher:
        if self.frozen is None:
            raise RuntimeError(
                "method=opsd was never set up with a trainer's services (AdvantageMethod.setup)"
            )
        return self.frozen

    # ---- the hooks -------------------------------------------------------------------
    def score_inputs(self, view: StepView) -> TeacherScores | None:
        """``sampled``: the teacher's log-prob of every sampled token, and the student's."""
        if not self.teacher.sampled:
            return None
        return self._bound().score(
            self._task, view.rollout, view.student_logp(), self._chunk, device=view.device
        )

    def token_loss(self, logits, batch, temperature, agg, denom, device=None):
        """``full``: the divergence to the teacher on one update micro-batch (rows without a
        teacher context are left out)."""
        if not self.teacher.full:
            return None
        teacher_logits, rows = self._bound().logits(self._task, batch, device=device)
        mask = batch.response_mask.to(logits.device) & rows.to(logits.device)[:, None]
        return self.divergence(
            logits, teacher_logits, batch.response_ids, mask, temperature, agg, denom
        )

    # ---- credit ----------------------------------------------------------------------
    def __call__(self, inputs: CreditInputs) -> CreditOutput:
        mask = inputs.mask.to(torch.bool)
        n = mask.shape[0]
        if self.variant == "full":
            # No reward credit: the divergence term (token_loss) is the whole signal.
            tok = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
            return CreditOutput(tok, _adv_stats(tok, mask))
        t: TeacherScores | None = inputs.extra
        if t is None:
            raise RuntimeError(
                "method=opsd variant=sampled needs the teacher's log-probs of the sampled "
                "tokens (CreditInputs.extra, from score_inputs), and the trainer passed none"
            )
        dev = mask.device
        rows = t.rows.to(device=dev, dtype=torch.bool)
        valid = mask & rows[:, None]
        gap = t.logp.to(dev, torch.float32) - t.student_logp.to(dev, torch.float32)
        tok = torch.where(valid, gap, torch.zeros((), device=dev))  # a constant: no gradient
        stats = _adv_stats(tok, mask)
        stats["teacher_share"] = float(rows.float().mean()) if n else 0.0
        if bool(valid.any()):
            stats["logp_gap"] = float(gap[valid].mean())
            # E_student[log p_s - log p_t]: a sampled estimate of KL(student ‖ teacher)
            stats["divergence"] = -stats["logp_gap"]
            stats["teacher_agree"] = float(t.top1.to(dev)[valid].float().mean())
        return CreditOutput(tok, stats)

    def divergence(
        self,
        student_logits: Tensor,
        teacher_logits,
        response_ids: Tensor,
        mask: Tensor,
        temperature: float,
        agg: str,
        denom: float,
    ) -> tuple[Tensor, dict[str, float]]:
        """``coef`` x the generalized JSD per token, aggregated as the surrogate is."""
        div, t_y, s_y, top1 = generalized_jsd_chunked(
            student_logits,
            teacher_logits,
            mask,
            response_ids,
            beta=self.jsd_beta,
            temperature=temperature,
            chunk=self.chunk,
        )
        valid = mask.to(device=div.device, dtype=torch.bool)
        term = self.coef * aggregate(div, valid, agg, denom)
        stats: dict[str, float] = {}
        if bool(valid.any()):
            stats = {
                "distill/divergence": float(div.detach()[valid].mean()),
                "distill/teacher_agree": float(top1[valid].float().mean()),
                "distill/logp_gap": float((t_y - s_y)[valid].mean()),
            }
        return term, stats
