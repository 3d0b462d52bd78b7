"""Phase 6 of the step: clipped-surrogate updates over mini-batches, through an ``UpdateHost``
(``PolicyModule`` under Lightning, ``TorchHost`` in a plain loop) that owns the optimizer. The
updater decides the mini-batches, each micro-batch's loss, and when a non-finite loss on
some rank stops the update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mrtpo.core.batch import RolloutBatch, ScoredBatch
from mrtpo.core.forward import response_logits, response_logprobs
from mrtpo.core.loss import EngineGap, policy_loss, token_logprobs
from mrtpo.distributed import Ranks, dummy_batch
from mrtpo.step.records import Advantages, OldPolicy, Update


class UpdateHost(Protocol):
    """What the step needs from the optimizer's owner."""

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def clip_gradients(self, max_norm: float) -> None: ...

    def optimizer_step(self, counted: bool) -> None:
        """One optimizer update; ``counted``: the step's last (it advances the step count).
        Raises when the parameters or optimizer state stop being finite."""

    def lr(self) -> float: ...

    def end_step(self) -> None:
        """After the step's updates (the learning-rate schedule counts RL steps)."""

    def skip_step(self) -> None:
        """The step counts without an update (a skipped, non-finite step)."""


@dataclass
class _Totals:
    """Running totals over one step's updates."""

    lr: float
    losses: list[float] = field(default_factory=list)  # one per update
    sums: dict[str, float] = field(default_factory=dict)  # token-weighted per-token statistics
    tokens: float = 0.0

    def add(self, stats: Mapping[str, Any], tokens: float) -> None:
        self.tokens += tokens
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * tokens

    def metrics(self) -> dict[str, float]:
        out = {k: v / max(self.tokens, 1.0) for k, v in self.sums.items()}
        out["loss"] = sum(self.losses) / max(len(self.losses), 1)
        out["lr"] = self.lr
        return out


@dataclass
class _Inputs:
    """One step's fixed inputs to every micro-batch loss."""

    method: Any  # the step's AdvantageMethod (its token_loss, wants_logits)
    roll: RolloutBatch
    adv: torch.Tensor
    old: OldPolicy
    gap: EngineGap | None
    tis: torch.Tensor | None  # [N, T] filled by the gap's blocks (one update per step)


class Updater:
    """``rl.ppo_epochs`` passes over shuffled mini-batches, each one optimizer update
    accumulated over micro-batches."""

    def __init__(self, policy, rl, ranks: Ranks, pad_id: int, device) -> None:
        self.policy, self.rl = policy, rl
        self.ranks, self.pad_id, self._device = ranks, pad_id, device

    def __call__(
        self,
        host: UpdateHost,
        method,
        scored: ScoredBatch,
        old: OldPolicy,
        adv: Advantages,
        generator: torch.Generator,
    ) -> Update | None:
        """The update metrics: ``loss`` is the mean over updates, per-token statistics means over
        every valid token of every update, ``lr`` this step's. None when a loss was not finite
        on any rank. With ``old.gap_in_update`` the engine gap is measured on the way."""
        rl, roll = self.rl, scored.rollout
        gap = EngineGap(old.tis_cap) if old.gap_in_update else None
        tis = torch.zeros(roll.response_ids.shape) if gap and gap.tis_cap is not None else None
        inputs = _Inputs(method, roll, adv.advantages, old, gap, tis)
        start, total = self._rows_in_global_batch(roll.n)
        # the global mini-batch: rl.mini_batch_size responses per rank, drawn from the whole
        # batch (as one process holding it would draw them); a rank updates on its share
        mini = max(1, min(int(rl.mini_batch_size), total)) * self.ranks.world_size
        mini = min(mini, total)
        micro = max(1, min(int(rl.micro_batch_size), mini))
        acc = _Totals(lr=host.lr())
        n_updates, u = int(rl.ppo_epochs) * -(-total // mini), 0  # mini-batches of every epoch
        for _ in range(int(rl.ppo_epochs)):
            perm = torch.randperm(total, generator=generator)
            for s in range(0, total, mini):
                u += 1
                # Each mini-batch's rows in order: a group's rows that meet in it land in the
                # same micro-batches, where the forward runs their prompt once.
                chosen = perm[s : s + mini]
                mb = (chosen[(chosen >= start) & (chosen < start + roll.n)] - start).sort().values
                # several ranks: every rank loops over the busiest rank's share (idle passes)
                width = self.ranks.max(len(mb)) if self.ranks.world_size > 1 else len(mb)
                if not self._accumulate(host, inputs, mb, width, micro, acc):
                    return None
                if rl.max_grad_norm:
                    host.clip_gradients(float(rl.max_grad_norm))
                host.optimizer_step(counted=(u == n_updates))
        host.end_step()
        gap_metrics = gap.metrics(old.stale) if gap is not None else {}
        return Update(acc.metrics(), tis=tis, rollout_metrics=gap_metrics)

    def _rows_in_global_batch(self, n: int) -> tuple[int, int]:
        """(where this rank's rows start, how many rows all ranks hold): rank r holds the r-th
        block of the global batch, as it reads the r-th block of the prompts."""
        if self.ranks.world_size == 1:
            return 0, n
        counts = [int(c) for c in self.ranks.gather(int(n))]
        return sum(counts[: self.ranks.rank]), sum(counts)

    def _accumulate(self, host, inputs: _Inputs, mb, width: int, micro: int, acc) -> bool:
        """One optimizer update's gradients: micro-batches of ``mb`` (``width`` rows on the
        busiest rank), backward each. False when a loss was not finite on some rank."""
        denom = self._normalizer(inputs.roll, mb)
        host.zero_grad()
        update_loss = 0.0
        for ms in range(0, width, micro):
            idx = mb[ms : ms + micro]
            if len(idx) == 0:  # out of rows (several ranks): an idle pass, loss 0
                if not self._idle_backward(host, inputs.roll.temperature):
                    host.zero_grad()
                    return False
                continue
            loss, stats, tokens = self._micro_loss(inputs, idx, denom)
            # Decided jointly: a rank that skipped backward would leave the others waiting in
            # DDP's gradient all-reduce.
            if self.ranks.any(not bool(torch.isfinite(loss))):
                host.zero_grad()
                return False
            host.backward(loss)
            # micro-batch losses share the mini-batch's normalizer: they add up to it
            update_loss += float(loss.detach())
            acc.add(stats, tokens)
        acc.losses.append(update_loss)
        return True

    def _normalizer(self, roll: RolloutBatch, mb) -> float:
        """The loss normalizer of the global mini-batch (tokens, or responses for
        seq-mean-token-mean), per rank: DDP averages gradients over ranks."""
        if self.rl.loss_agg == "token-mean":
            local = roll.response_mask[mb].sum().float()
        else:
            local = torch.tensor(float(len(mb)))
        total = self.ranks.all_reduce_sum(local.to(self._device())).clamp_min(1.0)
        return float(total) / self.ranks.world_size

    def _micro_loss(self, inputs: _Inputs, idx, denom: float):
        """(loss, per-token statistics, valid tokens) of one micro-batch: the surrogate plus the
        method's ``token_loss``. With a gap to measure, this forward is pi_old's (gap, TIS)."""
        rl, old, sub = self.rl, inputs.old, inputs.roll.select(idx)
        tau = sub.temperature
        logp, logits = self.policy_logprobs(sub, tau, inputs.method.wants_logits)
        dev = logp.device

        def rows(x):
            return None if x is None else x[idx].to(dev)

        tis = rows(old.tis)
        if inputs.gap is not None:
            tis = inputs.gap.add(logp.detach(), sub.engine_logp, sub.response_mask.to(dev))
            if tis is not None:  # kept for the step's record
                inputs.tis[idx] = tis.cpu()
        loss, stats = policy_loss(
            logp=logp,
            # one update per step: the sampling policy is the current one
            old_logp=logp.detach() if old.logp is None else rows(old.logp),
            advantages=rows(inputs.adv),
            mask=sub.response_mask.to(dev),
            clip_low=rl.clip_low,
            clip_high=rl.clip_high,
            agg=rl.loss_agg,
            denom=denom,
            ref_logp=rows(old.ref_logp),
            kl_coef=rl.kl_coef,
            tis_weights=tis,
        )
        extra = inputs.method.token_loss(
            logits, sub, tau, rl.loss_agg, denom, device=self._device()
        )
        if extra is not None:
            loss, stats = loss + extra[0], {**stats, **extra[1]}
        return loss, stats, float(sub.response_mask.sum())

    def policy_logprobs(self, sub: RolloutBatch, tau: float, wants_logits: bool):
        """(log-probs of the sampled tokens [n, T], the logits [n, T, V] when the method's
        token loss reads them (``wants_logits``), else None), with gradient."""
        args = (sub.prompt_ids, sub.prompt_mask, sub.response_ids, sub.response_mask)
        share = self.rl.shared_prompt_forward
        if not wants_logits:
            logp = response_logprobs(self.policy, *args, temperature=tau, shared_prompt=share)
            return logp, None
        logits = response_logits(self.policy, *args, shared_prompt=share)
        ids = sub.response_ids.to(logits.device)
        logp = token_logprobs(logits, ids, temperature=tau) * sub.response_mask.to(logits.device)
        return logp, logits

    def _idle_backward(self, host: UpdateHost, temperature: float) -> bool:
        """An update micro-batch without rows: forward, the joint finiteness check and a
        backward of 0 x the log-probs (zero gradients). False when another rank's loss was
        not finite (the update stops on every rank)."""
        logp = response_logprobs(self.policy, *dummy_batch(self.pad_id), temperature=temperature)
        if self.ranks.any(False):
            return False
        host.backward(logp.sum() * 0.0)
        return True


class TorchHost:
    """An ``UpdateHost`` for a plain loop: a torch optimizer (and learning-rate scheduler),
    no training framework. Every optimizer update counts; there is no step counter."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        self.opt, self.sched = optimizer, scheduler
        self.params = [p for g in optimizer.param_groups for p in g["params"]]

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_gradients(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def optimizer_step(self, counted: bool) -> None:
        self.opt.step()
        bad = next((i for i, p in enumerate(self.params) if not bool(p.isfinite().all())), None)
        if bad is not None:
            raise FloatingPointError(f"parameter {bad} is not finite after an update; lower the lr")

    def lr(self) -> float:
        if self.sched is not None:
            return float(self.sched.get_last_lr()[0])
        return float(self.opt.param_groups[0]["lr"])

    def end_step(self) -> None:
        if self.sched is not None:
            self.sched.step()

    def skip_step(self) -> None:
        self.zero_grad()
        self.end_step()
