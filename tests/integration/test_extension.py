"""A new method, task, engine and stage, each defined here, train with nothing changed in src/.

This is the architecture's promise: each pluggable piece is one class behind one interface
plus a config node naming its ``_target_``. The toy method asks replay for its own kind of
relevance (the sampled token's log-likelihood difference on joint contexts); the task keeps its
information in the prompt; the engine implements only the two required methods; the stage
wraps RL and freezes the LM head. A second method distils from a frozen teacher, as OPSD
does, through the two generic hooks alone (no-grad inputs before the update, a token-loss term).
"""

from __future__ import annotations

import csv
import random

import torch
from omegaconf import OmegaConf, open_dict

from mrtpo.core.chat import chat_ids
from mrtpo.core.credit.advantages import grpo_advantages, replay_mask
from mrtpo.core.credit.methods import (
    AdvantageMethod,
    CreditInputs,
    CreditOutput,
    MethodServices,
    RelevanceRequest,
    StepView,
)
from mrtpo.core.forward import pad_left, response_logits, response_logprobs
from mrtpo.core.loss import aggregate
from mrtpo.lightning.pipeline import build
from mrtpo.lightning.stages import RLStage
from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig
from mrtpo.tasks.base import Contexts, Example, Score, Task

HERE = __name__  # the instance pytest imported, so SEEN is shared
SEEN: dict[str, list] = {"q": [], "prompts": [], "syncs": [], "bound": [], "extra": [], "loss": []}


class SignedRelevanceMethod(AdvantageMethod):
    """GRPO's advantage, each token scaled by 1 + tanh(log p(y|P_all) - log p(y|P_none))."""

    config_name = "signed_relevance"
    relevance = RelevanceRequest(contexts="joint", score="logp_diff")

    def replay_pairs(self, rewards, group, has_block):
        return replay_mask(rewards, group, has_block).any(-1, keepdim=True)

    def beta(self, step: int) -> float:
        return 1.0

    def __call__(self, inputs: CreditInputs) -> CreditOutput:
        k = inputs.rewards.shape[1]
        adv = grpo_advantages(inputs.rewards, inputs.group, torch.ones(k), 1e-4)
        scale = torch.ones(inputs.mask.shape)
        if inputs.q is not None:
            SEEN["q"].append((inputs.q.clone(), inputs.replayed.clone()))
            scale = 1.0 + torch.tanh(inputs.q[:, 0])
        tok = adv[:, None] * scale * inputs.mask
        return CreditOutput(tok, {"scale_mean": float(scale[inputs.mask].mean())})


class HintedTeacherMethod(AdvantageMethod):
    """Self-distillation in the manner of OPSD: GRPO's advantage plus coef x KL(student ||
    teacher) per token, the teacher being the frozen initial policy reading a hint first."""

    config_name = "hinted_teacher"
    wants_logits = True
    HINT = {"role": "system", "content": "Answer in one short word."}

    def __init__(self, coef: float = 0.5) -> None:
        self.coef = coef

    def setup(self, task, services: MethodServices | None = None) -> None:
        super().setup(task, services)
        if services is None:  # validation only, before the model loads
            return
        self.teacher, adapters_off = services.frozen_policy()
        self.tokenizer = services.tokenizer
        SEEN["bound"].append((self.teacher, adapters_off))

    def _context(self, batch):
        ctx = [chat_ids(self.tokenizer, [self.HINT, *e.messages]) for e in batch.examples]
        return pad_left(ctx, self.tokenizer.pad_token_id)

    def score_inputs(self, view: StepView):
        """Before the update: the teacher's log-prob of each sampled token (no grad)."""
        roll = view.rollout
        with torch.no_grad():
            t = response_logprobs(
                self.teacher, *self._context(roll), roll.response_ids, roll.response_mask
            )
        return t - view.student_logp()

    def token_loss(self, logits, batch, temperature, agg, denom, device=None):
        with torch.no_grad():
            t_logits = response_logits(
                self.teacher, *self._context(batch), batch.response_ids, batch.response_mask
            )
        s_lp = torch.log_softmax(logits.float() / temperature, -1)
        t_lp = torch.log_softmax(t_logits.float() / temperature, -1)
        kl = (s_lp.exp() * (s_lp - t_lp)).sum(-1)
        mask = batch.response_mask.to(kl.device)
        SEEN["loss"].append((tuple(logits.shape), logits.requires_grad))
        return self.coef * aggregate(kl, mask, agg, denom), {
            "distill_kl": float(kl.detach()[mask].mean())
        }

    def __call__(self, inputs: CreditInputs) -> CreditOutput:
        SEEN["extra"].append(inputs.extra)
        k = inputs.rewards.shape[1]
        adv = grpo_advantages(inputs.rewards, inputs.group, torch.ones(k), 1e-4)
        return CreditOutput(adv[:, None] * inputs.mask, {})


class LengthRulesTask(Task):
    """Two in-prompt instructions, each with its own reward."""

    name = "length_rules"
    reward_names = ("even", "short")
    info_in_prompt = True
    success_check = "success"
    RULES = {"even": "Use an even number of characters.", "short": "Use under 6 characters."}

    def _messages(self, keys) -> list[dict[str, str]]:
        text = " ".join(["Reply to the user."] + [self.RULES[k] for k in keys])
        return [{"role": "user", "content": text}]

    def examples(self, split: str):
        return [
            Example(id=f"{split}-{i}", messages=self._messages(self.reward_names))
            for i in range(16)
        ]

    def score(self, example: Example, response: str) -> Score:
        r = {"even": float(len(response) % 2 == 0), "short": float(len(response) < 6)}
        return Score(rewards=r, checks={"success": all(v == 1.0 for v in r.values())})

    def contexts(self, example: Example, score: Score) -> Contexts:
        names = self.reward_names
        return Contexts(
            all=self._messages(names),
            without={k: self._messages([j for j in names if j != k]) for k in names},
            none=self._messages([]),
        )


class RandomTokenEngine(RolloutEngine):
    """Samples uniform token ids; implements only ``generate`` and ``sync_weights``."""

    def __init__(self, low: int = 3, high: int = 200) -> None:
        self.low, self.high = low, high

    def generate(self, prompts, n: int, sampling: SamplingConfig, seed: int):
        SEEN["prompts"].append(len(prompts))
        rng = random.Random(seed)
        out = []
        for _ in range(len(prompts) * n):
            length = rng.randint(1, sampling.max_new_tokens)
            out.append(
                Generation([rng.randrange(self.low, self.high) for _ in range(length)], False)
            )
        return out

    def sync_weights(self, model) -> None:
        SEEN["syncs"].append(1)


class FrozenHeadRL(RLStage):
    """RL with the LM head (tied to the embeddings in the tiny model) frozen."""

    name = "frozen_head_rl"

    def build(self, cfg, policy, tokenizer, task, prompts):
        policy.get_output_embeddings().weight.requires_grad_(False)
        return super().build(cfg, policy, tokenizer, task, prompts)


def test_new_method_task_engine_and_stage_train_without_touching_src(train_cfg, tmp_path):
    for v in SEEN.values():
        v.clear()
    cfg = train_cfg(f"paths.output_dir={tmp_path}/run", "callbacks.model_checkpoint=null")
    with open_dict(cfg):
        cfg.method = OmegaConf.create({"_target_": f"{HERE}.SignedRelevanceMethod"})
        cfg.task = OmegaConf.create({"_target_": f"{HERE}.LengthRulesTask"})
        cfg.rollout.engine = OmegaConf.create({"_target_": f"{HERE}.RandomTokenEngine"})
        cfg.stage = OmegaConf.create({"_target_": f"{HERE}.FrozenHeadRL"})
    trainer, module, dm = build(cfg)
    head = module.policy.get_output_embeddings().weight.detach().clone()
    body = {k: v.detach().clone() for k, v in module.policy.named_parameters() if v.requires_grad}
    trainer.fit(module, datamodule=dm)

    assert trainer.global_step == 2
    assert SEEN["prompts"] == [2, 2] and len(SEEN["syncs"]) >= 2  # the engine sampled, was synced
    # replay computed the requested score: signed log-likelihood differences on [N, 1, T]
    assert SEEN["q"], "replay never ran"
    q, replayed = SEEN["q"][0]
    assert q.shape[1] == 1 and replayed.shape[1] == 1 and bool(replayed.any())
    vals = q[replayed[:, 0], 0]
    assert bool((vals != 0).any()) and bool((vals < 0).any())  # signed, not a distance
    # the stage froze the head; the rest trained
    assert torch.equal(module.policy.get_output_embeddings().weight, head)
    changed = [
        k for k, v in module.policy.named_parameters() if k in body and not torch.equal(v, body[k])
    ]
    assert changed
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"train/reward/even/mean", "train/reward/short/mean", "train/success"} <= set(rows[0])
    assert float(rows[-1]["train/replay/share"]) > 0


def test_a_teacher_distilling_method_plugs_in_through_the_hooks(train_cfg, tmp_path):
    for v in SEEN.values():
        v.clear()
    cfg = train_cfg(
        f"paths.output_dir={tmp_path}/run",
        "callbacks.model_checkpoint=null",
        "rl.micro_batch_size=2",
    )
    with open_dict(cfg):
        cfg.method = OmegaConf.create({"_target_": f"{HERE}.HintedTeacherMethod", "coef": 0.5})
    trainer, module, dm = build(cfg)
    # bound once, with a frozen copy of the initial policy (not the policy itself)
    assert len(SEEN["bound"]) == 1
    teacher, adapters_off = SEEN["bound"][0]
    assert teacher is not module.policy and not adapters_off
    assert not any(p.requires_grad for p in teacher.parameters())
    start = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    trainer.fit(module, datamodule=dm)

    assert trainer.global_step == 2
    # the no-grad inputs arrived with the advantages, one [N, T] tensor per step; the teacher
    # reads a hint the student does not, so they are not all zero
    assert len(SEEN["extra"]) == 2
    n, t = module.last.rollout.response_ids.shape
    assert all(e.shape == (n, t) for e in SEEN["extra"])
    assert bool((SEEN["extra"][0] != 0).any())
    # the token loss saw the policy's logits, with gradient, in every micro-batch
    assert len(SEEN["loss"]) == 2 * (-(-n // 2))
    assert all(shape[0] <= 2 and shape[-1] > 100 and grad for shape, grad in SEEN["loss"])
    # the student trained; the teacher kept the initial weights and is not checkpointed
    assert any(not torch.equal(v, start[k]) for k, v in module.policy.state_dict().items())
    assert all(torch.equal(v, start[k]) for k, v in teacher.state_dict().items())
    assert not any(k.startswith("method") for k in module.state_dict())
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(float(r["train/distill_kl"]) > 0 for r in rows)
