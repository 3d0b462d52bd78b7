"""The frozen teacher of self-distillation: the initial model (a frozen copy, or under LoRA
the policy with its adapters off) reading each sampled response after the task's teacher
context (``Task.teacher_messages``), under no_grad. ``TeacherRequest`` picks the pass:
``score`` (once per step) or ``logits`` (per update micro-batch, the head applied per chunk).
"""

from __future__ import annotations

import contextlib
import json

import torch
from torch import Tensor

from mrtpo.core.chat import chat_ids
from mrtpo.core.credit.distill import TeacherScores, sampled_token_scores
from mrtpo.core.forward import (
    pad_left,
    response_hidden,
    response_hidden_shared_prefix,
    response_logits,
    shared_context_layout,
    split_head,
)


class Teacher:
    """Teacher forwards for one run. ``adapters_off``: ``model`` is the LoRA policy and the
    teacher is its base (``disable_adapter``); otherwise ``model`` is a frozen copy."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        adapters_off: bool = False,
        token_budget=16384,
        shared_prompt: str = "auto",
    ) -> None:
        self.model = model
        # rows with one teacher context (a group's G samples) run it once: rl.shared_prompt_forward
        self.shared_prompt = shared_prompt
        self.tokenizer = tokenizer
        self.adapters_off = bool(adapters_off)
        self.token_budget = int(token_budget)
        self._ids: dict[str, list[int]] = {}

    # -- contexts -------------------------------------------------------------------------
    def context_ids(self, task, examples) -> list[list[int] | None]:
        """Token ids of each example's teacher context (None: the example has none)."""
        out: list[list[int] | None] = []
        for ex in examples:
            messages = task.teacher_messages(ex)
            if messages is None:
                out.append(None)
                continue
            key = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str)
            if key not in self._ids:
                if len(self._ids) > 65536:  # a long run over a large dataset: start afresh
                    self._ids.clear()
                self._ids[key] = chat_ids(self.tokenizer, messages)
            out.append(self._ids[key])
        return out

    @contextlib.contextmanager
    def _frozen(self, device):
        model = self.model
        if device is not None and next(model.parameters()).device != torch.device(device):
            model.to(device)  # a copy kept outside the LightningModule does not move with it
        was_training = model.training
        model.eval()
        try:
            adapters = model.disable_adapter() if self.adapters_off else contextlib.nullcontext()
            with torch.no_grad(), adapters:
                yield model
        finally:
            model.train(was_training)

    def _states(self, model, ctx: list[list[int]], r_ids: Tensor, r_mask: Tensor):
        """(hidden [n, T, H] and the LM head) or (logits [n, T, V], None)."""
        pad, split = self.tokenizer.pad_token_id, split_head(model)
        if split is not None:
            shared = shared_context_layout(model, ctx, r_ids.shape[1], pad, self.shared_prompt)
            if shared is not None:
                return response_hidden_shared_prefix(split[0], *shared, r_ids, r_mask), split[1]
        c_ids, c_mask = pad_left(ctx, pad)
        if split is None:
            logits = response_logits(model, c_ids, c_mask, r_ids, r_mask, self.shared_prompt)
            return logits, None
        return response_hidden(split[0], c_ids, c_mask, r_ids, r_mask), split[1]

    # -- the two passes -------------------------------------------------------------------
    def score(
        self, task, roll, student_logp: Tensor, chunk: int = 256, device=None
    ) -> TeacherScores:
        """Teacher log-probs of the sampled tokens of a whole batch, at its temperature."""
        n, t = roll.response_ids.shape
        ctx = self.context_ids(task, roll.examples)
        rows = torch.tensor([c is not None for c in ctx], dtype=torch.bool)
        logp = torch.zeros((n, t), dtype=torch.float32)
        top1 = torch.zeros((n, t), dtype=torch.bool)
        lengths = roll.response_mask.sum(-1)
        packs: list[list[int]] = [[]]  # by context length, each within the token budget
        for j in sorted((j for j in range(n) if ctx[j] is not None), key=lambda j: len(ctx[j])):
            width = max(len(ctx[i]) + int(lengths[i]) for i in [*packs[-1], j])
            if packs[-1] and (len(packs[-1]) + 1) * width > self.token_budget:
                packs.append([])
            packs[-1].append(j)
        with self._frozen(device) as model:
            for pack in filter(None, packs):
                idx = torch.tensor(pack)
                tt = max(1, int(lengths[idx].max()))
                r_ids, r_mask = roll.response_ids[idx, :tt], roll.response_mask[idx, :tt]
                states, head = self._states(model, [ctx[j] for j in pack], r_ids, r_mask)
                fn = states if head is None else (lambda s, e, h=states, hd=head: hd(h[:, s:e]))
                lp, top = sampled_token_scores(fn, r_ids, r_mask, roll.temperature, chunk)
                logp[idx, :tt] = lp.cpu()
                top1[idx, :tt] = top.cpu()
        return TeacherScores(
            logp=logp, student_logp=student_logp.float().cpu(), top1=top1, rows=rows
        )

    def logits(self, task, sub, device=None):
        """``(f(s, e) -> teacher logits [n, e - s, V], rows [n] bool)`` for one micro-batch. Rows
        without a teacher context run after the sampling prompt and are flagged False (left out of
        the loss)."""
        ctx = self.context_ids(task, sub.examples)
        rows = torch.tensor([c is not None for c in ctx], dtype=torch.bool)
        p0 = [sub.prompt_ids[i][sub.prompt_mask[i]].tolist() for i in range(sub.n)]
        full = [c if c is not None else p for c, p in zip(ctx, p0, strict=True)]
        with self._frozen(device) as model:
            states, head = self._states(model, full, sub.response_ids, sub.response_mask)
        if head is None:
            return states, rows

        def fn(s: int, e: int) -> Tensor:
            # The head is applied here, a chunk at a time. split_head only returns a plain
            # nn.Linear head, which LoRA has not wrapped: it is the initial model's head.
            with torch.no_grad():
                return head(states[:, s:e])

        return fn, rows
