"""PolicyModule: the Lightning side of multi-reward RL.

The step itself is ``mrtpo.step.RLStep``, which knows nothing of Lightning; this module owns
the policy as a registered module (devices, sharding, checkpoints), the optimizer and schedule
(as ``UpdateHost``), logging and validation. Rollouts arrive on the batch from
``callbacks.rollout``, which also pushes the new weights into the engine after the step.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import lightning as L
import torch

from mrtpo.core.batch import PromptBatch
from mrtpo.core.credit.methods import AdvantageMethod
from mrtpo.core.evaluation import evaluate_examples
from mrtpo.core.lora import checkpoint_keys, is_lora
from mrtpo.core.replay import Replayer
from mrtpo.distributed import Ranks, is_sharded
from mrtpo.lightning import compat as lightning_compat
from mrtpo.lightning.sharding import shard_module_policies
from mrtpo.run.checkpointing import NonFiniteStateError, assert_finite_state
from mrtpo.run.settings import OptimConfig, ReplayConfig, RLConfig
from mrtpo.step import RLStep, StepRecord, StepResult, TorchHost
from mrtpo.tasks.base import Task

log = logging.getLogger(__name__)


def linear_warmup(optimizer, warmup_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate rises linearly over ``warmup_steps`` RL steps, then stays."""
    warm = int(warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0
    )


def _on_step(name: str, cast: Callable = lambda v: v) -> property:
    """A property that reads and sets ``self.step.<name>``."""
    return property(
        lambda self: getattr(self.step, name),
        lambda self, value: setattr(self.step, name, cast(value)),
    )


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
        optimizer: Callable | None = None,
        scheduler: Callable | None = None,
    ) -> None:
        """``optimizer`` (params -> Optimizer), ``scheduler`` (optimizer -> LRScheduler):
        ``_partial_`` nodes; by default AdamW and a linear warm-up from ``optim``."""
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy
        self.tokenizer = tokenizer
        self.rl = RLConfig.from_mapping(rl)
        self.optim_cfg = OptimConfig.from_mapping(optim)
        o = self.optim_cfg
        self._make_optimizer = optimizer or partial(
            torch.optim.AdamW, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas)
        )
        self._make_scheduler = scheduler or partial(linear_warmup, warmup_steps=o.warmup_steps)
        rcfg = ReplayConfig.from_mapping(replay)
        self.seed = seed
        replayer = Replayer(
            tokenizer, rcfg.token_budget, rcfg.jsd_chunk, self.rl.shared_prompt_forward,
            noise_floor=rcfg.noise_floor,
        )  # fmt: skip
        self.ref_policy = None
        # Under LoRA the reference is the base model itself, adapters off: no second copy.
        if self.rl.kl_coef > 0 and not is_lora(policy):
            self.ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
        # Under LoRA a checkpoint holds the adapters only (the frozen base is reloaded from
        # model.name_or_path); None: every tensor.
        self._checkpoint_keys = (
            {"policy." + k for k in checkpoint_keys(policy)} if is_lora(policy) else None
        )
        self.step = RLStep(
            policy,
            tokenizer,
            task,
            method,
            self.rl,
            replayer,
            ref_policy=self.ref_policy,
            seed=seed,
            ranks=Ranks(lambda: self.device),
            device=lambda: self.device,
        )
        self.last: StepRecord | None = None  # for callbacks (sample tables, relevance dumps)
        self.timings: dict[str, float] = {}  # the rollout callback's and the step's phases
        self._logged_keys: set[str] = set()  # every step metric logged so far in this fit
        self._val_rows: list = []
        method.setup(task, self.step.method_services())

    # ---- the step's parts and state, as callbacks and tests read (and swap) them -----------
    task = _on_step("task")
    method = _on_step("method")
    replayer = _on_step("replayer")
    iteration = _on_step("iteration", int)  # completed RL steps, skipped ones included
    ranks = _on_step("ranks")
    fault_tracker = _on_step("faults")

    @property
    def nonfinite_steps(self) -> int:
        return self.step.faults.nonfinite_steps

    # Batches hold Python objects; tensors are moved where they are used.
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch

    # ---- optimizer ---------------------------------------------------------------------
    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = self._make_optimizer(params)
        sched = self._make_scheduler(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- the step ----------------------------------------------------------------------
    def training_step(self, batch: PromptBatch, batch_idx: int):
        if batch.rollout is None:
            raise RuntimeError("no rollout on the batch: is the RolloutCallback in callbacks?")
        waited = self.timings.get("rollout", 0.0)
        result = self.step.run(batch.rollout, _Host(self), waited, batch.rollout_info)
        self.timings.update(result.times)
        self.last = result.record
        self._publish(result)
        return None

    def _publish(self, result: StepResult) -> None:
        """The step's metrics through Lightning's ``log_dict``: the loggers (on the rows
        ``trainer.log_every_n_steps`` selects), ``callback_metrics`` and the progress bar.
        The step has reduced them over ranks already (``step/metrics.py``). Lightning writes
        a key's last value on every later row, so a key this step did not measure (a skipped
        update has no loss) is logged as NaN rather than as an older step's value."""
        once = {"on_step": True, "on_epoch": False, "batch_size": 1, "sync_dist": False}
        unmeasured = dict.fromkeys(self._logged_keys - result.metrics.keys(), math.nan)
        self._logged_keys |= result.metrics.keys()
        self.log_dict({**result.metrics, **unmeasured}, **once)
        if result.bar:
            self.log_dict(dict(result.bar), prog_bar=True, logger=False, **once)

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
            "logged_keys": sorted(self._logged_keys),  # a resumed run's rows match (NaN, not blank)
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
        self._logged_keys = set(state.get("logged_keys", ()))
        # Keep a budget that replay had to lower after running out of memory.
        budget = state.get("replay_token_budget")
        if budget is not None and int(budget) < int(self.replayer.token_budget):
            self.replayer.token_budget = int(budget)

    # ---- sharding ----------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under ``trainer=fsdp``, shard the policy and reference (``lightning.sharding``)."""
        shard_module_policies(self)


class _Host(TorchHost):
    """The step's ``UpdateHost``: updates through Lightning's optimizer wrapper; only an RL
    step's last update advances ``global_step`` (max_steps and checkpoints count RL steps)."""

    def __init__(self, module: PolicyModule) -> None:
        super().__init__(module.optimizers(), module.lr_schedulers())
        self.module = module

    def backward(self, loss: torch.Tensor) -> None:
        self.module.manual_backward(loss)

    def clip_gradients(self, max_norm: float) -> None:
        self.module.clip_gradients(
            self.opt, gradient_clip_val=max_norm, gradient_clip_algorithm="norm"
        )

    def optimizer_step(self, counted: bool) -> None:
        if counted:
            self.opt.step()
        else:
            lightning_compat.step_without_counting(self.opt)
        # NaN/inf weights or moments must stop here, not reach a checkpoint.
        _assert_finite(self.module.policy, self.opt, self.module.ranks)

    def skip_step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        lightning_compat.count_step(self.opt)
        self.sched.step()


def _assert_finite(policy, opt, ranks: Ranks) -> None:
    """``assert_finite_state``; sharded, each rank checks its shards and all raise together
    (under DDP every rank holds the same values, so every rank raises alike)."""
    if not is_sharded(policy):
        assert_finite_state(policy, opt)
        return
    err = None
    try:
        assert_finite_state(policy, opt)
    except NonFiniteStateError as exc:
        err = exc
    if ranks.any(err is not None):
        raise err or NonFiniteStateError(
            "non-finite training state on another rank (its log names the tensor); lower "
            "optim.lr or rl.max_grad_norm, and resume from the last checkpoint"
        )
