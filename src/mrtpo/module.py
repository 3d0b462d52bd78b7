"""PolicyModule: one multi-reward RL step, top to bottom.

1. the rollout callback has sampled G responses for each of the B prompts (``batch.rollout``);
2. the task scores every response: K named rewards and verifier blocks (``mrtpo.scoring``);
3. if the method asks for relevance, replay scores each requested (response, reward) pair's
   tokens under the parameters that sampled them, as the method's ``RelevanceRequest`` says;
4. old-policy log-probs of the sampled tokens (no grad, sampling prompt P0), when more than
   one update follows (reused from replay's P_all pass where P_all is P0); with one update,
   the engine-trainer gap is measured from the update's own forward instead;
5. the method turns rewards (+ relevance) into token advantages [N, T];
6. clipped-surrogate updates over mini-batches (PPO epochs, micro-batch accumulation);
7. the rollout callback syncs the new weights into the engine.

The module never looks at a method's, task's or engine's name, nor inside the relevance
request it forwards. Fault bookkeeping lives in ``mrtpo.faults``, the step's metrics and
their reduction over ranks in ``mrtpo.step_metrics``, the collectives in
``mrtpo.distributed``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

from mrtpo import step_metrics
from mrtpo.batch import PromptBatch, ScoredBatch, rewards_tensor
from mrtpo.checkpointing import NonFiniteStateError, assert_finite_state
from mrtpo.credit.methods import AdvantageMethod, CreditInputs, MethodServices, StepView
from mrtpo.distributed import Ranks
from mrtpo.evaluation import evaluate_examples
from mrtpo.faults import FaultTracker
from mrtpo.forward import response_logits, response_logprobs
from mrtpo.lora import checkpoint_keys, is_lora
from mrtpo.loss import EngineGap, engine_gap, policy_loss, token_logprobs
from mrtpo.replay import Replayer, ReplayResult
from mrtpo.scoring import score_batch
from mrtpo.settings import OptimConfig, ReplayConfig, RLConfig
from mrtpo.sharding import dummy_batch, is_sharded, shard_module_policies
from mrtpo.tasks.base import Task

log = logging.getLogger(__name__)

OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)

#: The step's random streams (``_step_generator``): a generator seeded ``seed * stream +
#: iteration`` per stream, so the shuffle ablation's draws and the mini-batch order do not
#: depend on each other (two primes; changing one changes every run's numbers).
SHUFFLE_STREAM = 7919
MINIBATCH_STREAM = 104729


@dataclass
class Relevance:
    """Step 3's result: replay's output (None when nothing was replayed) and its metrics."""

    result: ReplayResult | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class OldPolicy:
    """Step 4's result: what the updates compare against (None: not needed this step)."""

    logp: torch.Tensor | None = None  # [N, T] pi_old, when more than one update follows
    tis: torch.Tensor | None = None  # [N, T] truncated importance weights (rl.tis_cap)
    ref_logp: torch.Tensor | None = None  # [N, T] the KL reference's (rl.kl_coef > 0)
    extra: Any = None  # the method's own no-grad inputs (``score_inputs``)
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # the engine gap
    # the engine gap (and TIS weights) to take from the update's own forward, when that
    # forward is pi_old's: one update per step (``PolicyModule.gap_in_update``)
    gap: EngineGap | None = None


@dataclass
class _UpdateTotals:
    """Running totals over one step's updates: ``_update``'s metrics."""

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


class _Once:
    """A value computed on first call and kept (pi_old's log-probs, wanted by several users)."""

    def __init__(self, make: Callable[[], torch.Tensor]) -> None:
        self._make, self._value = make, None

    def __call__(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._make()
        return self._value

    @property
    def made(self) -> bool:
        return self._value is not None


def dropout_in(model: torch.nn.Module) -> str | None:
    """The first randomness of ``model`` in train mode only: a dropout layer, or a non-zero
    ``*dropout*`` (or router ``*jitter*``) rate of a Hugging Face config, which the model
    applies in train mode only; named. None if there is none."""
    configs = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.modules.dropout._DropoutNd) and mod.p > 0:
            return f"{name or type(mod).__name__} (p={mod.p})"
        cfg = getattr(mod, "config", None)
        if callable(getattr(cfg, "to_dict", None)):
            configs[id(cfg)] = cfg
    for cfg in configs.values():
        for key, v in cfg.to_dict().items():
            if (
                ("dropout" in key or "jitter" in key)
                and isinstance(v, (int, float))
                and not isinstance(v, bool)
                and v > 0
            ):
                return f"{key}={v}"
    return None


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
        self._no_dropout: bool | None = None  # dropout_in(policy) is None; known on first use
        self._unwritten: dict[str, torch.Tensor] | None = None  # the step's, for the loggers
        self._val_rows: list = []
        method.bind(self.method_services())

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
        with self._timed("reward"):
            scored = self.score(batch)  # 2
        roll = scored.rollout
        self.fault_tracker.check_scoring(scored.scores, roll.examples, self.iteration, self.ranks)
        # NaN means "does not apply"; +-inf is a broken reward: skip rather than train on it.
        if self.ranks.any(bool(torch.isinf(scored.rewards).any())):
            return self._skip_nonfinite("rewards", scored)
        with self._timed("replay"):
            rel = self.relevance(scored)  # 3
        with self._timed("old_logp"):
            old = self.old_policy(roll, rel.result)  # 4
        scored.old_logp, scored.tis_weights, scored.ref_logp = old.logp, old.tis, old.ref_logp
        scored.advantages, scored.stats = self.advantages(scored, old.extra)  # 5
        if self.ranks.any(not bool(torch.isfinite(scored.advantages).all())):
            return self._skip_nonfinite("advantages", scored)
        if old.gap is not None and old.gap.tis_cap is not None:  # filled by the update
            scored.tis_weights = torch.zeros(roll.response_ids.shape, dtype=torch.float32)
        with self._timed("update"):
            upd = self._update(scored, old.gap)  # 6
        if upd is None:
            return self._skip_nonfinite("loss", scored)
        if old.gap is not None:
            old.rollout_metrics = old.gap.metrics()
        self.iteration += 1
        self.last = scored
        self.timings["step"] = time.perf_counter() - t_step + self.timings.get("rollout", 0.0)
        self._log_step(scored, {**upd, **old.rollout_metrics}, rel.metrics)
        return None

    @contextlib.contextmanager
    def _timed(self, phase: str):
        """Time one phase of the step into ``timings`` (logged as ``train/time/<phase>``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = time.perf_counter() - t0

    def _step_generator(self, stream: int) -> torch.Generator:
        """A generator seeded by the run's seed, this step and one of the step's streams: the
        same on every rank, and the same again when the step is rerun after a resume."""
        return torch.Generator().manual_seed(self.seed * stream + self.iteration)

    def relevance(self, scored: ScoredBatch) -> Relevance:
        """3. Replay, before any parameter update of this step, as the method's request says.
        At beta = 0 (e.g. the first step of a warm-up) relevance cannot change the
        advantages, so it is skipped."""
        if self.method.relevance is None or not self.method.beta(self.iteration) > 0:
            return Relevance()
        roll = scored.rollout
        pairs = self.method.replay_pairs(scored.rewards, roll.group, self.has_info(scored))
        res = self._replay(scored, pairs)
        scored.q, scored.replayed = res.q, res.replayed
        return Relevance(res, {f"replay/{k}": v for k, v in res.metrics.items()})

    def old_policy(self, roll, res) -> OldPolicy:
        """4. What the updates compare against, under P0 at the sampling temperature.

        pi_old's log-probs when more than one update follows (with one they equal the current
        policy's, so the ratio does not need them), reused from replay's P_all pass where that
        is the sampling prompt. Then the KL reference's, and the method's own no-grad inputs
        (``score_inputs``). Where the engine reported its own log-probs, the engine-trainer
        gap (and, with rl.tis_cap, the weights that correct for it) is measured against pi_old:
        from these log-probs when they exist, else from the update's own forward
        (``gap_in_update``), else (a policy with dropout) by a pass of its own.
        """
        rl, micro = self.rl, int(self.rl.micro_batch_size)
        several = int(rl.ppo_epochs) * -(-roll.n // max(1, int(rl.mini_batch_size))) > 1
        gap = roll.engine_logp is not None and (
            several or rl.tis_cap is not None or rl.measure_logp_gap
        )
        if rl.tis_cap is not None and roll.engine_logp is None:  # refused at start-up, unless
            raise RuntimeError(  # the engine's class claims log-probs it did not deliver
                f"rl.tis_cap={rl.tis_cap} needs the engine's log-probs of the sampled tokens and "
                "the engine returned none; set reports_logprobs = False on its class"
            )
        logp = _Once(lambda: self._old_logprobs(roll, res, micro))
        out = OldPolicy(logp=logp() if several else None)
        if rl.kl_coef > 0:
            out.ref_logp = self.reference_logprobs(roll, micro)
        out.extra = self.method.score_inputs(StepView(roll, logp, self.device))
        if gap and self.gap_in_update(several, logp.made):
            out.gap = EngineGap(rl.tis_cap)
        elif gap:
            out.rollout_metrics, out.tis = engine_gap(
                logp(), roll.engine_logp, roll.response_mask, rl.tis_cap
            )
        return out

    def gap_in_update(self, several: bool, made: bool) -> bool:
        """Whether the update's own forward gives pi_old's log-probs for the engine gap: one
        update per step (``several`` false), pi_old's not already computed (``made``: the
        method's ``score_inputs`` wanted them) and a policy without dropout (train mode then
        computes what eval mode does). Decided jointly: under FSDP the old-policy pass is a
        collective every rank must run or skip alike."""
        if self._no_dropout is None:
            found = dropout_in(self.policy)
            self._no_dropout = found is None
            if found is not None:
                log.info(
                    "the policy is random in train mode (%s): the engine-trainer gap costs a "
                    "forward of its own in eval mode (rl.measure_logp_gap=false skips it when "
                    "rl.tis_cap is null)",
                    found,
                )
        own = not several and not made and self._no_dropout
        return not self.ranks.any(not own)

    def advantages(self, scored: ScoredBatch, extra) -> tuple[torch.Tensor, dict[str, float]]:
        """5. Token advantages [N, T] and the method's statistics. Group ids are local to this
        rank (0..B-1): a group never spans ranks. Under DDP the inputs go to this rank's
        device, which the collective backend needs (NCCL reduces CUDA tensors only); batch
        statistics are then global."""
        dev = self.device if self.ranks.group is not None else torch.device("cpu")

        def on_dev(x):
            return x.to(dev) if x is not None else None

        roll = scored.rollout
        out = self.method(
            CreditInputs(
                rewards=on_dev(scored.rewards),
                group=on_dev(roll.group),
                mask=on_dev(roll.response_mask),
                step=self.iteration,
                q=on_dev(scored.q),
                replayed=on_dev(scored.replayed),
                process_group=self.ranks.group,
                generator=self._step_generator(SHUFFLE_STREAM),
                extra=extra,
            )
        )
        return out.advantages.cpu(), dict(out.stats)

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
                    shared_prompt=self.rl.shared_prompt_forward,
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

    def _update(self, scored: ScoredBatch, gap: EngineGap | None = None) -> dict[str, float] | None:
        """6. Clipped-surrogate updates: ``rl.ppo_epochs`` passes over shuffled mini-batches,
        each one optimizer update accumulated over micro-batches.

        Returns the step's update metrics: ``loss`` is the mean over updates of each update's
        (mini-batch) loss; the per-token statistics (``clip_frac``, ``ratio_mean``, ``kl``,
        ...) are means over every valid token of every update. ``lr`` is the learning rate of
        this step's updates; it changes once per RL step (``optim.warmup_steps`` counts RL
        steps, like ``method.beta_warmup_steps`` and ``trainer.max_steps``). None when a loss
        was not finite (on any rank). ``gap``: the engine gap, measured on the way (one update).
        """
        rl, n = self.rl, scored.rollout.n
        opt, sched = self.optimizers(), self.lr_schedulers()
        # Several ranks: loop over the busiest rank's rows (one collective); a rank out of rows
        # runs idle forward+backward passes so every gradient all-reduce / reduce-scatter has
        # all ranks.
        rows = self.ranks.max(n) if self.ranks.world_size > 1 else n
        mini = max(1, min(int(rl.mini_batch_size), rows))
        micro = max(1, min(int(rl.micro_batch_size), mini))
        g = self._step_generator(MINIBATCH_STREAM)
        acc = _UpdateTotals(lr=float(sched.get_last_lr()[0]))
        n_updates, u = int(rl.ppo_epochs) * ((rows + mini - 1) // mini), 0
        for _ in range(int(rl.ppo_epochs)):
            perm = torch.randperm(n, generator=g)
            # Each mini-batch's rows in order: a group's rows that meet in it land in the same
            # micro-batches, where the forward runs their prompt once (rl.shared_prompt_forward).
            # The update's gradient sums its micro-batches, so only fp rounding changes.
            for s in range(0, rows, mini):
                u += 1
                if not self._accumulate(
                    scored, perm[s : s + mini].sort().values, min(mini, rows - s), micro, acc, gap
                ):
                    return None
                if rl.max_grad_norm:
                    self.clip_gradients(
                        opt, gradient_clip_val=rl.max_grad_norm, gradient_clip_algorithm="norm"
                    )
                self._optimizer_step(opt, counted=(u == n_updates))
                # NaN/inf weights or moments must stop here, not reach a checkpoint. Under
                # DDP every rank holds the same values, so every rank raises alike.
                self._assert_finite(opt)
        sched.step()  # once per RL step: the warm-up counts RL steps
        return acc.metrics()

    def _accumulate(
        self, scored, mb, width: int, micro: int, acc: _UpdateTotals, gap: EngineGap | None
    ) -> bool:
        """One optimizer update's gradients: micro-batches of ``mb`` (``width`` rows on the
        busiest rank), backward each. False when a loss was not finite on some rank."""
        opt = self.optimizers()
        denom = self._normalizer(scored.rollout, mb)
        opt.zero_grad(set_to_none=True)
        update_loss = 0.0
        for ms in range(0, width, micro):
            idx = mb[ms : ms + micro]
            if len(idx) == 0:  # out of rows (several ranks): an idle pass, loss 0
                if not self._idle_backward(scored.rollout.temperature):
                    opt.zero_grad(set_to_none=True)
                    return False
                continue
            loss, stats, tokens = self._micro_loss(scored, idx, denom, gap)
            # Decided jointly: a rank that skipped backward would leave the others waiting in
            # DDP's gradient all-reduce.
            if self.ranks.any(not bool(torch.isfinite(loss))):
                opt.zero_grad(set_to_none=True)
                return False
            self.manual_backward(loss)
            # micro-batch losses share the mini-batch's normalizer: they add up to it
            update_loss += float(loss.detach())
            acc.add(stats, tokens)
        acc.losses.append(update_loss)
        return True

    def _normalizer(self, roll, mb) -> float:
        """The loss normalizer of the global mini-batch (tokens, or responses for
        seq-mean-token-mean), per rank: DDP averages gradients over ranks."""
        if self.rl.loss_agg == "token-mean":
            local = roll.response_mask[mb].sum().float()
        else:
            local = torch.tensor(float(len(mb)))
        total = self.ranks.all_reduce_sum(local.to(self.device)).clamp_min(1.0)
        return float(total) / self.ranks.world_size

    def _micro_loss(self, scored: ScoredBatch, idx, denom: float, gap: EngineGap | None = None):
        """(loss, per-token statistics, valid tokens) of one micro-batch: the surrogate, plus
        the method's own term (``token_loss``) where it has one. With ``gap`` (one update per
        step) this forward is pi_old's: it measures the engine gap and makes the TIS weights."""
        rl, sub = self.rl, scored.rollout.select(idx)
        tau = sub.temperature
        logp, logits = self._policy_logprobs(sub, tau)
        dev = logp.device

        def rows(x):
            return None if x is None else x[idx].to(dev)

        tis = rows(scored.tis_weights)
        if gap is not None:
            tis = gap.add(logp.detach(), sub.engine_logp, sub.response_mask.to(dev))
            if tis is not None:  # kept for callbacks, as the old-policy pass keeps them
                scored.tis_weights[idx] = tis.cpu()

        loss, stats = policy_loss(
            logp=logp,
            # one update per step: the sampling policy is the current one
            old_logp=logp.detach() if scored.old_logp is None else rows(scored.old_logp),
            advantages=rows(scored.advantages),
            mask=sub.response_mask.to(dev),
            clip_low=rl.clip_low,
            clip_high=rl.clip_high,
            agg=rl.loss_agg,
            denom=denom,
            ref_logp=rows(scored.ref_logp),
            kl_coef=rl.kl_coef,
            tis_weights=tis,
        )
        extra = self.method.token_loss(logits, sub, tau, rl.loss_agg, denom, device=self.device)
        if extra is not None:
            loss, stats = loss + extra[0], {**stats, **extra[1]}
        return loss, stats, float(sub.response_mask.sum())

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

    # ---- what a method may use -------------------------------------------------------------
    def method_services(self) -> MethodServices:
        """What ``AdvantageMethod.bind`` lends a method: the task, the tokenizer, replay's
        forward sizes and a frozen copy of the policy as it is now (the initial weights when
        the module is built), made on first use."""
        made: list[tuple[torch.nn.Module, bool]] = []

        def frozen_policy() -> tuple[torch.nn.Module, bool]:
            if not made:
                made.append(self._frozen_policy())
            return made[0]

        return MethodServices(
            task=self.task,
            tokenizer=self.tokenizer,
            frozen_policy=frozen_policy,
            token_budget=int(self.replayer.token_budget),
            chunk=int(self.replayer.jsd_chunk),
            shared_prompt=self.rl.shared_prompt_forward,
        )

    def _frozen_policy(self) -> tuple[torch.nn.Module, bool]:
        """(frozen model, adapters_off): the KL reference where there is one, the policy itself
        with adapters off under LoRA, else a copy kept outside the module (not checkpointed:
        it is model.name_or_path's weights)."""
        if self.ref_policy is not None:
            return self.ref_policy, False
        if is_lora(self.policy):
            return self.policy, True
        return copy.deepcopy(self.policy).eval().requires_grad_(False), False

    def _policy_logprobs(self, sub, tau: float):
        """(log-probs of the sampled tokens [n, T], the logits [n, T, V] when the method's
        token loss reads them, else None), with gradient."""
        if not self.method.wants_logits:
            logp = response_logprobs(
                self.policy,
                sub.prompt_ids,
                sub.prompt_mask,
                sub.response_ids,
                sub.response_mask,
                temperature=tau,
                shared_prompt=self.rl.shared_prompt_forward,
            )
            return logp, None
        logits = response_logits(
            self.policy,
            sub.prompt_ids,
            sub.prompt_mask,
            sub.response_ids,
            sub.response_mask,
            shared_prompt=self.rl.shared_prompt_forward,
        )
        ids = sub.response_ids.to(logits.device)
        logp = token_logprobs(logits, ids, temperature=tau) * sub.response_mask.to(logits.device)
        return logp, logits

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
        self._publish(
            {
                "train/nonfinite_skips": float(self.nonfinite_steps),
                "train/skipped": 1.0,
                "train/iteration": float(self.iteration),
                "train/beta": float(self.method.beta(self.iteration - 1)),
                "train/scoring_errors": float(self.fault_tracker.step_scoring_errors),
            }
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
        prog = {"reward": m["reward/total/mean"]}
        if "success" in m:
            prog["success"] = m["success"]
        self._publish({f"train/{k}": v for k, v in m.items()}, prog)

    def _publish(self, metrics: dict[str, float], bar: Mapping[str, float] = ()) -> None:
        """The step's metrics for everything that reads them, in one go rather than one
        ``self.log`` a key (whose per-key bookkeeping cost more than all the rest of the
        logging): ``trainer.callback_metrics`` (as tensors, as ``self.log`` leaves them) with
        ``bar``'s keys, the progress bar's metrics (``bar``), and the loggers, which get them
        at the end of the batch (``on_train_batch_end``). Every rank holds the same (already
        global) values, so nothing is reduced."""
        bar = dict(bar)
        values = {k: torch.tensor(v, dtype=torch.float32) for k, v in {**metrics, **bar}.items()}
        self.trainer.callback_metrics.update(values)
        self.trainer.progress_bar_metrics.update(bar)
        self._unwritten = {k: values[k] for k in metrics}  # float32, as self.log wrote them

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """The step's metrics to every logger in one call, where Lightning would write what
        ``self.log`` had collected: after the callbacks' hooks, on the rows that
        ``trainer.log_every_n_steps`` selects, with the same step number and ``epoch``."""
        metrics, self._unwritten = self._unwritten, None
        connector = self.trainer._logger_connector
        if metrics and (connector.should_update_logs or self.trainer.fast_dev_run):
            connector.log_metrics(metrics)

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
        shard_module_policies(self)
