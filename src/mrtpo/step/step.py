"""One multi-reward RL step, top to bottom, with no training framework around it: its phases
(sample, score, relevance, old policy, advantages, update), each returning a frozen record
(``mrtpo.step.records``), are README.md's "How a step works". Rank agreement goes through
``mrtpo.distributed.Ranks``; the step never looks at a method's, task's or engine's name, and
imports neither Lightning nor Hydra.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from mrtpo.core.batch import RolloutBatch, ScoredBatch, rewards_tensor
from mrtpo.core.credit.methods import AdvantageMethod, CreditInputs, MethodServices, StepView
from mrtpo.core.credit.relevance import relevance_weights
from mrtpo.core.faults import FaultTracker
from mrtpo.core.loss import engine_gap
from mrtpo.core.replay import Replayer
from mrtpo.core.scoring import score_batch
from mrtpo.distributed import Ranks, is_sharded
from mrtpo.step import metrics as step_metrics
from mrtpo.step.diagnostics import CreditDiagnostics
from mrtpo.step.passes import LogprobPasses
from mrtpo.step.records import Advantages, OldPolicy, Relevance, StepRecord, StepResult
from mrtpo.step.update import UpdateHost, Updater
from mrtpo.tasks.base import Task

log = logging.getLogger(__name__)

#: The step's random streams (``generator``): a generator seeded ``seed * stream +
#: iteration`` per stream, so the shuffle ablation's draws and the mini-batch order do not
#: depend on each other (two primes; changing one changes every run's numbers).
SHUFFLE_STREAM = 7919
MINIBATCH_STREAM = 104729


class RLStep:
    """The step and the state it keeps between steps (the iteration, fault counters)."""

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        task: Task,
        method: AdvantageMethod,
        rl,
        replayer: Replayer,
        *,
        ref_policy: torch.nn.Module | None = None,
        seed: int = 0,
        ranks: Ranks | None = None,
        device: Callable[[], torch.device] | None = None,
    ) -> None:
        self.policy, self.tokenizer, self.task, self.method = policy, tokenizer, task, method
        self.rl, self.replayer, self.seed = rl, replayer, seed
        self.device = device or (lambda: torch.device("cpu"))
        self.ranks = ranks or Ranks(self.device)
        self.iteration = 0  # completed RL steps (one per prompt batch, skipped ones included)
        self.faults = FaultTracker(rl.max_nonfinite_steps, rl.max_consecutive_score_failures)
        pad = tokenizer.pad_token_id
        self.passes = LogprobPasses(policy, ref_policy, pad, self.ranks, rl.shared_prompt_forward)
        self.updater = Updater(policy, rl, self.ranks, pad, self.device)
        self.absent_as_nan = step_metrics.AbsentAsNaN()
        self.diagnostics = CreditDiagnostics(task, tokenizer)

    def method_services(self) -> MethodServices:
        """What ``AdvantageMethod.bind`` lends a method: the task, the tokenizer, replay's
        forward sizes and a frozen copy of the policy as it is now (the initial weights when
        the step is built), made on first use."""
        return MethodServices(
            task=self.task,
            tokenizer=self.tokenizer,
            frozen_policy=functools.cache(self.passes.frozen_policy),
            token_budget=int(self.replayer.token_budget),
            chunk=int(self.replayer.jsd_chunk),
            shared_prompt=self.rl.shared_prompt_forward,
        )

    def generator(self, stream: int) -> torch.Generator:
        """A generator seeded by the run's seed, this step and one of the step's streams: the
        same on every rank, and the same again when the step is rerun after a resume."""
        return torch.Generator().manual_seed(self.seed * stream + self.iteration)

    # ---- the step ----------------------------------------------------------------------
    def run(
        self,
        rollout: RolloutBatch,
        host: UpdateHost,
        rollout_s: float = 0.0,
        rollout_info: dict[str, float] | None = None,
    ) -> StepResult:
        """Phases 2-6 on ``rollout`` (phase 1); ``rollout_s``: the seconds the step waited
        for it; ``rollout_info``: the rollout schedule's own metrics (``train/rollout/...``)."""
        t_step, times = time.perf_counter(), {"rollout": rollout_s}
        stale = self.staleness(rollout)
        lag = {**stale, **(rollout_info or {})}
        with _timed(times, "reward"):
            scored = self.score(rollout)
        self.faults.check_scoring(scored.scores, rollout.examples, self.iteration, self.ranks)
        # NaN means "does not apply"; +-inf is a broken reward: skip rather than train on it.
        if self.ranks.any(bool(torch.isinf(scored.rewards).any())):
            return self.skip(host, "rewards", scored)
        with _timed(times, "replay"):
            rel = self.relevance(scored)
        with _timed(times, "old_logp"):
            old = self.old_policy(rollout, rel, stale.get("rollout/staleness/max", 0.0) > 0)
        adv = self.advantages(scored, rel, old)
        if self.ranks.any(not bool(torch.isfinite(adv.advantages).all())):
            return self.skip(host, "advantages", scored, adv.advantages)
        with _timed(times, "update"):
            upd = self.updater(
                host, self.method, scored, old, adv, self.generator(MINIBATCH_STREAM)
            )
        if upd is None:
            return self.skip(host, "loss", scored, adv.advantages)
        self.iteration += 1
        schedule = self.method.schedule(self.iteration - 1)
        weights = self.token_weights(rel, adv, rollout.response_mask)
        beta = float(schedule.get("beta", 0.0))
        record = StepRecord.of(scored, rel, old, adv, upd, beta=beta, token_weights=weights)
        times["step"] = time.perf_counter() - t_step + rollout_s
        gap = upd.rollout_metrics or old.rollout_metrics
        return self.result(record, upd.metrics, {**gap, **lag}, rel.metrics, times, schedule)

    def score(self, rollout: RolloutBatch) -> ScoredBatch:
        """2. Every response's rewards (NaN: does not apply) and verifier blocks."""
        scores = score_batch(self.task, rollout.examples, rollout.texts, self.faults)
        names = tuple(self.task.reward_names)
        return ScoredBatch(rollout, scores, names, rewards_tensor(scores, names))

    def relevance(self, scored: ScoredBatch) -> Relevance:
        """3. Replay, before any parameter update of this step, as the method's request says.
        At beta = 0 (e.g. the first step of a warm-up) relevance cannot change the
        advantages, so it is skipped."""
        if self.method.relevance is None or not self.method.replays(self.iteration):
            return Relevance()
        roll = scored.rollout
        pairs = self.method.replay_pairs(scored.rewards, roll.group, self.has_info(scored))
        res = self._replay(scored, pairs)
        metrics = {f"replay/{k}": v for k, v in res.metrics.items()}
        return Relevance(res.q, res.replayed, res.logp, res.logp_rows, metrics)

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

    def old_policy(self, roll: RolloutBatch, rel: Relevance, stale: bool = False) -> OldPolicy:
        """4. What the updates compare against, under P0 at the sampling temperature: pi_old's
        log-probs when more than one update follows (with one they equal the policy's), the KL
        reference's, the method's no-grad inputs, and where the engine reported log-probs the
        engine-trainer gap (and rl.tis_cap's weights): from pi_old's log-probs, else the update's
        own forward, else (dropout) a pass of its own."""
        rl, micro = self.rl, int(self.rl.micro_batch_size)
        several = int(rl.ppo_epochs) * -(-roll.n // max(1, int(rl.mini_batch_size))) > 1
        # a batch sampled by older weights (``stale``) is corrected against the engine's
        # log-probs (the behaviour policy's) as decoupled PPO does (docs/method.md)
        cap = rl.tis_cap if rl.tis_cap is not None else (rl.stale_tis_cap if stale else None)
        gap = roll.engine_logp is not None and (several or cap is not None or rl.measure_logp_gap)
        if cap is not None and roll.engine_logp is None:  # refused at start-up, unless the
            raise RuntimeError(  # engine's class claims log-probs it did not deliver
                f"{'rl.tis_cap' if rl.tis_cap is not None else 'a stale batch'} needs the "
                "engine's log-probs of the sampled tokens and the engine returned none; set "
                "reports_logprobs = False on its class"
            )
        logp = functools.cache(lambda: self.passes.old(roll, rel, micro))  # made once, if at all
        old_logp = logp() if several else None
        ref = self.passes.reference(roll, micro) if rl.kl_coef > 0 else None
        extra = self.method.score_inputs(StepView(roll, logp, self.device()))
        fields: dict[str, Any] = {"logp": old_logp, "ref_logp": ref, "extra": extra}
        fields.update(tis_cap=cap, stale=stale)
        if gap and self.passes.gap_in_update(several, logp.cache_info().currsize > 0):
            return OldPolicy(**fields, gap_in_update=True)
        if gap:
            mask = roll.response_mask
            metrics, tis = engine_gap(logp(), roll.engine_logp, mask, cap, stale)
            return OldPolicy(**fields, tis=tis, rollout_metrics=metrics)
        return OldPolicy(**fields)

    def staleness(self, roll: RolloutBatch) -> dict[str, float]:
        """How many steps behind the trainer's weights the sampling weights were (mean, max
        over responses); nothing for a batch without versions (sampled by these weights)."""
        if roll.versions is None:
            return {}
        lag = (self.iteration - roll.versions).clamp_min(0).float()
        return {f"rollout/staleness/{k}": float(getattr(lag, k)()) for k in ("mean", "max")}

    @staticmethod
    def token_weights(rel: Relevance, adv: Advantages, mask: torch.Tensor):
        """The per-token weights the method's advantages used (for the record's readers:
        relevance dumps, pictures); 1 on every token for a method without its own."""
        if rel.q is None:
            return None
        if adv.weights is not None:
            return adv.weights
        return relevance_weights(rel.q, mask, rel.replayed, 0.0)

    def advantages(self, scored: ScoredBatch, rel: Relevance, old: OldPolicy) -> Advantages:
        """5. Token advantages [N, T] and the method's statistics. Group ids are rank-local (a group
        never spans ranks); under DDP inputs go to this rank's device (NCCL reduces CUDA tensors
        only) and batch statistics are global."""
        dev = self.device() if self.ranks.group is not None else torch.device("cpu")

        def on_dev(x):
            return x.to(dev) if x is not None else None

        roll = scored.rollout
        out = self.method(
            CreditInputs(
                rewards=on_dev(scored.rewards),
                group=on_dev(roll.group),
                mask=on_dev(roll.response_mask),
                step=self.iteration,
                q=on_dev(rel.q),
                replayed=on_dev(rel.replayed),
                process_group=self.ranks.group,
                generator=self.generator(SHUFFLE_STREAM),
                extra=old.extra,
            )
        )
        realloc = None if out.realloc is None else out.realloc.cpu()
        weights = None if out.weights is None else out.weights.cpu()
        return Advantages(out.advantages.cpu(), dict(out.stats), realloc, weights)

    def _replay(self, scored: ScoredBatch, pairs: torch.Tensor):
        """Run replay; on out-of-memory halve ``replayer.token_budget`` for the rest of the run and
        retry. Replay runs no collectives, so one rank may retry alone; not under sharding."""
        retries = 0 if is_sharded(self.policy) else int(self.rl.replay_oom_retries)
        for attempt in range(retries + 1):
            failed = None
            try:
                return self.replayer.run(
                    self.policy, self.task, scored, pairs, self.method.relevance
                )
            except torch.OutOfMemoryError as exc:
                failed = f"{type(exc).__name__}: {str(exc)[:200]}"
            # Outside the except block, so the failed forward's tensors can be freed.
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            old = int(self.replayer.token_budget)
            if attempt == retries or old <= 1:
                raise RuntimeError(
                    f"replay ran out of memory {attempt + 1} time(s), down to "
                    f"replay.token_budget={old} ({failed}); lower rollout.sampling."
                    "max_new_tokens or rl.prompts_per_step, or raise rl.replay_oom_retries"
                )
            self.replayer.token_budget = max(1, old // 2)
            self.faults.count("replay_oom_retries")
            log.warning(
                "replay ran out of memory at step %d (%s); retrying with replay.token_budget=%d "
                "(set it in the config to avoid the retry)",
                self.iteration,
                failed,
                self.replayer.token_budget,
            )
        raise AssertionError("unreachable")

    # ---- skips and metrics -------------------------------------------------------------
    def skip(self, host: UpdateHost, what: str, scored: ScoredBatch, adv=None) -> StepResult:
        """Skip this step's update (every rank does: the decision is joint). The step still
        counts, so the data stream, β, ``trainer.max_steps``, the metrics' step and the LR
        warm-up stay aligned."""
        bad = ~torch.isfinite(scored.rewards).all(-1)
        if adv is not None:
            bad = bad | ~torch.isfinite(adv).all(-1)
        ids = [scored.rollout.examples[i].id for i in bad.nonzero().flatten().tolist()[:5]]
        self.faults.nonfinite(what, self.iteration, ids)
        host.skip_step()
        self.iteration += 1
        metrics = {
            "train/nonfinite_skips": float(self.faults.nonfinite_steps),
            "train/skipped": 1.0,
            "train/iteration": float(self.iteration),
            "train/scoring_errors": float(self.faults.step_scoring_errors),
            **{f"train/{k}": float(v) for k, v in self.method.schedule(self.iteration - 1).items()},
        }
        return StepResult(metrics, skipped=what)

    def result(self, record: StepRecord, upd, rollout, replay_metrics, times, schedule):
        """The step's metrics over the global batch (every rank gets the same values)."""
        stats = step_metrics.assemble(
            record,
            upd,
            replay_metrics,
            times,
            self.faults.counters,
            success_check=self.task.success_check,
            schedule=schedule,
            iteration=self.iteration,
            nonfinite_skips=self.faults.nonfinite_steps,
            scoring_errors=self.faults.step_scoring_errors,
            diagnostics=self.diagnostics(record, self.method.relevance),
            rollout=rollout,
        )
        m = self.absent_as_nan(step_metrics.combine(stats, self.ranks))
        bar = {"reward": m["reward/total/mean"]}
        if "success" in m:
            bar["success"] = m["success"]
        return StepResult({f"train/{k}": v for k, v in m.items()}, bar, record, times=times)


@contextlib.contextmanager
def _timed(times: dict[str, float], phase: str):
    """Time one phase of the step (logged as ``train/time/<phase>``)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[phase] = time.perf_counter() - t0
