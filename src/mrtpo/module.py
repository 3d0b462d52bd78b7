"""PolicyModule: one multi-reward RL step, top to bottom.

1. the rollout callback has sampled G responses for each of the B prompts (``batch.rollout``);
2. the task scores every response: K named rewards and verifier blocks (``mrtpo.scoring``);
3. if the method asks for relevance, replay scores each requested (response, reward) pair's
   tokens under the parameters that sampled them, as the method's ``RelevanceRequest`` says;
4. old-policy log-probs of the sampled tokens (no grad, sampling prompt P0), when more than
   one update follows (reused from replay's P_all pass where P_all is P0);
5. the method turns rewards (+ relevance) into token advantages [N, T];
6. clipped-surrogate updates over mini-batches (PPO epochs, micro-batch accumulation);
7. the rollout callback syncs the new weights into the engine.

The module never looks at a method's, task's or engine's name, nor inside the relevance
request it forwards. Fault bookkeeping lives in ``mrtpo.faults``, the step's metrics and
their reduction over ranks in ``mrtpo.step_metrics``, the collectives in
``mrtpo.distributed``.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch

from mrtpo import step_metrics
from mrtpo.batch import PromptBatch, ScoredBatch, rewards_tensor
from mrtpo.checkpointing import NonFiniteStateError, assert_finite_state
from mrtpo.credit.methods import AdvantageMethod, CreditInputs
from mrtpo.distributed import Ranks
from mrtpo.faults import FaultTracker
from mrtpo.forward import response_logits, response_logprobs
from mrtpo.lora import checkpoint_keys, is_lora
from mrtpo.loss import engine_gap, policy_loss, token_logprobs
from mrtpo.replay import Replayer
from mrtpo.scoring import score_batch
from mrtpo.settings import OptimConfig, ReplayConfig, RLConfig
from mrtpo.sharding import dummy_batch, is_sharded
from mrtpo.tasks.base import Task
from mrtpo.teacher import Teacher

log = logging.getLogger(__name__)

OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)


def _free_accelerator_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class PolicyModule(L.LightningModule):
    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        task: Task,
        method: AdvantageMethod,
        rl: RLConfig | Mapping | None = None,
        optim: OptimConfig | Mapping | None = None,
        replay: ReplayConfig | Mapping | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy
        self.tokenizer = tokenizer
        self.task = task
        self.method = method
        self.rl = RLConfig.from_mapping(rl)
        self.optim_cfg = OptimConfig.from_mapping(optim)
        rcfg = ReplayConfig.from_mapping(replay)
        self.seed = seed
        self.replayer = Replayer(
            tokenizer,
            token_budget=rcfg.token_budget,
            jsd_chunk=rcfg.jsd_chunk,
            share_prefix=rcfg.share_prefix,
        )
        method.setup(
            tuple(task.reward_names),
            bool(task.rewards_vary_per_prompt),
            reward_ranges=getattr(task, "reward_ranges", None),
        )
        self.ref_policy = None
        # Under LoRA the reference is the base model itself, adapters off: no second copy.
        if self.rl.kl_coef > 0 and not is_lora(policy):
            self.ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
        self.teacher = None if method.teacher is None else self.frozen_teacher(rcfg.token_budget)
        # Under LoRA a checkpoint holds the adapters only (the frozen base is reloaded from
        # model.name_or_path); None: every tensor.
        self._checkpoint_keys = (
            {"policy." + k for k in checkpoint_keys(policy)} if is_lora(policy) else None
        )
        self.iteration = 0  # completed RL steps (one per prompt batch, skipped ones included)
        self.ranks = Ranks(lambda: self.device)
        self.fault_tracker = FaultTracker(
            self.rl.max_nonfinite_steps, self.rl.max_consecutive_score_failures
        )
        self.last: ScoredBatch | None = None  # for callbacks (sample tables, relevance dumps)
        self.timings: dict[str, float] = {}
        self._absent_as_nan = step_metrics.AbsentAsNaN()
        self._val_rows: list = []

    @property
    def nonfinite_steps(self) -> int:
        return self.fault_tracker.nonfinite_steps

    @property
    def faults(self) -> dict[str, float]:
        """Cumulative fault counters (global over ranks), saved in checkpoints."""
        return self.fault_tracker.counters

    # Batches hold Python objects; tensors are moved where they are used.
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch

    # ---- optimizer ---------------------------------------------------------------------
    def configure_optimizers(self):
        o = self.optim_cfg
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas))
        warm = int(o.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- the step ----------------------------------------------------------------------
    def training_step(self, batch: PromptBatch, batch_idx: int):
        t_step = time.perf_counter()
        rl, times = self.rl, self.timings
        micro = int(rl.micro_batch_size)

        # 2. rewards
        t0 = time.perf_counter()
        scored = self.score(batch)
        times["reward"] = time.perf_counter() - t0
        self.fault_tracker.check_scoring(
            scored.scores, scored.rollout.examples, self.iteration, self.ranks
        )
        roll = scored.rollout
        # NaN means "does not apply"; +-inf is a broken reward: skip rather than train on it.
        if self.ranks.any(bool(torch.isinf(scored.rewards).any())):
            return self._skip_nonfinite("rewards", scored)

        # 3. replay, before any parameter update of this step. At beta = 0 (e.g. the first
        # step of a warm-up) relevance cannot change the advantages, so it is skipped.
        t0 = time.perf_counter()
        replay_stats: dict[str, float] = {}
        res = None
        if self.method.relevance is not None and self.method.beta(self.iteration) > 0:
            pairs = self.method.replay_pairs(scored.rewards, roll.group, self.has_info(scored))
            res = self._replay(scored, pairs)
            scored.q, scored.replayed = res.q, res.replayed
            replay_stats = {f"replay/{k}": v for k, v in res.metrics.items()}
        times["replay"] = time.perf_counter() - t0

        # 4. old-policy (and reference) log-probs under P0, at the sampling temperature. Where
        # P_all is the sampling prompt (tasks whose information is in the prompt) replay
        # already computed them. With a single update per step they equal the current
        # policy's, so the ratio does not need them; they are still computed whenever the
        # engine reported its own log-probs, to measure the engine-trainer gap (and, with
        # rl.tis_cap, to correct for it).
        t0 = time.perf_counter()
        n_mini = -(-roll.n // max(1, int(rl.mini_batch_size)))
        several = int(rl.ppo_epochs) * n_mini > 1
        if rl.tis_cap is not None and roll.engine_logp is None:
            raise RuntimeError(
                f"rl.tis_cap={rl.tis_cap} needs the engine's log-probs of the sampled tokens, "
                "and the rollout engine reported none; set rl.tis_cap=null or use an engine "
                "that reports them (rollout=hf, rollout=vllm)"
            )
        old = None
        gap = roll.engine_logp is not None and (
            several or rl.tis_cap is not None or rl.measure_logp_gap
        )
        if several or gap:
            old = self._old_logprobs(roll, res, micro)
        if several:
            scored.old_logp = old
        rollout_stats: dict[str, float] = {}
        if gap:
            rollout_stats, scored.tis_weights = engine_gap(
                old, roll.engine_logp, roll.response_mask, rl.tis_cap
            )
        if self.rl.kl_coef > 0:
            scored.ref_logp = self.reference_logprobs(roll, micro)
        teacher_scores = None
        if self.method.teacher is not None and self.method.teacher.sampled:
            student = old if old is not None else self._old_logprobs(roll, res, micro)
            teacher_scores = self.teacher.score(
                self.task, roll, student, self.replayer.jsd_chunk, device=self.device
            )
        times["old_logp"] = time.perf_counter() - t0

        # 5. token advantages. Group ids are local to this rank (0..B-1): a group never spans
        # ranks. Under DDP the inputs go to this rank's device, which the collective backend
        # needs (NCCL reduces CUDA tensors only); batch statistics are then global.
        dev = self.device if self.ranks.group is not None else torch.device("cpu")

        def on_dev(x):
            return x.to(dev) if x is not None else None

        gen = torch.Generator().manual_seed(self.seed * 7919 + self.iteration)
        out = self.method(
            CreditInputs(
                rewards=on_dev(scored.rewards),
                group=on_dev(roll.group),
                mask=on_dev(roll.response_mask),
                step=self.iteration,
                q=on_dev(scored.q),
                replayed=on_dev(scored.replayed),
                process_group=self.ranks.group,
                generator=gen,
                teacher=teacher_scores,
            )
        )
        scored.advantages, scored.stats = out.advantages.cpu(), dict(out.stats)
        if self.ranks.any(not bool(torch.isfinite(scored.advantages).all())):
            return self._skip_nonfinite("advantages", scored)

        # 6. updates
        t0 = time.perf_counter()
        upd = self._update(scored)
        times["update"] = time.perf_counter() - t0
        if upd is None:
            return self._skip_nonfinite("loss", scored)
        upd.update(rollout_stats)

        self.iteration += 1
        self.last = scored
        times["step"] = time.perf_counter() - t_step + times.get("rollout", 0.0)
        self._log_step(scored, upd, replay_stats)
        return None

    # ---- pieces of the step --------------------------------------------------------------
    def score(self, batch: PromptBatch) -> ScoredBatch:
        roll = batch.rollout
        if roll is None:
            raise RuntimeError("no rollout on the batch: is the RolloutCallback in callbacks?")
        scores = score_batch(self.task, roll.examples, roll.texts, self.fault_tracker)
        names = tuple(self.task.reward_names)
        return ScoredBatch(
            rollout=roll, scores=scores, reward_names=names, rewards=rewards_tensor(scores, names)
        )

    def has_info(self, scored: ScoredBatch) -> torch.Tensor:
        """[N, K] bool: which present rewards have verifier information for replay."""
        if self.task.info_in_prompt:
            out = torch.ones(scored.rewards.shape, dtype=torch.bool)
        else:
            out = torch.tensor(
                [[s.blocks.get(k) is not None for k in scored.reward_names] for s in scored.scores],
                dtype=torch.bool,
            ).reshape(scored.rewards.shape)
        return out & ~scored.rewards.isnan()

    @torch.no_grad()
    def _logprobs(self, model, roll, micro: int) -> torch.Tensor:
        """log-probs of the sampled tokens under ``model`` at the sampling temperature."""
        out = []
        # Several ranks: as many forwards as the busiest, agreed before the first one.
        idle = self._idle_forwards(model, -(-roll.n // micro))
        for s in range(0, roll.n, micro):
            idx = torch.arange(s, min(roll.n, s + micro))
            sub = roll.select(idx)
            out.append(
                response_logprobs(
                    model,
                    sub.prompt_ids,
                    sub.prompt_mask,
                    sub.response_ids,
                    sub.response_mask,
                    temperature=roll.temperature,
                ).cpu()
            )
        for _ in range(idle):
            self._idle_logprobs(model, roll.temperature)
        if not out:  # a sharded rank with no rows left to score
            return torch.zeros((0, roll.response_ids.shape[1]), dtype=torch.float32)
        return torch.cat(out)

    def _old_logprobs(self, roll, res, micro: int) -> torch.Tensor:
        """log pi_old of the sampled tokens (at the sampling temperature), reusing replay's
        P_all pass where P_all is P0 (replay tempers its distributions alike)."""
        self.policy.eval()
        try:
            if res is None or res.logp is None or not bool(res.logp_rows.any()):
                return self._logprobs(self.policy, roll, micro)
            old = res.logp.clone() * roll.response_mask
            rest = (~res.logp_rows).nonzero().flatten()
            # several ranks: every rank takes part in the forwards, with rows to score or not
            if len(rest) or self.ranks.world_size > 1:
                old[rest] = self._logprobs(self.policy, roll.select(rest), micro)
            return old
        finally:
            self.policy.train()

    def reference_logprobs(self, roll, micro: int) -> torch.Tensor:
        """log pi_ref of the sampled tokens: the frozen initial policy, which under LoRA is
        the policy with its adapters switched off."""
        if self.ref_policy is not None:
            return self._logprobs(self.ref_policy, roll, micro)
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                return self._logprobs(self.policy, roll, micro)
        finally:
            self.policy.train()

    def _replay(self, scored: ScoredBatch, pairs: torch.Tensor):
        """Run replay; on out-of-memory halve ``replayer.token_budget`` and try again.

        The smaller budget is kept for the rest of the run (the next batch would fail the
        same way). Replay runs no collectives, so a retry on one rank alone is safe; under
        sharding every forward is a collective and a rank cannot retry alone: no retry.
        """
        retries = 0 if is_sharded(self.policy) else int(self.rl.replay_oom_retries)
        for attempt in range(retries + 1):
            failed = None
            try:
                return self.replayer.run(
                    self.policy, self.task, scored, pairs, self.method.relevance
                )
            except OOM_ERRORS as exc:
                failed = f"{type(exc).__name__}: {str(exc)[:200]}"
            # Outside the except block, so the failed forward's tensors can be freed.
            _free_accelerator_memory()
            old = int(self.replayer.token_budget)
            if attempt == retries or old <= 1:
                raise RuntimeError(
                    f"replay ran out of memory {attempt + 1} time(s), down to "
                    f"replay.token_budget={old} ({failed}); lower rollout.sampling."
                    "max_new_tokens or rl.prompts_per_step, or raise rl.replay_oom_retries"
                )
            self.replayer.token_budget = max(1, old // 2)
            self.fault_tracker.count("replay_oom_retries")
            log.warning(
                "replay ran out of memory at step %d (%s); retrying with replay.token_budget=%d "
                "(set it in the config to avoid the retry)",
                self.iteration,
                failed,
                self.replayer.token_budget,
            )
        raise AssertionError("unreachable")

    def _update(self, scored: ScoredBatch) -> dict[str, float] | None:
        """Clipped-surrogate updates: ``rl.ppo_epochs`` passes over shuffled mini-batches, each
        one optimizer update accumulated over micro-batches.

        Returns the step's update metrics: ``loss`` is the mean over updates of each update's
        (mini-batch) loss; the per-token statistics (``clip_frac``, ``ratio_mean``, ``kl``,
        ...) are means over every valid token of every update. ``lr`` is the learning rate of
        this step's updates; it changes once per RL step (``optim.warmup_steps`` counts RL
        steps, like ``method.beta_warmup_steps`` and ``trainer.max_steps``).
        """
        rl, roll = self.rl, scored.rollout
        opt = self.optimizers()
        sched = self.lr_schedulers()
        n = roll.n
        # Several ranks: loop over the busiest rank's rows (one collective); a rank out of rows
        # runs idle forward+backward passes so every gradient all-reduce / reduce-scatter has
        # all ranks.
        rows = self.ranks.max(n) if self.ranks.world_size > 1 else n
        mini = max(1, min(int(rl.mini_batch_size), rows))
        micro = max(1, min(int(rl.micro_batch_size), mini))
        world = self.ranks.world_size
        tau = roll.temperature
        g = torch.Generator().manual_seed(self.seed * 104729 + self.iteration)
        losses: list[float] = []  # one per update
        sums: dict[str, float] = {}  # token-weighted sums of the per-token statistics
        tokens = 0.0
        n_updates = int(rl.ppo_epochs) * ((rows + mini - 1) // mini)
        lr = float(sched.get_last_lr()[0])
        u = 0
        for _ in range(int(rl.ppo_epochs)):
            perm = torch.randperm(n, generator=g)
            for s in range(0, rows, mini):
                u += 1
                mb = perm[s : s + mini]
                if rl.loss_agg == "token-mean":
                    local = roll.response_mask[mb].sum().float()
                else:
                    local = torch.tensor(float(len(mb)))
                # Normalize by the global mini-batch; DDP averages gradients over ranks.
                denom = (
                    float(self.ranks.all_reduce_sum(local.to(self.device)).clamp_min(1.0)) / world
                )
                opt.zero_grad(set_to_none=True)
                update_loss = 0.0
                for ms in range(0, min(mini, rows - s), micro):
                    idx = mb[ms : ms + micro]
                    if len(idx) == 0:  # out of rows (several ranks): an idle pass, loss 0
                        if not self._idle_backward(tau):
                            opt.zero_grad(set_to_none=True)
                            return None
                        continue
                    sub = roll.select(idx)
                    logp, logits = self._policy_logprobs(sub, tau)
                    dev = logp.device
                    loss, st = policy_loss(
                        logp,
                        # one update per step: the sampling policy is the current one
                        logp.detach() if scored.old_logp is None else scored.old_logp[idx].to(dev),
                        scored.advantages[idx].to(dev),
                        sub.response_mask.to(dev),
                        rl.clip_low,
                        rl.clip_high,
                        rl.loss_agg,
                        denom,
                        scored.ref_logp[idx].to(dev) if scored.ref_logp is not None else None,
                        rl.kl_coef,
                        scored.tis_weights[idx].to(dev) if scored.tis_weights is not None else None,
                    )
                    if logits is not None:  # the method's own term (method.teacher.full)
                        extra, extra_st = self._token_loss(logits, sub, tau, rl.loss_agg, denom)
                        loss, st = loss + extra, {**st, **extra_st}
                    del logits
                    # Decided jointly: a rank that skipped backward would leave the others
                    # waiting in DDP's gradient all-reduce.
                    if self.ranks.any(not bool(torch.isfinite(loss))):
                        opt.zero_grad(set_to_none=True)
                        return None
                    self.manual_backward(loss)
                    # micro-batch losses share the mini-batch's normalizer: they add up to it
                    update_loss += float(loss.detach())
                    w = float(sub.response_mask.sum())
                    tokens += w
                    for k, v in st.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * w
                losses.append(update_loss)
                if rl.max_grad_norm:
                    self.clip_gradients(
                        opt, gradient_clip_val=rl.max_grad_norm, gradient_clip_algorithm="norm"
                    )
                self._optimizer_step(opt, counted=(u == n_updates))
                # NaN/inf weights or moments must stop here, not reach a checkpoint. Under
                # DDP every rank holds the same values, so every rank raises alike.
                self._assert_finite(opt)
        sched.step()  # once per RL step: the warm-up counts RL steps
        out = {k: v / max(tokens, 1.0) for k, v in sums.items()}
        out["loss"] = sum(losses) / max(len(losses), 1)
        out["lr"] = lr
        return out

    # ---- lockstep over ranks (trainer=fsdp, trainer=ddp) ---------------------------------
    # Every forward of a sharded policy all-gathers its weights and every backward
    # reduce-scatters (DDP: all-reduces) its gradients, with all ranks. A loop whose work
    # differs between ranks agrees on the busiest rank's count first (one collective, before
    # its first forward) and pads with the cheapest batch there is: one row, one token; its
    # result is discarded. DDP runs the same counts (its forwards are local, so this costs a
    # rank only time it would spend waiting at the next all-reduce) and the same numbers.
    def _idle_forwards(self, model, count: int) -> int:
        """How many idle forwards this rank adds to its ``count`` (0 in one process)."""
        if self.ranks.world_size == 1:
            return 0
        return self.ranks.max(count) - count

    def _idle_logprobs(self, model, temperature: float) -> None:
        response_logprobs(model, *dummy_batch(self.tokenizer.pad_token_id), temperature=temperature)

    def _idle_backward(self, temperature: float) -> bool:
        """An update micro-batch without rows: forward, the joint finiteness check and a
        backward of 0 x the log-probs (zero gradients). False when another rank's loss was
        not finite (the update stops on every rank)."""
        logp = response_logprobs(
            self.policy, *dummy_batch(self.tokenizer.pad_token_id), temperature=temperature
        )
        if self.ranks.any(False):
            return False
        self.manual_backward(logp.sum() * 0.0)
        return True

    def _assert_finite(self, opt) -> None:
        """``assert_finite_state``; sharded, each rank checks its shards and all raise together."""
        if not is_sharded(self.policy):
            assert_finite_state(self.policy, opt)
            return
        err = None
        try:
            assert_finite_state(self.policy, opt)
        except NonFiniteStateError as exc:
            err = exc
        if self.ranks.any(err is not None):
            raise err or NonFiniteStateError(
                "non-finite training state on another rank (its log names the tensor); lower "
                "optim.lr or rl.max_grad_norm, and resume from the last checkpoint"
            )

    @staticmethod
    def _optimizer_step(opt, counted: bool) -> None:
        """Step through Lightning's optimizer wrapper (precision, strategy), but let only the
        last update of an RL step advance ``global_step``: ``trainer.max_steps`` and
        checkpoint intervals then count RL steps, whatever ppo_epochs and mini-batches are."""
        if counted:
            opt.step()
            return
        before, after = opt._on_before_step, opt._on_after_step
        opt._on_before_step = opt._on_after_step = lambda: None
        try:
            opt.step()
        finally:
            opt._on_before_step, opt._on_after_step = before, after

    # ---- a method's frozen teacher ---------------------------------------------------------
    def frozen_teacher(self, token_budget: int) -> Teacher:
        """A frozen teacher holding the policy's weights as they are now (the initial ones when
        the module is built): the KL reference where there is one, the base with adapters off
        under LoRA, else a copy kept outside the module (not checkpointed: it is
        model.name_or_path's weights)."""
        frozen = self.ref_policy
        if frozen is None and not is_lora(self.policy):
            frozen = copy.deepcopy(self.policy).eval().requires_grad_(False)
        return Teacher(
            frozen if frozen is not None else self.policy,
            self.tokenizer,
            adapters_off=frozen is None,
            token_budget=token_budget,
        )

    def _policy_logprobs(self, sub, tau: float):
        """(log-probs of the sampled tokens [n, T], the logits [n, T, V] when the method adds
        a token loss over them, else None), with gradient."""
        if self.method.teacher is None or not self.method.teacher.full:
            logp = response_logprobs(
                self.policy,
                sub.prompt_ids,
                sub.prompt_mask,
                sub.response_ids,
                sub.response_mask,
                temperature=tau,
            )
            return logp, None
        logits = response_logits(
            self.policy, sub.prompt_ids, sub.prompt_mask, sub.response_ids, sub.response_mask
        )
        ids = sub.response_ids.to(logits.device)
        logp = token_logprobs(logits, ids, temperature=tau) * sub.response_mask.to(logits.device)
        return logp, logits

    def _token_loss(self, logits, sub, tau: float, agg: str, denom: float):
        """The method's loss term on one micro-batch, against the frozen teacher's
        distributions (rows without a teacher context are left out)."""
        teacher_logits, rows = self.teacher.logits(self.task, sub, device=self.device)
        mask = sub.response_mask.to(logits.device) & rows.to(logits.device)[:, None]
        return self.method.token_loss(
            logits, teacher_logits, sub.response_ids, mask, tau, agg, denom
        )

    # ---- faults ------------------------------------------------------------------------
    def _skip_nonfinite(self, what: str, scored: ScoredBatch | None = None):
        """Skip this step's update (every rank does, the decision being joint).

        The step still counts: ``iteration`` and ``global_step`` advance, so the data stream,
        the β schedule, ``trainer.max_steps`` and the metrics' step column stay aligned.
        """
        ids = []
        if scored is not None:
            bad = ~torch.isfinite(scored.rewards).all(-1)
            if what != "rewards" and scored.advantages is not None:
                bad = bad | ~torch.isfinite(scored.advantages).all(-1)
            ids = [scored.rollout.examples[i].id for i in bad.nonzero().flatten().tolist()[:5]]
        self.fault_tracker.nonfinite(what, self.iteration, ids)
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        # Count the step without an optimizer update (Lightning's manual-optimization hooks).
        opt._on_before_step()
        opt._on_after_step()
        # The learning-rate warm-up counts RL steps, like β's: a skipped step counts for both.
        self.lr_schedulers().step()
        self.iteration += 1
        self.last = None
        self.log_dict(
            {
                "train/nonfinite_skips": float(self.nonfinite_steps),
                "train/skipped": 1.0,
                "train/iteration": float(self.iteration),
                "train/beta": float(self.method.beta(self.iteration - 1)),
                "train/scoring_errors": float(self.fault_tracker.step_scoring_errors),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        return None

    # ---- logging -----------------------------------------------------------------------
    def _log_step(self, scored: ScoredBatch, upd: dict[str, float], replay_stats) -> None:
        m, weights = step_metrics.assemble(
            scored,
            upd,
            replay_stats,
            self.timings,
            self.faults,
            success_check=self.task.success_check,
            beta=self.method.beta(self.iteration - 1),
            iteration=self.iteration,
            nonfinite_skips=self.nonfinite_steps,
            scoring_errors=self.fault_tracker.step_scoring_errors,
        )
        m = self._absent_as_nan(step_metrics.combine(m, weights, self.ranks, self.faults))
        # Every rank logs the same (already global) values: no sync_dist collectives, whose
        # order would have to match across ranks key by key.
        n = scored.rollout.n
        self.log_dict(
            {f"train/{k}": v for k, v in m.items()}, on_step=True, on_epoch=False, batch_size=n
        )
        prog = {"reward": m["reward/total/mean"]}
        if "success" in m:
            prog["success"] = m["success"]
        self.log_dict(prog, prog_bar=True, logger=False, on_step=True, batch_size=n)

    # ---- validation --------------------------------------------------------------------
    def validation_step(self, batch: PromptBatch, batch_idx: int):
        # Scored once per epoch, with the same scorer as `src/eval.py`.
        self._val_rows.append((batch.index, batch.rollout.examples, batch.rollout.texts))

    def on_validation_epoch_start(self) -> None:
        self._val_rows = []

    def on_validation_epoch_end(self) -> None:
        rows = self._val_rows
        pg = self.ranks.group
        if pg is not None:
            # Each rank generated for its shard; the sampler pads shards by repeating batches,
            # so gather, keep one copy per batch, score once (rank 0) and share the metrics.
            unique = {idx: (ex, tx) for part in self.ranks.gather(rows) for idx, ex, tx in part}
            rows = [(i, *unique[i]) for i in sorted(unique)]
        metrics: dict[str, float] = {}
        if rows and self.ranks.rank == 0:
            from mrtpo.evaluation import evaluate_examples

            exs = [e for _, ex, _ in rows for e in ex]
            texts = [t for _, _, ts in rows for t in ts]
            raw, _ = evaluate_examples(self.task, exs, texts)
            metrics = {
                f"val/{self.task.name}/{k}": float(v)
                for k, v in raw.items()
                if isinstance(v, (int, float)) and not math.isnan(float(v))
            }
        metrics = self.ranks.broadcast(metrics)
        if metrics:
            # identical on every rank (broadcast above): the sync only keeps Lightning quiet
            self.log_dict(metrics, sync_dist=pg is not None)

    # ---- checkpoints -------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with the run that resumes it."""
        return {
            "task": self.task.name,
            "method": getattr(self.method, "config_name", "") or type(self.method).__name__,
            "reward_names": list(self.task.reward_names),
        }

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        state = super().state_dict(
            *args, destination=destination, prefix=prefix, keep_vars=keep_vars
        )
        if self._checkpoint_keys is not None:
            for key in [k for k in state if k[len(prefix) :] not in self._checkpoint_keys]:
                del state[key]  # in place: a wrapper may have passed its own destination
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self._checkpoint_keys is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        missing = sorted(self._checkpoint_keys - set(state_dict))
        unexpected = sorted(set(state_dict) - self._checkpoint_keys)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"the checkpoint does not hold this run's LoRA adapters: {len(missing)} missing "
                f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]}); "
                "resume with the original run's model.lora settings"
            )
        # the frozen base weights are the ones loaded from model.name_or_path
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["mrtpo"] = {
            "iteration": self.iteration,
            **self.fault_tracker.state(),
            "replay_token_budget": int(self.replayer.token_budget),
            **self.identity(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("mrtpo", {})
        mine = self.identity()
        for key in ("task", "method", "reward_names"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"the checkpoint was trained with {key}={state[key]!r} but this run has "
                    f"{key}={mine[key]!r}; resume with the original run's task= and method= "
                    "overrides (see .hydra/overrides.yaml in its run folder)"
                )
        self.iteration = int(state.get("iteration", 0))
        self.fault_tracker.load(state)
        # Keep a budget that replay had to lower after running out of memory.
        budget = state.get("replay_token_budget")
        if budget is not None and int(budget) < int(self.replayer.token_budget):
            self.replayer.token_budget = int(budget)

    # ---- sharding ----------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under ``trainer=fsdp``: ``fully_shard`` the policy (and a reference copy) per decoder
        layer, then the root (``mrtpo.sharding``); a no-op under any other strategy."""
        from mrtpo.sharding import shard_module_policies

        shard_module_policies(self)
