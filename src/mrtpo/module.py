"""PolicyModule: one multi-reward RL step, top to bottom.

1. the rollout callback has sampled G responses for each of the B prompts (``batch.rollout``);
2. the task scores every response: K named rewards and verifier blocks;
3. old-policy log-probs of the sampled tokens (no grad, sampling prompt P0);
4. if the method asks for relevance, replay scores each (response, reward) pair's tokens;
5. the method turns rewards (+ relevance) into token advantages [N, T];
6. clipped-surrogate updates over mini-batches (PPO epochs, micro-batch accumulation);
7. the rollout callback syncs the new weights into the engine.

The module never looks at a method's or task's name: methods say what relevance they need,
tasks build their own contexts.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from mrtpo.batch import PromptBatch, ScoredBatch, rewards_tensor
from mrtpo.credit.methods import AdvantageMethod, CreditInputs
from mrtpo.forward import response_logprobs
from mrtpo.loss import AGGREGATIONS, policy_loss
from mrtpo.replay import Replayer, mass_share
from mrtpo.tasks.base import Task

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
}
OPTIM_DEFAULTS: dict[str, Any] = {
    "lr": 1e-6,
    "weight_decay": 0.0,
    "betas": (0.9, 0.999),
    "warmup_steps": 0,
}


def _merge(defaults: dict, given: Mapping | None, section: str) -> dict:
    given = dict(given or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in '{section}'; valid keys: {sorted(defaults)}")
    return {**defaults, **given}


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
        self.iteration = 0  # completed RL steps (one per prompt batch)
        self.nonfinite_steps = 0
        self.score_failure_streak = 0
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

    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.process_group is not None:
            x = x.clone()
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.process_group)
        return x

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
        scores = self.task.score_many(roll.examples, roll.texts)
        names = tuple(self.task.reward_names)
        return ScoredBatch(
            rollout=roll, scores=scores, reward_names=names, rewards=rewards_tensor(scores, names)
        )

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

        # 3. old-policy (and reference) log-probs under P0
        t0 = time.perf_counter()
        self.policy.eval()
        scored.old_logp = self._logprobs(self.policy, roll, micro)
        self.policy.train()
        if self.ref_policy is not None:
            scored.ref_logp = self._logprobs(self.ref_policy, roll, micro)
        times["old_logp"] = time.perf_counter() - t0

        # 4. replay, before any parameter update of this step
        t0 = time.perf_counter()
        replay_stats: dict[str, float] = {}
        if self.method.relevance is not None:
            pairs = self.method.replay_pairs(scored.rewards, roll.group, self.has_block(scored))
            res = self.replayer.run(self.policy, self.task, scored, pairs, self.method.relevance)
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

        # 5. token advantages
        gen = torch.Generator().manual_seed(self.seed * 7919 + self.iteration)
        out = self.method(
            CreditInputs(
                rewards=scored.rewards,
                group=roll.group,
                mask=roll.response_mask,
                step=self.iteration,
                q=scored.q,
                replayed=scored.replayed,
                process_group=self.process_group,
                generator=gen,
            )
        )
        scored.advantages, scored.stats = out.advantages, dict(out.stats)
        if not torch.isfinite(scored.advantages).all():
            return self._skip_nonfinite("advantages")

        # 6. updates
        t0 = time.perf_counter()
        upd = self._update(scored)
        times["update"] = time.perf_counter() - t0
        if upd is None:
            return self._skip_nonfinite("loss")

        self.iteration += 1
        self.last = scored
        times["step"] = time.perf_counter() - t_step + times.get("rollout", 0.0)
        self._log_step(scored, upd, replay_stats)
        return None

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
                        scored.old_logp[idx].to(dev),
                        scored.advantages[idx].to(dev),
                        sub.response_mask.to(dev),
                        rl["clip_low"],
                        rl["clip_high"],
                        rl["loss_agg"],
                        denom,
                        scored.ref_logp[idx].to(dev) if scored.ref_logp is not None else None,
                        rl["kl_coef"],
                    )
                    if not torch.isfinite(loss):
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
        errors = [
            (s, e.id)
            for s, e in zip(scored.scores, scored.rollout.examples, strict=True)
            if s.error
        ]
        self.timings["scoring_errors"] = float(len(errors))
        for s, eid in errors[:3]:
            log.warning("reward function failed on example %s: %s", eid, s.error)
        if errors and len(errors) == len(scored.scores):
            self.score_failure_streak += 1
            if self.score_failure_streak >= self.rl["max_consecutive_score_failures"]:
                raise RuntimeError(
                    f"scoring failed on every response for {self.score_failure_streak} steps in a "
                    f"row (last error: {errors[0][0].error}); fix the task's reward function or "
                    "raise rl.max_consecutive_score_failures"
                )
        else:
            self.score_failure_streak = 0

    def _skip_nonfinite(self, what: str):
        self.nonfinite_steps += 1
        log.warning(
            "non-finite %s at step %d: update skipped (%d so far)",
            what,
            self.iteration,
            self.nonfinite_steps,
        )
        self.log("train/nonfinite_skips", float(self.nonfinite_steps))
        if self.nonfinite_steps >= self.rl["max_nonfinite_steps"]:
            raise RuntimeError(
                f"{self.nonfinite_steps} steps had non-finite {what}; stopping. Lower optim.lr "
                "or raise rl.max_nonfinite_steps"
            )
        self.iteration += 1
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
        sync = self.process_group is not None
        self.log_dict(
            {f"train/{k}": v for k, v in m.items()},
            on_step=True,
            on_epoch=False,
            sync_dist=sync,
            batch_size=roll.n,
        )
        prog = {"reward": m["reward/total/mean"]}
        if "success" in m:
            prog["success"] = m["success"]
        self.log_dict(prog, prog_bar=True, logger=False, on_step=True, batch_size=roll.n)

    # ---- validation --------------------------------------------------------------------
    def validation_step(self, batch: PromptBatch, batch_idx: int):
        # Scored once per epoch, with the same scorer as `src/eval.py`.
        self._val_rows.append((batch.rollout.examples, batch.rollout.texts))

    def on_validation_epoch_start(self) -> None:
        self._val_rows = []

    def on_validation_epoch_end(self) -> None:
        if not self._val_rows:
            return
        from mrtpo.evaluation import evaluate_examples

        exs = [e for ex, _ in self._val_rows for e in ex]
        texts = [t for _, ts in self._val_rows for t in ts]
        metrics, _ = evaluate_examples(self.task, exs, texts)
        self.log_dict(
            {
                f"val/{self.task.name}/{k}": float(v)
                for k, v in metrics.items()
                if isinstance(v, (int, float)) and not math.isnan(float(v))
            },
            sync_dist=self.process_group is not None,
        )

    # ---- checkpoints -------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["mrtpo"] = {"iteration": self.iteration, "nonfinite_steps": self.nonfinite_steps}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("mrtpo", {})
        self.iteration = int(state.get("iteration", 0))
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
