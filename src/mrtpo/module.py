"""PolicyModule: one multi-reward RL step, top to bottom.

1. the rollout callback has sampled G responses for each of the B prompts (``batch.rollout``);
2. the task scores every response: K named rewards and verifier blocks;
3. if the method asks for relevance, replay scores each (response, reward) pair's tokens
   under the parameters that sampled them;
4. old-policy log-probs of the sampled tokens (no grad, sampling prompt P0), when more than
   one update follows (reused from replay's P_all pass where P_all is P0);
5. the method turns rewards (+ relevance) into token advantages [N, T];
6. clipped-surrogate updates over mini-batches (PPO epochs, micro-batch accumulation);
7. the rollout callback syncs the new weights into the engine.

The module never looks at a method's or task's name: methods say what relevance they need,
tasks build their own contexts.

Faults are contained rather than fatal: a reward function that raises costs that sample its
rewards (counted, with its id logged), a non-finite reward, advantage or loss skips the step
(counted), an out-of-memory error in replay retries with a smaller token budget, and only
repeated failures (``rl.max_consecutive_score_failures``, ``rl.max_nonfinite_steps``) stop
the run. Under DDP every such decision is taken jointly by all ranks, so no rank is left
waiting in a collective that another rank skipped.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from mrtpo.batch import PromptBatch, ScoredBatch, rewards_tensor
from mrtpo.credit.methods import AdvantageMethod, CreditInputs
from mrtpo.forward import response_logprobs
from mrtpo.loss import AGGREGATIONS, policy_loss
from mrtpo.replay import Replayer, mass_share
from mrtpo.tasks.base import Score, Task

log = logging.getLogger(__name__)

RL_DEFAULTS: dict[str, Any] = {
    "prompts_per_step": 4,  # B
    "group_size": 4,  # G
    "ppo_epochs": 1,
    "mini_batch_size": 16,  # responses per optimizer step
    "micro_batch_size": 8,  # responses per forward/backward
    "clip_low": 0.2,
    "clip_high": 0.28,
    "kl_coef": 0.0,
    "loss_agg": "token-mean",
    "max_grad_norm": 1.0,
    "max_nonfinite_steps": 3,  # stop after this many skipped non-finite steps
    "max_consecutive_score_failures": 3,  # stop after this many steps where all scoring failed
    "replay_oom_retries": 6,  # halve replay.token_budget and retry this often on out-of-memory
}
OPTIM_DEFAULTS: dict[str, Any] = {
    "lr": 1e-6,
    "weight_decay": 0.0,
    "betas": (0.9, 0.999),
    "warmup_steps": 0,
}


OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)


def _free_accelerator_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _clean_score(score: Score, names: Sequence[str]) -> Score:
    """A task's ``Score`` with every reward a finite/infinite float or ``None``.

    NaN becomes ``None`` ("does not apply", as the reward tensor encodes it); a value that is
    not a number (a string, a list) makes the sample a scoring error rather than crash the
    step. Infinite values are kept: the step is skipped as non-finite.
    """
    bad = []
    for k in names:
        v = score.rewards.get(k)
        if v is None:
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            bad.append(k)
            continue
        if math.isnan(f):
            score.rewards[k] = None
    if bad:
        for k in bad:
            score.rewards[k] = None
        msg = f"reward(s) {bad} are not numbers"
        score.error = f"{score.error}; {msg}" if score.error else msg
    return score


def _merge(defaults: dict, given: Mapping | None, section: str) -> dict:
    given = dict(given or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in '{section}'; valid keys: {sorted(defaults)}")
    return {**defaults, **given}


# Step metrics that add up over ranks (the others are averaged, or min/max-reduced).
_SUM_METRICS = frozenset({"replay/forwards", "replay/tokens", "tokens_per_s"})
# Step metrics that are already global (reduced before logging, or equal on every rank).
_GLOBAL_METRICS = frozenset({"iteration", "nonfinite_skips", "beta", "scoring_errors"})


class PolicyModule(L.LightningModule):
    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        task: Task,
        method: AdvantageMethod,
        rl: Mapping | None = None,
        optim: Mapping | None = None,
        replay: Mapping | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy
        self.tokenizer = tokenizer
        self.task = task
        self.method = method
        self.rl = _merge(RL_DEFAULTS, rl, "rl")
        self.optim_cfg = _merge(OPTIM_DEFAULTS, optim, "optim")
        if self.rl["loss_agg"] not in AGGREGATIONS:
            raise ValueError(f"rl.loss_agg={self.rl['loss_agg']!r}; valid: {list(AGGREGATIONS)}")
        self.seed = seed
        self.replayer = Replayer(tokenizer, **dict(replay or {}))
        method.setup(tuple(task.reward_names), bool(task.rewards_vary_per_prompt))
        self.ref_policy = None
        if self.rl["kl_coef"] > 0:
            self.ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
        self.iteration = 0  # completed RL steps (one per prompt batch, skipped ones included)
        self.nonfinite_steps = 0
        self.score_failure_streak = 0
        # cumulative fault counters (global over ranks), saved in checkpoints
        self.faults: dict[str, float] = {
            "scoring_errors_total": 0.0,
            "score_many_fallbacks": 0.0,
            "replay_oom_retries": 0.0,
        }
        self.last: ScoredBatch | None = None  # for callbacks (sample tables, relevance dumps)
        self.timings: dict[str, float] = {}
        self._val_rows: list = []

    # Batches hold Python objects; tensors are moved where they are used.
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch

    # ---- optimizer ---------------------------------------------------------------------
    def configure_optimizers(self):
        o = self.optim_cfg
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            params, lr=o["lr"], weight_decay=o["weight_decay"], betas=tuple(o["betas"])
        )
        warm = int(o["warmup_steps"])
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- helpers -----------------------------------------------------------------------
    @property
    def process_group(self):
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    @property
    def world_size(self) -> int:
        pg = self.process_group
        return dist.get_world_size(pg) if pg is not None else 1

    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.process_group is not None:
            x = x.clone()
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.process_group)
        return x

    def _sum_ranks(self, *values: float) -> list[float]:
        """Element-wise sums of ``values`` over ranks (one collective; local outside DDP)."""
        if self.process_group is None:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return [float(v) for v in self._all_reduce_sum(t).cpu()]

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank: joint skip decisions."""
        return self._sum_ranks(float(flag))[0] > 0

    @torch.no_grad()
    def _logprobs(self, model, roll, micro: int) -> torch.Tensor:
        out = []
        for s in range(0, roll.n, micro):
            idx = torch.arange(s, min(roll.n, s + micro))
            sub = roll.select(idx)
            out.append(
                response_logprobs(
                    model, sub.prompt_ids, sub.prompt_mask, sub.response_ids, sub.response_mask
                ).cpu()
            )
        return torch.cat(out)

    def score(self, batch: PromptBatch) -> ScoredBatch:
        roll = batch.rollout
        if roll is None:
            raise RuntimeError("no rollout on the batch: is the RolloutCallback in callbacks?")
        scores = self._score_many(roll.examples, roll.texts)
        names = tuple(self.task.reward_names)
        return ScoredBatch(
            rollout=roll, scores=scores, reward_names=names, rewards=rewards_tensor(scores, names)
        )

    def _score_many(self, examples, texts) -> list[Score]:
        """``task.score_many`` with the fault isolation of ``Task.safe_score``.

        A task's own ``score_many`` (a process pool, a batched verifier) may raise or return
        the wrong number of scores; the batch is then scored one response at a time with
        ``safe_score``, so one bad response costs only its own rewards. Reward values that are
        not numbers make that sample an error; NaN means "does not apply" (like ``None``).
        """
        try:
            scores = list(self.task.score_many(examples, texts))
            if len(scores) != len(texts):
                raise RuntimeError(f"returned {len(scores)} scores for {len(texts)} responses")
        except Exception as exc:
            self.faults["score_many_fallbacks"] += 1
            log.warning(
                "task %s: score_many failed (%s: %s); scoring the %d responses one at a time",
                self.task.name,
                type(exc).__name__,
                exc,
                len(texts),
            )
            scores = [self.task.safe_score(e, t) for e, t in zip(examples, texts, strict=True)]
        return [_clean_score(s, self.task.reward_names) for s in scores]

    def has_block(self, scored: ScoredBatch) -> torch.Tensor:
        """[N, K] bool: a reward has information for replay (a block, or in-prompt info)."""
        out = torch.zeros(scored.rewards.shape, dtype=torch.bool)
        for i, s in enumerate(scored.scores):
            for k, name in enumerate(scored.reward_names):
                # Tasks whose information lives in the prompt return no blocks at all.
                out[i, k] = (s.blocks.get(name) is not None) if s.blocks else True
        return out & ~scored.rewards.isnan()

    # ---- the step ----------------------------------------------------------------------
    def training_step(self, batch: PromptBatch, batch_idx: int):
        t_step = time.perf_counter()
        rl, times = self.rl, self.timings
        micro = int(rl["micro_batch_size"])

        # 2. rewards
        t0 = time.perf_counter()
        scored = self.score(batch)
        times["reward"] = time.perf_counter() - t0
        self._check_scoring(scored)
        roll = scored.rollout
        # NaN means "does not apply"; +-inf is a broken reward: skip rather than train on it.
        if self._any_rank(bool(torch.isinf(scored.rewards).any())):
            return self._skip_nonfinite("rewards", scored)

        # 3. replay, before any parameter update of this step
        t0 = time.perf_counter()
        replay_stats: dict[str, float] = {}
        res = None
        # At beta = 0 (e.g. the first step of a warm-up) relevance cannot change the
        # advantages, so the replay is skipped.
        if self.method.relevance is not None and self.method.beta(self.iteration) > 0:
            pairs = self.method.replay_pairs(scored.rewards, roll.group, self.has_block(scored))
            res = self._replay(scored, pairs)
            scored.q, scored.replayed = res.q, res.replayed
            present = (~scored.rewards.isnan()).sum().clamp_min(1)
            denom = present if self.method.relevance == "per_reward" else max(roll.n, 1)
            replay_stats = {
                "replay/share": float(res.replayed.sum() / denom),
                "replay/forwards": float(res.forwards),
                "replay/tokens": float(res.tokens),
            }
            if self.method.relevance == "per_reward":
                shares = mass_share(res.q, roll.response_mask, res.replayed, 0.8)
                for k, name in enumerate(scored.reward_names):
                    if not math.isnan(shares[k]):
                        replay_stats[f"replay/top80_token_share/{name}"] = shares[k]
        times["replay"] = time.perf_counter() - t0

        # 4. old-policy (and reference) log-probs under P0. Where P_all is the sampling prompt
        # (tasks whose information is in the prompt) replay already computed them. With a
        # single update per step they equal the current policy's, so they are not needed.
        t0 = time.perf_counter()
        n_mini = -(-roll.n // max(1, int(rl["mini_batch_size"])))
        if int(rl["ppo_epochs"]) * n_mini > 1:
            scored.old_logp = self._old_logprobs(roll, res, micro)
        if self.ref_policy is not None:
            scored.ref_logp = self._logprobs(self.ref_policy, roll, micro)
        times["old_logp"] = time.perf_counter() - t0

        # 5. token advantages. Group ids are local to this rank (0..B-1): a group never spans
        # ranks. Under DDP the inputs go to this rank's device, which the collective backend
        # needs (NCCL reduces CUDA tensors only); batch statistics are then global.
        dev = self.device if self.process_group is not None else torch.device("cpu")

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
                process_group=self.process_group,
                generator=gen,
            )
        )
        scored.advantages, scored.stats = out.advantages.cpu(), dict(out.stats)
        if self._any_rank(not bool(torch.isfinite(scored.advantages).all())):
            return self._skip_nonfinite("advantages", scored)

        # 6. updates
        t0 = time.perf_counter()
        upd = self._update(scored)
        times["update"] = time.perf_counter() - t0
        if upd is None:
            return self._skip_nonfinite("loss", scored)

        self.iteration += 1
        self.last = scored
        times["step"] = time.perf_counter() - t_step + times.get("rollout", 0.0)
        self._log_step(scored, upd, replay_stats)
        return None

    def _old_logprobs(self, roll, res, micro: int) -> torch.Tensor:
        """log pi_old of the sampled tokens, reusing replay's P_all pass where P_all is P0."""
        self.policy.eval()
        try:
            if res is None or res.logp is None or not bool(res.logp_rows.any()):
                return self._logprobs(self.policy, roll, micro)
            old = res.logp.clone() * roll.response_mask
            rest = (~res.logp_rows).nonzero().flatten()
            if len(rest):
                old[rest] = self._logprobs(self.policy, roll.select(rest), micro)
            return old
        finally:
            self.policy.train()

    def _replay(self, scored: ScoredBatch, pairs: torch.Tensor):
        """Run replay; on out-of-memory halve ``replayer.token_budget`` and try again.

        The smaller budget is kept for the rest of the run (the next batch would fail the
        same way). Replay runs no collectives, so a retry on one rank alone is safe.
        """
        retries = int(self.rl["replay_oom_retries"])
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
            self.faults["replay_oom_retries"] += 1
            log.warning(
                "replay ran out of memory at step %d (%s); retrying with replay.token_budget=%d "
                "(set it in the config to avoid the retry)",
                self.iteration,
                failed,
                self.replayer.token_budget,
            )
        raise AssertionError("unreachable")

    def _update(self, scored: ScoredBatch) -> dict[str, float] | None:
        rl, roll = self.rl, scored.rollout
        opt = self.optimizers()
        sched = self.lr_schedulers()
        n = roll.n
        mini = max(1, min(int(rl["mini_batch_size"]), n))
        micro = max(1, min(int(rl["micro_batch_size"]), mini))
        world = dist.get_world_size(self.process_group) if self.process_group is not None else 1
        g = torch.Generator().manual_seed(self.seed * 104729 + self.iteration)
        agg: dict[str, list[float]] = {}
        n_updates = int(rl["ppo_epochs"]) * ((n + mini - 1) // mini)
        u = 0
        for _ in range(int(rl["ppo_epochs"])):
            perm = torch.randperm(n, generator=g)
            for s in range(0, n, mini):
                u += 1
                mb = perm[s : s + mini]
                if rl["loss_agg"] == "token-mean":
                    local = roll.response_mask[mb].sum().float()
                else:
                    local = torch.tensor(float(len(mb)))
                # Normalize by the global mini-batch; DDP averages gradients over ranks.
                denom = float(self._all_reduce_sum(local.to(self.device)).clamp_min(1.0)) / world
                opt.zero_grad(set_to_none=True)
                for ms in range(0, len(mb), micro):
                    idx = mb[ms : ms + micro]
                    sub = roll.select(idx)
                    logp = response_logprobs(
                        self.policy,
                        sub.prompt_ids,
                        sub.prompt_mask,
                        sub.response_ids,
                        sub.response_mask,
                    )
                    dev = logp.device
                    loss, st = policy_loss(
                        logp,
                        # one update per step: the sampling policy is the current one
                        logp.detach() if scored.old_logp is None else scored.old_logp[idx].to(dev),
                        scored.advantages[idx].to(dev),
                        sub.response_mask.to(dev),
                        rl["clip_low"],
                        rl["clip_high"],
                        rl["loss_agg"],
                        denom,
                        scored.ref_logp[idx].to(dev) if scored.ref_logp is not None else None,
                        rl["kl_coef"],
                    )
                    # Decided jointly: a rank that skipped backward would leave the others
                    # waiting in DDP's gradient all-reduce.
                    if self._any_rank(not bool(torch.isfinite(loss))):
                        opt.zero_grad(set_to_none=True)
                        return None
                    self.manual_backward(loss)
                    agg.setdefault("loss", []).append(float(loss.detach()))
                    for k, v in st.items():
                        agg.setdefault(k, []).append(float(v))
                if rl["max_grad_norm"]:
                    self.clip_gradients(
                        opt, gradient_clip_val=rl["max_grad_norm"], gradient_clip_algorithm="norm"
                    )
                self._optimizer_step(opt, counted=(u == n_updates))
                sched.step()
        out = {k: (sum(v) if k == "loss" else sum(v) / len(v)) for k, v in agg.items()}
        out["lr"] = float(sched.get_last_lr()[0])
        return out

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

    # ---- faults ------------------------------------------------------------------------
    def _check_scoring(self, scored: ScoredBatch) -> None:
        """Count scoring errors over all ranks; stop after too many all-failed steps."""
        errors = [
            (s, e.id)
            for s, e in zip(scored.scores, scored.rollout.examples, strict=True)
            if s.error
        ]
        for s, eid in errors[:3]:
            log.warning(
                "reward function failed on example %s at step %d: %s", eid, self.iteration, s.error
            )
        if len(errors) > 3:
            log.warning("... and %d more scoring errors at this step", len(errors) - 3)
        n_err, n_all = self._sum_ranks(len(errors), len(scored.scores))
        self.timings["scoring_errors"] = n_err
        self.faults["scoring_errors_total"] += n_err
        if n_err > 0 and n_err == n_all:
            self.score_failure_streak += 1
            if self.score_failure_streak >= self.rl["max_consecutive_score_failures"]:
                last = errors[0][0].error if errors else "on another rank"
                raise RuntimeError(
                    f"scoring failed on every response for {self.score_failure_streak} steps in a "
                    f"row (last error: {last}); fix the task's reward function or raise "
                    "rl.max_consecutive_score_failures"
                )
        else:
            self.score_failure_streak = 0

    def _skip_nonfinite(self, what: str, scored: ScoredBatch | None = None):
        """Skip this step's update (every rank does, the decision being joint).

        The step still counts: ``iteration`` and ``global_step`` advance, so the data stream,
        the β schedule, ``trainer.max_steps`` and the metrics' step column stay aligned.
        """
        self.nonfinite_steps += 1
        ids = []
        if scored is not None:
            bad = ~torch.isfinite(scored.rewards).all(-1)
            if what != "rewards" and scored.advantages is not None:
                bad = bad | ~torch.isfinite(scored.advantages).all(-1)
            ids = [scored.rollout.examples[i].id for i in bad.nonzero().flatten().tolist()[:5]]
        log.warning(
            "non-finite %s at step %d: update skipped (%d so far; limit "
            "rl.max_nonfinite_steps=%d)%s",
            what,
            self.iteration,
            self.nonfinite_steps,
            self.rl["max_nonfinite_steps"],
            f"; examples {ids}" if ids else "",
        )
        if self.nonfinite_steps >= self.rl["max_nonfinite_steps"]:
            raise RuntimeError(
                f"{self.nonfinite_steps} steps had non-finite values (last: {what}); stopping. "
                "Check the task's rewards, lower optim.lr, or raise rl.max_nonfinite_steps"
            )
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        # Count the step without an optimizer update (Lightning's manual-optimization hooks).
        opt._on_before_step()
        opt._on_after_step()
        self.iteration += 1
        self.last = None
        self.log_dict(
            {
                "train/nonfinite_skips": float(self.nonfinite_steps),
                "train/skipped": 1.0,
                "train/iteration": float(self.iteration),
                "train/beta": float(self.method.beta(self.iteration - 1)),
                "train/scoring_errors": float(self.timings.get("scoring_errors", 0.0)),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        return None

    # ---- logging -----------------------------------------------------------------------
    def _log_step(self, scored: ScoredBatch, upd: dict[str, float], replay_stats) -> None:
        roll, r = scored.rollout, scored.rewards
        m: dict[str, float] = {}
        for k, name in enumerate(scored.reward_names):
            col = r[:, k]
            col = col[~col.isnan()]
            if col.numel():
                m[f"reward/{name}/mean"] = float(col.mean())
        m["reward/total/mean"] = float(r.nan_to_num(0.0).sum(-1).mean())
        succ = [s.checks.get("success") for s in scored.scores]
        succ = [float(x) for x in succ if x is not None]
        if succ:
            m["success"] = sum(succ) / len(succ)
        mask = roll.response_mask
        a = scored.advantages[mask]
        if a.numel():
            m.update(
                {
                    "adv/mean": float(a.mean()),
                    "adv/abs_mean": float(a.abs().mean()),
                    "adv/std": float(a.std()) if a.numel() > 1 else 0.0,
                    "adv/min": float(a.min()),
                    "adv/max": float(a.max()),
                }
            )
        m.update({f"adv/{k}": float(v) for k, v in scored.stats.items()})
        m.update(replay_stats)
        m.update(upd)
        lengths = mask.sum(-1).float()
        m["response_len/mean"] = float(lengths.mean())
        m["response_len/max"] = float(lengths.max())
        m["finished_frac"] = float(roll.finished.float().mean())
        m["scoring_errors"] = self.timings.get("scoring_errors", 0.0)
        m["beta"] = float(self.method.beta(self.iteration - 1))
        for k in ("rollout", "reward", "old_logp", "replay", "update", "step"):
            if k in self.timings:
                m[f"time/{k}"] = self.timings[k]
        step_t = self.timings.get("step", 0.0)
        if step_t > 0:
            m["time/replay_share"] = self.timings.get("replay", 0.0) / step_t
            m["tokens_per_s"] = float(lengths.sum()) / step_t
        m["iteration"] = float(self.iteration)
        for k, v in self.faults.items():
            m[k] = v
        m["nonfinite_skips"] = float(self.nonfinite_steps)
        weights = {
            f"reward/{name}/mean": float((~r[:, k].isnan()).sum())
            for k, name in enumerate(scored.reward_names)
        }
        weights.update(
            {
                "success": float(len(succ)),
                "adv/mean": float(a.numel()),
                "adv/abs_mean": float(a.numel()),
            }
        )
        m = self._global_metrics(m, weights)
        # Lightning re-reports a key's last value on steps that do not log it; a metric that
        # does not exist this step (e.g. a reward nobody replayed) is written as NaN instead.
        seen = getattr(self, "_logged_keys", set())
        for k in seen - m.keys():
            m[k] = float("nan")
        self._logged_keys = seen | m.keys()
        # Every rank logs the same (already global) values: no sync_dist collectives, whose
        # order would have to match across ranks key by key.
        self.log_dict(
            {f"train/{k}": v for k, v in m.items()},
            on_step=True,
            on_epoch=False,
            batch_size=roll.n,
        )
        prog = {"reward": m["reward/total/mean"]}
        if "success" in m:
            prog["success"] = m["success"]
        self.log_dict(prog, prog_bar=True, logger=False, on_step=True, batch_size=roll.n)

    def _global_metrics(self, m: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """Combine each rank's step metrics into the global batch's (identity outside DDP).

        Means are weighted by each rank's count (``weights``, default 1); counts and
        throughput are summed; minima, maxima and stage times (the slowest rank) reduced
        accordingly. A key some rank lacks (a reward absent from its samples) is combined over
        the ranks that have it, so every rank ends with the same keys.
        """
        if self.process_group is None:
            return m
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, (m, weights), group=self.process_group)
        keys = sorted(set().union(*(p[0] for p in parts)))
        out: dict[str, float] = {}
        for k in keys:
            vals = [(p[0][k], p[1].get(k, 1.0)) for p in parts if k in p[0]]
            xs = [v for v, _ in vals]
            if k in _SUM_METRICS:
                out[k] = float(sum(xs))
            elif k.endswith("/min"):
                out[k] = float(min(xs))
            elif k.endswith("/max") or k.startswith("time/"):
                out[k] = float(max(xs))
            elif k in _GLOBAL_METRICS or k in self.faults:
                out[k] = float(xs[0])  # already global (or identical on every rank)
            else:
                total = sum(w for _, w in vals)
                out[k] = float(sum(v * w for v, w in vals) / total) if total > 0 else float(xs[0])
        return out

    # ---- validation --------------------------------------------------------------------
    def validation_step(self, batch: PromptBatch, batch_idx: int):
        # Scored once per epoch, with the same scorer as `src/eval.py`.
        self._val_rows.append((batch.index, batch.rollout.examples, batch.rollout.texts))

    def on_validation_epoch_start(self) -> None:
        self._val_rows = []

    def on_validation_epoch_end(self) -> None:
        rows = self._val_rows
        pg = self.process_group
        if pg is not None:
            # Each rank generated for its shard; the sampler pads shards by repeating batches,
            # so gather, keep one copy per batch, score once (rank 0) and share the metrics.
            parts: list = [None] * self.world_size
            dist.all_gather_object(parts, rows, group=pg)
            unique = {idx: (ex, tx) for part in parts for idx, ex, tx in part}
            rows = [(i, *unique[i]) for i in sorted(unique)]
        metrics: dict[str, float] = {}
        if rows and (pg is None or dist.get_rank(pg) == 0):
            from mrtpo.evaluation import evaluate_examples

            exs = [e for _, ex, _ in rows for e in ex]
            texts = [t for _, _, ts in rows for t in ts]
            raw, _ = evaluate_examples(self.task, exs, texts)
            metrics = {
                f"val/{self.task.name}/{k}": float(v)
                for k, v in raw.items()
                if isinstance(v, (int, float)) and not math.isnan(float(v))
            }
        if pg is not None:
            box = [metrics]
            dist.broadcast_object_list(box, src=0, group=pg)
            metrics = box[0]
        if metrics:
            # identical on every rank (broadcast above): the sync only keeps Lightning quiet
            self.log_dict(metrics, sync_dist=pg is not None)

    # ---- checkpoints -------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        return {
            "task": self.task.name,
            "method": getattr(self.method, "config_name", "") or type(self.method).__name__,
            "reward_names": list(self.task.reward_names),
        }

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["mrtpo"] = {
            "iteration": self.iteration,
            "nonfinite_steps": self.nonfinite_steps,
            "score_failure_streak": self.score_failure_streak,
            "faults": dict(self.faults),
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
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.score_failure_streak = int(state.get("score_failure_streak", 0))
        self.faults.update({k: float(v) for k, v in state.get("faults", {}).items()})
        # Keep a budget that replay had to lower after running out of memory.
        budget = state.get("replay_token_budget")
        if budget is not None and int(budget) < int(self.replayer.token_budget):
            self.replayer.token_budget = int(budget)
