"""The loss and what the trainer logs about it: clip fraction, per-update loss, TIS weights,
the engine-trainer gap; and that with TIS off the surrogate is the one it always was."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch

from mrtpo.core.batch import ScoredBatch, rewards_tensor
from mrtpo.core.credit.methods import GDPO
from mrtpo.core.forward import response_logprobs
from mrtpo.core.loss import engine_gap, policy_loss
from mrtpo.lightning.module import PolicyModule, _Host
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.rollout.hf import HFEngine
from mrtpo.run.settings import ConfigError, RLConfig
from mrtpo.step import MINIBATCH_STREAM, Advantages, OldPolicy
from mrtpo.tasks.synthetic.task import SyntheticTask


def _previous_policy_loss(logp, old, adv, mask, lo, hi, denom, ref=None, kl_coef=0.0):
    """The clipped surrogate as the trainer computed it before TIS existed (token-mean)."""
    ratio = torch.exp(logp - old)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - lo, 1.0 + hi) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if ref is not None and kl_coef > 0:
        d = ref - logp
        per_token = per_token + kl_coef * (torch.exp(d) - d - 1.0)
    return (per_token * mask.to(per_token.dtype)).sum() / denom


def _random_batch(seed=0, n=6, t=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand((n, t), generator=g) * 3
    old = logp + 0.4 * torch.randn((n, t), generator=g)
    adv = torch.randn((n, 1), generator=g).expand(n, t).contiguous()
    mask = torch.rand((n, t), generator=g) > 0.2
    ref = logp + 0.1 * torch.randn((n, t), generator=g)
    return logp, old, adv, mask, ref


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_without_tis_the_loss_is_bit_identical_to_the_previous_surrogate(kl_coef):
    logp, old, adv, mask, ref = _random_batch()
    logp.requires_grad_(True)
    want = _previous_policy_loss(logp, old, adv, mask, 0.2, 0.28, 17.0, ref, kl_coef)
    got, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        agg="token-mean",
        denom=17.0,
        ref_logp=ref,
        kl_coef=kl_coef,
    )
    assert torch.equal(got, want)
    (g_want,) = torch.autograd.grad(want, logp)
    (g_got,) = torch.autograd.grad(got, logp)
    assert torch.equal(g_got, g_want)


def test_tis_weights_multiply_the_surrogate_not_the_kl():
    logp, old, adv, mask, ref = _random_batch(1)
    w = torch.full_like(logp, 0.5)
    plain, _ = policy_loss(
        logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="token-mean", denom=11.0
    )
    half, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        agg="token-mean",
        denom=11.0,
        tis_weights=w,
    )
    torch.testing.assert_close(half, 0.5 * plain, rtol=1e-6, atol=0)
    zero = torch.zeros_like(adv)
    kl = dict(denom=11.0, ref_logp=ref, kl_coef=0.1)
    kl_only = policy_loss(
        logp,
        logp.detach(),
        zero,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        agg="token-mean",
        **kl,
        tis_weights=w,
    )[0]
    kl_plain = policy_loss(
        logp, logp.detach(), zero, mask, clip_low=0.2, clip_high=0.28, agg="token-mean", **kl
    )[0]
    assert torch.equal(kl_only, kl_plain)


def test_clip_frac_counts_tokens_whose_clipped_term_is_taken():
    # ratio = exp(logp - old); band [0.8, 1.28]
    ratios = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.0, 1.5]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, 0.0]])
    mask = torch.ones_like(ratios, dtype=torch.bool)
    logp = torch.zeros_like(ratios)
    old = -torch.log(ratios)
    _, st = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # active: ratio above the band with A > 0 (token 0), below it with A < 0 (token 3).
    # Outside the band with the unclipped term taken (tokens 1, 2) or A = 0 (token 5): not.
    assert float(st["clip_frac"]) == pytest.approx(2 / 6)


def test_engine_gap_and_tis_weights_against_an_offset_engine():
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand((4, 7), generator=g) * 4
    mask = torch.ones((4, 7), dtype=torch.bool)
    mask[1, 5:] = False
    mask[3, 2:] = False
    engine = trainer + 0.1
    stats, w = engine_gap(trainer, engine, mask, tis_cap=2.0)
    assert stats["rollout/logp_gap/mean"] == pytest.approx(0.1, abs=1e-6)
    assert stats["rollout/logp_gap/max"] == pytest.approx(0.1, abs=1e-6)
    lengths = mask.sum(-1).double()
    assert stats["rollout/seq_ratio/min"] == pytest.approx(math.exp(-0.1 * 7), rel=1e-5)
    assert stats["rollout/seq_ratio/max"] == pytest.approx(math.exp(-0.1 * 2), rel=1e-5)
    assert stats["rollout/seq_ratio/mean"] == pytest.approx(
        float(torch.exp(-0.1 * lengths).mean()), rel=1e-5
    )
    torch.testing.assert_close(w[mask], torch.full((int(mask.sum()),), math.exp(-0.1)))
    assert torch.equal(w[~mask], torch.zeros(int((~mask).sum())))
    assert stats["rollout/tis_capped_frac"] == 0.0
    # a cap below the ratio truncates every weight to the cap
    stats, w = engine_gap(trainer, engine, mask, tis_cap=0.5)
    assert torch.equal(w[mask], torch.full((int(mask.sum()),), 0.5))
    assert stats["rollout/tis_capped_frac"] == 1.0
    # TIS off: metrics only
    stats, w = engine_gap(trainer, engine, mask, None)
    assert w is None and "rollout/tis_weight/mean" not in stats


@pytest.mark.parametrize("cap", [0.0, -1.0])
def test_tis_cap_must_be_positive(cap):
    with pytest.raises(ConfigError, match=r"rl\.tis_cap"):
        RLConfig(tis_cap=cap)
    assert RLConfig(tis_cap=2.0).tis_cap == 2.0 and RLConfig().tis_cap is None


# ---- train/loss and train/clip_frac of a real update ----------------------------------------


class _FixedUpdate(PolicyModule):
    """Runs only the update phase of a step, on a batch the test fixed."""

    fixed: tuple[ScoredBatch, OldPolicy, Advantages]
    result: dict

    def training_step(self, batch, batch_idx):
        gen = self.step.generator(MINIBATCH_STREAM)
        self.result = self.step.updater(_Host(self), self.method, *self.fixed, gen).metrics


def test_logged_loss_and_clip_frac_match_a_hand_computation(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]  # the session's model stays untouched
    task = SyntheticTask()
    eos = [tok.eos_token_id]
    engine = HFEngine()
    engine.bind(model, tok, eos)
    tau = 0.7
    sampling = SamplingConfig(temperature=tau, max_new_tokens=10)
    roll = build_rollout(engine, tok, list(task.examples("train"))[:2], 4, sampling, 3, eos)
    n, t = roll.response_ids.shape
    assert n == 8
    scores = task.score_many(roll.examples, roll.texts)
    names = tuple(task.reward_names)
    scored = ScoredBatch(roll, scores, names, rewards_tensor(scores, names))
    mask = roll.response_mask
    model.eval()
    with torch.no_grad():
        logp = response_logprobs(
            model, roll.prompt_ids, roll.prompt_mask, roll.response_ids, mask, temperature=tau
        )
    # ratios far from the band's edges (1.65, 0.61, 0.90, 1.0), advantages of both signs
    g = torch.Generator().manual_seed(0)
    delta = torch.tensor([-0.5, 0.5, 0.1, 0.0])[torch.randint(0, 4, (n, t), generator=g)]
    old_logp = (logp + delta) * mask
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5, 1.0, -1.0])
    advantages = adv[:, None].expand(n, t) * mask

    module = _FixedUpdate(
        model,
        tok,
        task,
        GDPO(),
        rl={"mini_batch_size": 4, "micro_batch_size": 2, "ppo_epochs": 1, "max_grad_norm": None},
        # the parameters barely move, so every mini-batch sees the ones computed with here
        optim={"lr": 1e-12},
        seed=5,
    )
    module.fixed = (scored, OldPolicy(logp=old_logp), Advantages(advantages))
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=[0])
    got = module.result

    ratio = torch.exp(logp - old_logp)
    a = advantages
    unclipped, clipped = ratio * a, ratio.clamp(0.8, 1.28) * a
    per_token = -torch.minimum(unclipped, clipped)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5 * 104729 + 0))
    losses = []
    for s in (0, 4):  # 2 mini-batches of 4 responses (2 micro-batches of 2 each)
        mb = perm[s : s + 4]
        losses.append(float((per_token[mb] * mask[mb]).sum() / mask[mb].sum()))
    active = (clipped < unclipped) & mask
    assert 0 < int(active.sum()) < int(mask.sum())
    # the previous definition (ratio outside the band) would count more tokens
    outside = ((ratio < 0.8) | (ratio > 1.28)) & mask
    assert int(outside.sum()) > int(active.sum())
    assert got["loss"] == pytest.approx(sum(losses) / 2, abs=1e-6)
    assert got["clip_frac"] == pytest.approx(float(active.sum()) / float(mask.sum()), abs=1e-7)
    assert got["ratio_mean"] == pytest.approx(float(ratio[mask].mean()), abs=1e-5)
    assert got["lr"] == pytest.approx(1e-12)
