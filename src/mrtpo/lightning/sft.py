"""The SFT stage: a supervised warm start on a task's reference responses.

``stage=sft`` trains on each prompt's ``Example.reference`` (cross-entropy on response tokens
only) and saves ``<run>/policy``; RL starts from it with ``model.name_or_path=<run>/policy
model.tiny=null``. Any task whose examples carry references works.

Why a target rate, not only a step count: RL needs headroom, and methods compared across K
only mean something from a similar success rate. Every ``eval_every`` steps the policy answers
held-out prompts and training stops once ``target_metric`` reaches ``target_success``; with
``stop_when: below`` once it has *fallen* to it (a second pass on imperfect references, the
toy replication's warm start, lowers a competent policy's success to a chosen level).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import GenerationConfig

from mrtpo.core.chat import chat_ids
from mrtpo.core.evaluation import evaluate_examples
from mrtpo.core.models import eos_token_ids
from mrtpo.evaluate.export import save_model
from mrtpo.lightning.data import PromptDataModule, PromptStream
from mrtpo.lightning.module import linear_warmup
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.rollout.hf import HFEngine
from mrtpo.run.settings import SFTConfig
from mrtpo.tasks.base import Example, Task

log = logging.getLogger(__name__)

IGNORE = -100  # label of positions that carry no loss (prompt, padding)


@dataclass
class SFTBatch:
    input_ids: Tensor  # [n, L] long, prompt then response, right-padded
    attention_mask: Tensor  # [n, L] long
    labels: Tensor  # [n, L] long, IGNORE on prompt and padding positions

    @property
    def n_targets(self) -> int:
        return int((self.labels != IGNORE).sum())


def response_token_ids(tokenizer, text: str, eos_id: int) -> list[int]:
    """The reference as the policy should emit it: its tokens, then the end-of-turn token
    (sampled responses end with EOS too, and EOS decides length constraints)."""
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], int(eos_id)]


def collate_sft(
    prompts: Sequence[list[int]], responses: Sequence[list[int]], pad_id: int
) -> SFTBatch:
    """Right-padded (prompt + response) rows; only response positions carry labels."""
    rows = [p + r for p, r in zip(prompts, responses, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r, dtype=torch.long)
        attn[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(r, dtype=torch.long)
    return SFTBatch(input_ids=ids, attention_mask=attn, labels=labels)


def sft_loss(model: torch.nn.Module, batch: SFTBatch) -> Tensor:
    """Mean cross-entropy over the batch's response tokens (float32)."""
    device = next(model.parameters()).device
    out = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        use_cache=False,
    )
    logits = out.logits[:, :-1].float()
    target = batch.labels[:, 1:].to(device)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE
    )


class SFTDataModule(L.LightningDataModule):
    """Endless seeded batches of the train examples that have a reference: the RL
    ``PromptDataModule``'s prompts, length filter and resumable stream."""

    def __init__(self, prompts: PromptDataModule, batch_size: int) -> None:
        super().__init__()
        self.prompts = prompts
        self.batch_size = batch_size
        self.start_batch = 0
        self.train_examples: list[Example] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_examples is not None:
            return
        self.prompts.setup(stage)
        train = self.prompts.train_examples or []
        refs = [e for e in train if e.reference]
        if not refs:
            raise ValueError(
                f"stage=sft needs reference responses, but none of the {len(train)} train "
                f"examples of task '{self.prompts.task.name}' has one (Example.reference); "
                "pick a task that ships references or use stage=rl"
            )
        if len(refs) < len(train):
            log.warning(
                "sft: %d of %d train prompts have no reference", len(train) - len(refs), len(train)
            )
        self.train_examples = refs

    def heldout(self, n: int) -> list[Example]:
        """The first ``n`` prompts of the val split (length-filtered like the train split)."""
        if n <= 0:
            return []
        val = list(self.prompts.task.examples("val"))[: n * 2]
        return self.prompts._filter_length(val, "val")[:n]

    def train_dataloader(self) -> DataLoader:
        stream = PromptStream(
            self.train_examples, self.batch_size, self.prompts.seed, self.start_batch
        )
        return DataLoader(stream, batch_size=None, num_workers=0)

    def state_dict(self) -> dict:
        done = int(self.trainer.global_step) if self.trainer is not None else 0
        return {"next_batch": done, "seed": self.prompts.seed}

    def load_state_dict(self, state: dict) -> None:
        self.start_batch = int(state.get("next_batch", 0))


class SFTModule(L.LightningModule):
    """Supervised fine-tuning on references; see the module docstring for the contract."""

    def __init__(
        self, policy: torch.nn.Module, tokenizer, task: Task, cfg: SFTConfig | dict | None = None
    ) -> None:
        super().__init__()
        self.policy, self.tokenizer, self.task = policy, tokenizer, task
        # defaults, keys, types and ranges: mrtpo.run.settings.SFTConfig (a mapping is checked)
        cfg = SFTConfig.from_mapping(cfg)
        if cfg.target_metric is None:
            cfg = dataclasses.replace(cfg, target_metric=task.success_check or "success")
        self.cfg = cfg
        ids = eos_token_ids(tokenizer, policy)
        self.eos_id = int(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else ids[0])
        self.pad_id = int(tokenizer.pad_token_id)
        self._tok_cache: dict[str, tuple[list[int], list[int]]] = {}
        self._dm: SFTDataModule | None = None
        # Read by the shared sample/relevance callbacks (they find nothing to dump in SFT).
        self.last, self.iteration, self.seed = None, 0, 0

    # ---- wiring used by mrtpo.lightning.pipeline ------------------------------------------------
    def datamodule(self, prompts: PromptDataModule) -> SFTDataModule:
        self.seed = prompts.seed
        self._dm = SFTDataModule(prompts, self.cfg.batch_size)
        return self._dm

    def callbacks(self) -> list[L.Callback]:
        return [SFTTarget(self.cfg), SavePolicy(self.cfg.save_dir)]

    # ---- data --------------------------------------------------------------------------
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch

    def context(self, e: Example) -> list[dict]:
        """What the policy reads before the reference: the prompt, or for a fixed, seeded
        ``teacher_share`` of the examples the task's teacher context (where it has one)."""
        share = float(self.cfg.teacher_share)
        if share > 0 and zlib.crc32(f"{self.seed}:{e.id}".encode()) < share * 2**32:
            teacher = self.task.teacher_messages(e)
            if teacher is not None:
                return teacher
        return e.messages

    def encode(self, examples: Sequence[Example]) -> SFTBatch:
        for e in examples:
            if e.id not in self._tok_cache:
                self._tok_cache[e.id] = (
                    chat_ids(self.tokenizer, self.context(e)),
                    response_token_ids(self.tokenizer, e.reference or "", self.eos_id),
                )
        prompts, responses = zip(*(self._tok_cache[e.id] for e in examples), strict=True)
        return collate_sft(prompts, responses, self.pad_id)

    # ---- training ----------------------------------------------------------------------
    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        sched = linear_warmup(opt, self.cfg.warmup_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        if self.cfg.max_grad_norm:
            self.clip_gradients(optimizer, self.cfg.max_grad_norm, "norm")

    def training_step(self, batch, batch_idx: int) -> Tensor:
        sft = self.encode(batch.examples)
        loss = sft_loss(self.policy, sft)
        self.iteration = self.global_step + 1
        self.log_dict(
            {"sft/loss": loss.detach(), "sft/targets": float(sft.n_targets)},
            on_step=True,
            on_epoch=False,
            batch_size=len(batch.examples),
        )
        self.log("loss", loss.detach(), prog_bar=True, logger=False, batch_size=len(batch.examples))
        return loss

    @torch.no_grad()
    def heldout_loss(self, examples: Sequence[Example]) -> float:
        was = self.policy.training
        self.policy.eval()
        try:
            return float(sft_loss(self.policy, self.encode([e for e in examples if e.reference])))
        finally:
            self.policy.train(was)


def answer(
    policy: torch.nn.Module,
    tokenizer,
    examples: Sequence[Example],
    samples: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 32,
    seed: int = 0,
):
    """The policy's answers to ``examples`` with the HF engine: one each, greedy, at
    ``temperature`` 0; else ``samples`` each at that temperature (a ``RolloutBatch``)."""
    engine = HFEngine()
    eos = eos_token_ids(tokenizer, policy)
    engine.bind(policy, tokenizer, eos)
    greedy = temperature <= 0
    sampling = SamplingConfig(
        temperature=max(temperature, 1e-6), max_new_tokens=max_new_tokens, greedy=greedy
    )
    return build_rollout(engine, tokenizer, examples, 1 if greedy else samples, sampling, seed, eos)


class SFTTarget(L.Callback):
    """Every ``eval_every`` steps: held-out metrics; stop once the target rate is reached.
    ``target``, ``metric``, ``below``, ``every``, ``min_steps``: ``cfg``'s, as the step line
    (``console.StepLine``) reads them."""

    def __init__(self, cfg: SFTConfig) -> None:
        self.cfg, self.target, self.metric = cfg, cfg.target_success, cfg.target_metric
        self.below = cfg.stop_when == "below"
        self.every, self.min_steps = int(cfg.eval_every), int(cfg.min_steps)
        self.examples: list[Example] = []
        self.history: list[dict[str, float]] = []
        self.reached_at: int | None = None

    def on_fit_start(self, trainer, pl_module: SFTModule) -> None:
        dm = pl_module._dm
        if dm is None or self.cfg.eval_prompts <= 0:
            return
        self.examples = dm.heldout(self.cfg.eval_prompts)
        if self.target is not None and not self.examples:
            raise ValueError(
                f"stage.sft.target_success is set but task '{pl_module.task.name}' has no "
                "held-out (val) prompts to measure it on"
            )

    def evaluate(self, trainer, pl_module: SFTModule) -> dict[str, float]:
        """The task's metrics (``Task.summarize``) of the policy's held-out answers."""
        step = int(trainer.global_step)
        t0 = time.perf_counter()
        seed = pl_module.seed * 1_000_003 + step
        c = self.cfg
        sampling = (c.eval_samples, float(c.eval_temperature), c.eval_max_new_tokens, seed)
        roll = answer(pl_module.policy, pl_module.tokenizer, self.examples, *sampling)
        m, _ = evaluate_examples(pl_module.task, roll.examples, roll.texts)
        m["finished_frac"] = float(roll.finished.float().mean())
        if self.metric not in m:
            raise ValueError(
                f"stage.sft.target_metric={self.metric!r} is not a metric of task "
                f"'{pl_module.task.name}'; it reports {sorted(m)}"
            )
        m["loss"] = pl_module.heldout_loss(self.examples)
        m["time"] = time.perf_counter() - t0
        row = {"step": float(step), **{k: float(v) for k, v in m.items() if _is_num(v)}}
        self.history.append(row)
        # Straight to the loggers: one row per check (self.log from a callback would repeat
        # the last value on every later step).
        vals = {f"sft/val/{k}": v for k, v in row.items() if k != "step"}
        for lg in trainer.loggers:
            lg.log_metrics(vals, step=step)
        pl_module.log("val_success", m[self.metric], prog_bar=True, logger=False, batch_size=1)
        log.info(
            "sft step %d: held-out %s=%.3f loss=%.4f", step, self.metric, m[self.metric], m["loss"]
        )
        return m

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step)
        if not self.examples or step % self.every != 0 or step < self.min_steps:
            return
        m = self.evaluate(trainer, pl_module)
        value = m[self.metric]
        hit = self.target is not None and (
            value <= self.target if self.below else value >= self.target
        )
        hit = trainer.strategy.reduce_boolean_decision(bool(hit), all=True)
        if hit and self.reached_at is None:
            self.reached_at = step
            trainer.should_stop = True
            log.info(
                "sft: held-out %s %.3f %s stage.sft.target_success=%.3f at step %d: stopping",
                self.metric,
                value,
                "<=" if self.below else ">=",
                self.target,
                step,
            )

    def on_train_end(self, trainer, pl_module) -> None:
        if self.target is not None and self.reached_at is None:
            last = self.history[-1][self.metric] if self.history else float("nan")
            log.warning(
                "sft: stage.sft.target_success=%.3f was not reached in trainer.max_steps=%s "
                "steps (last held-out %s: %.3f); raise trainer.max_steps or stage.sft.lr",
                self.target,
                trainer.max_steps,
                self.metric,
                last,
            )

    def summary(self) -> dict[str, Any]:
        return {
            "target_metric": self.metric,
            "target_success": self.target,
            "stop_when": self.cfg.stop_when,
            "reached": self.reached_at is not None,
            "reached_at_step": self.reached_at,
            "eval": {
                "prompts": len(self.examples),
                "samples": self.cfg.eval_samples,
                "temperature": float(self.cfg.eval_temperature),
                "max_new_tokens": self.cfg.eval_max_new_tokens,
            },
            "history": self.history,
        }


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))


def _savable_generation_config(model) -> GenerationConfig | None:
    """The policy's generation config, or its token ids alone where ``save_pretrained`` refuses
    it (a loose one, e.g. ``top_k`` without ``do_sample``): the warm start never fails on a
    field SFT did not use; RL and evaluation build their own sampling settings."""
    own = getattr(model, "generation_config", None)
    if own is None:
        return None
    try:
        own.validate(strict=True)
        return own
    except ValueError as exc:
        log.warning(
            "sft: the starting model's generation config is not savable (%s); "
            "the saved policy keeps only its token ids",
            str(exc).splitlines()[0],
        )
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        return GenerationConfig(**{k: getattr(own, k, None) for k in ids})


class SavePolicy(L.Callback):
    """Save the warm-started policy (``save_pretrained``) and a JSON summary at the end."""

    FILE = "mrtpo_sft.json"

    def __init__(self, save_dir: str | None = None) -> None:
        self.save_dir = save_dir
        self.path: Path | None = None

    def on_train_end(self, trainer, pl_module: SFTModule) -> None:
        if not trainer.is_global_zero:
            return
        path = Path(self.save_dir or Path(trainer.default_root_dir) / "policy")
        path.mkdir(parents=True, exist_ok=True)
        save_model(pl_module.policy, path, _savable_generation_config(pl_module.policy))
        pl_module.tokenizer.save_pretrained(path)
        target = next((c for c in trainer.callbacks if isinstance(c, SFTTarget)), None)
        info: dict[str, Any] = {"steps": int(trainer.global_step), "task": pl_module.task.name}
        if target is not None:
            info.update(target.summary())
        (path / self.FILE).write_text(json.dumps(info, indent=2) + "\n")
        self.path = path
        log.info(
            "sft: saved the policy to %s; start RL from it with "
            "model.name_or_path=%s model.tiny=null",
            path,
            path,
        )


def read_summary(policy_dir: str | Path) -> dict[str, Any]:
    """The SFT summary saved next to a warm-started policy."""
    return json.loads((Path(policy_dir) / SavePolicy.FILE).read_text())
