"""The loss on a stale batch (issue 39, docs/method.md "Stale samples").

A batch sampled by older weights than the trainer's is trained on with decoupled PPO's
objective: the ratio against pi_old (the trainer's weights at the step's start) is clipped,
and each token's term is weighted by min(pi_old / pi_behaviour, cap), pi_behaviour being the
engine's sampling log-probs. The step's gradient is checked against that objective written
out independently (one unpadded forward per response, autograd), and a batch of staleness 0
against today's step, bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mrtpo.core.models import eos_token_ids
from mrtpo.lightning.pipeline import build
from mrtpo.rollout.source import RolloutSource

CAP = 1.5


class GradHost:
    """An ``UpdateHost`` that keeps the gradient of the (one) update and changes nothing."""

    def __init__(self, policy) -> None:
        self.params = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        self.grads: dict[str, torch.Tensor] = {}

    def zero_grad(self) -> None:
        for _, p in self.params:
            p.grad = None

    def backward(self, loss) -> None:
        loss.backward()

    def clip_gradients(self, max_norm: float) -> None:
        raise AssertionError("the test runs without gradient clipping")

    def optimizer_step(self, counted: bool) -> None:
        assert not self.grads, "one update per step in this test"
        self.grads = {n: p.grad.detach().clone() for n, p in self.params if p.grad is not None}

    def lr(self) -> float:
        return 1.0

    def end_step(self) -> None:
        pass

    def skip_step(self) -> None:
        raise AssertionError("the step was skipped")


@pytest.fixture
def parts(train_cfg):
    cfg = train_cfg(
        "method=grpo",
        "rl.prompts_per_step=2",
        "rl.group_size=4",
        "rl.mini_batch_size=64",
        "rl.max_grad_norm=null",
        f"rl.stale_tis_cap={CAP}",
        "rollout.sampling.max_new_tokens=8",
    )
    trainer, module, dm = build(cfg)
    [callback] = [c for c in trainer.callbacks if hasattr(c, "source")]
    source: RolloutSource = callback.source
    policy = module.policy
    source.bind(policy, module.tokenizer, eos_token_ids(module.tokenizer, policy))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    policy.train()
    roll = source.sample(batch.examples, 1234)
    assert roll.engine_logp is not None
    return module, roll


def _step(module, roll):
    host = GradHost(module.policy)
    module.step.iteration = 3
    result = module.step.run(roll, host)
    assert result.skipped is None
    return result, host.grads


def _behaviour(roll) -> torch.Tensor:
    """Engine log-probs as an older policy would give them: the sampled ones moved by a fixed
    pattern of up to +-0.9 nats, so that some weights pass the cap and some are below 1."""
    g = torch.Generator().manual_seed(0)
    shift = (torch.rand(roll.engine_logp.shape, generator=g) - 0.5) * 1.8
    return (roll.engine_logp + shift) * roll.response_mask


def _reference_grads(module, roll, advantages, behaviour) -> dict[str, torch.Tensor]:
    """The decoupled objective, written out: each response alone (no padding), at the
    sampling temperature, token-mean over the batch's valid tokens."""
    policy, tau = module.policy, roll.temperature
    total = roll.response_mask.sum()
    loss = 0.0
    for i in range(roll.n):
        p = roll.prompt_ids[i][roll.prompt_mask[i]]
        r = roll.response_ids[i][roll.response_mask[i]]
        ids = torch.cat([p, r])[None]
        logits = policy(input_ids=ids).logits[0, len(p) - 1 : -1].float() / tau
        logp = torch.log_softmax(logits, -1).gather(-1, r[:, None]).squeeze(-1)
        prox = logp.detach()
        w = torch.exp(prox - behaviour[i, : len(r)]).clamp(max=CAP)
        ratio = torch.exp(logp - prox)
        a = advantages[i, : len(r)]
        rl = module.step.rl
        clipped = ratio.clamp(1 - rl.clip_low, 1 + rl.clip_high) * a
        loss = loss + (-(w * torch.minimum(ratio * a, clipped))).sum()
    loss = loss / total
    policy.zero_grad()
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}


def test_a_stale_batch_gets_decoupled_ppo_gradients(parts):
    module, roll = parts
    behaviour = _behaviour(roll)
    stale = dataclasses.replace(roll, engine_logp=behaviour, versions=torch.full((roll.n,), 1))
    result, grads = _step(module, stale)
    m = result.metrics
    assert m["train/rollout/staleness/mean"] == m["train/rollout/staleness/max"] == 2.0
    # the gap of a stale batch is logged apart: it holds the staleness, not only numerics
    assert "train/rollout/stale/logp_gap/mean" in m
    assert not any(k.startswith("train/rollout/logp_gap") for k in m)
    capped = m["train/rollout/stale/tis_capped_frac"]
    assert 0.0 < capped < 1.0, "the pattern must put some weights past the cap"
    want = _reference_grads(module, roll, result.record.advantages, behaviour)
    assert sorted(grads) == sorted(want)
    for n in want:
        assert torch.allclose(grads[n], want[n], rtol=1e-4, atol=1e-7), (
            n,
            float((grads[n] - want[n]).abs().max()),
        )
    # and the weights matter: without them the gradient is another one
    plain = _reference_grads(module, roll, result.record.advantages, roll.engine_logp * 0 - 1e9)
    assert any(not torch.allclose(grads[n], plain[n], rtol=1e-3) for n in want)


def test_staleness_zero_is_todays_step_exactly(parts):
    module, roll = parts
    base, base_grads = _step(module, roll)  # no versions: today's step
    fresh = dataclasses.replace(roll, versions=torch.full((roll.n,), 3))
    same, grads = _step(module, fresh)
    assert same.metrics["train/rollout/staleness/max"] == 0.0
    for n in base_grads:
        assert torch.equal(grads[n], base_grads[n]), n
    for k, v in base.metrics.items():
        if not k.startswith("train/time/") and k != "train/tokens_per_s":
            assert same.metrics[k] == v or (v != v and same.metrics[k] != same.metrics[k]), k
    assert "train/rollout/logp_gap/mean" in same.metrics
