"""CoRT on the tiny model: replay gives it the sampled tokens' log-likelihood contrasts, and a
two-step training run replays, logs and spreads GRPO's advantage unevenly over tokens."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from mrtpo.core.batch import ScoredBatch, rewards_tensor
from mrtpo.core.chat import chat_ids
from mrtpo.core.credit import CoRT, grpo_advantages
from mrtpo.core.replay import Replayer
from mrtpo.lightning.pipeline import build, metrics_csv
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.rollout.hf import HFEngine
from mrtpo.tasks.synthetic.task import SyntheticTask


def _logp(model, tok, messages, response_ids: list[int]) -> torch.Tensor:
    """log p(y_t | messages, y_<t) of the given tokens: one unpadded forward, the obvious way."""
    ids = torch.tensor([chat_ids(tok, messages) + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    p = ids.shape[1] - len(response_ids)
    lp = torch.log_softmax(logits[p - 1 : p - 1 + len(response_ids)], -1)
    return lp.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def test_replay_gives_cort_the_contrast_against_the_criteria_free_prompt(tiny):
    model, tok = tiny
    model.eval()
    task = SyntheticTask(num_constraints=3)
    engine = HFEngine()
    eos = [tok.eos_token_id]
    engine.bind(model, tok, eos)
    roll = build_rollout(
        engine, tok, task.examples("train")[:2], 3, SamplingConfig(max_new_tokens=10), 0, eos
    )
    scores = task.score_many(roll.examples, roll.texts)
    scored = ScoredBatch(
        rollout=roll,
        scores=scores,
        reward_names=task.reward_names,
        rewards=rewards_tensor(scores, task.reward_names),
    )
    pairs = torch.zeros(roll.n, 1, dtype=torch.bool)
    pairs[::2] = True
    res = Replayer(tok, token_budget=64).run(model, task, scored, pairs, CoRT.relevance)
    assert torch.equal(res.replayed, pairs) and res.q.shape == (
        roll.n,
        1,
        roll.response_ids.shape[1],
    )
    for j in range(roll.n):
        n_tok = int(roll.response_mask[j].sum())
        if not pairs[j, 0]:
            assert torch.equal(res.q[j], torch.zeros_like(res.q[j]))
            continue
        y = roll.response_ids[j, :n_tok].tolist()
        ctx = task.contexts(roll.examples[j], scores[j])
        assert ctx.all == roll.examples[j].messages and ctx.none != ctx.all
        want = _logp(model, tok, ctx.all, y) - _logp(model, tok, ctx.none, y)
        torch.testing.assert_close(res.q[j, 0, :n_tok], want, atol=2e-5, rtol=0)
        assert bool((res.q[j, 0, n_tok:] == 0).all())
        assert float(want.abs().max()) > 0  # the constraints do move the tiny model


def test_two_training_steps(train_cfg):
    # warm-up of 1 step: step 0 is GRPO (beta 0, no replay), step 1 has the full weights
    cfg = train_cfg(
        "method=cort",
        "task=synthetic",
        "method.beta_warmup_steps=1",
        "rl.group_size=4",
        "rollout.sampling.temperature=1.0",
    )
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert module.iteration == 2 and trainer.global_step == 2
    with open(metrics_csv(trainer)) as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1"]
    first, last = rows
    assert float(first["train/adv/beta"]) == 0.0 and float(last["train/adv/beta"]) == 1.0
    share0 = first.get("train/replay/share") or "nan"
    assert math.isnan(float(share0)) or float(share0) == 0.0  # beta 0: nothing replayed
    assert float(last["train/replay/share"]) > 0
    assert float(last["train/adv/weight_max"]) > 1.0 > float(last["train/adv/weight_min"])
    assert (
        float(last["train/adv/weight_max"]) <= 4.0 and float(last["train/adv/weight_min"]) >= 0.25
    )

    scored = module.last  # step 1's batch
    mask = scored.rollout.response_mask
    adv = scored.advantages
    uneven = [
        j
        for j in range(adv.shape[0])
        if scored.replayed[j, 0] and int(mask[j].sum()) > 1 and adv[j][mask[j]].unique().numel() > 1
    ]
    assert uneven, "no replayed response got different advantages on different tokens"
    # per response, the mean token advantage is GRPO's
    ref = grpo_advantages(scored.rewards, scored.rollout.group, None, module.method.eps)
    per = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    torch.testing.assert_close(per, ref.to(per.dtype), atol=1e-5, rtol=0)


def test_cort_refuses_text_to_sql_at_start_up(train_cfg):
    with pytest.raises(ValueError, match=r"method=cort .*task=text2sql"):
        build(train_cfg("method=cort", "task=text2sql"))
