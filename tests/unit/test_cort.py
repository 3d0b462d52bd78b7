"""CoRT (reconstructed, mrtpo.core.credit.cort): weights, GRPO at β = 0, schedule, replay pairs,
the task check and the configs. Expected values are worked out by hand in the comments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tests.conftest import compose_config

from mrtpo.core.credit import GRPO, CoRT, CreditInputs, RelevanceRequest, cort_weights
from mrtpo.core.credit.advantages import grpo_advantages
from mrtpo.core.credit.methods import RewardSet

CONFIG = Path(__file__).resolve().parents[2] / "configs"
NAN = float("nan")


def _inputs(seed: int = 0, step: int = 0, n: int = 12, k: int = 3, t: int = 9) -> CreditInputs:
    """Random binary rewards (some absent), groups of 4, ragged masks, signed contrasts."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (n, k), generator=gen).float()
    rewards[torch.rand(n, k, generator=gen) < 0.15] = NAN
    group = torch.arange(n) // 4
    mask = torch.arange(t)[None] < torch.randint(1, t + 1, (n, 1), generator=gen)
    q = 3.0 * torch.randn(n, 1, t, generator=gen)
    m = CoRT()
    m.setup(RewardSet(tuple(f"c{i}" for i in range(k)), info_in_prompt=True))
    replayed = m.replay_pairs(rewards, group, ~rewards.isnan())
    return CreditInputs(rewards, group, mask, step=step, q=q, replayed=replayed)


# ---- weights ---------------------------------------------------------------------------------
def test_weights_by_hand() -> None:
    # clip 2, max_weight 4: |d| = 0, 1, 3, 0.5 -> u = 0, 0.5, 1, 0.25 -> v = 1, 2.5, 4, 1.75;
    # mean(v) = 9.25 / 4 = 37/16, so w~ = v * 16/37 = 16/37, 40/37, 64/37, 28/37 (sum 4).
    d = torch.tensor([[[0.0, 1.0, -3.0, 0.5, 9.0]]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    w = cort_weights(d, mask, None, beta=1.0, contrast_clip=2.0, max_weight=4.0)
    want = torch.tensor([[16 / 37, 40 / 37, 64 / 37, 28 / 37, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(w, want, rtol=0, atol=1e-15)
    # β = 0.5 mixes with the uniform weight: 1/2 + w~/2
    w = cort_weights(d, mask, None, beta=0.5, contrast_clip=2.0, max_weight=4.0)
    want = [[0.5 + 8 / 37, 0.5 + 20 / 37, 0.5 + 32 / 37, 0.5 + 14 / 37, 1.0]]
    torch.testing.assert_close(w, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)


def test_sign_of_the_contrast_does_not_matter() -> None:
    d = torch.tensor([[0.3, -1.2, 2.5, -0.1]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert torch.equal(cort_weights(d, mask, None, 1.0), cort_weights(-d, mask, None, 1.0))


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.1])
@pytest.mark.parametrize("max_weight", [1.0, 2.0, 4.0, 10.0])
def test_weights_average_one_and_stay_in_bounds(beta: float, max_weight: float) -> None:
    gen = torch.Generator().manual_seed(3)
    n, t = 40, 50
    d = torch.randn(n, 1, t, generator=gen, dtype=torch.float64) * 4.0
    d[:5] = 0.0  # no token depends on the rubric: uniform weights
    d[5:10, 0, 1:] = 0.0  # a single token does, saturated: the largest weight possible
    d[5:10, 0, 0] = -5.0
    mask = torch.arange(t)[None] < torch.randint(1, t + 1, (n, 1), generator=gen)
    mask[5:10] = True
    w = cort_weights(d, mask, None, beta, contrast_clip=2.0, max_weight=max_weight)
    mean = (w * mask).sum(-1) / mask.sum(-1)
    torch.testing.assert_close(mean, torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-12)
    lo, hi = (1 - beta) + beta / max_weight, (1 - beta) + beta * max_weight
    assert bool((w[mask] >= lo - 1e-12).all()) and bool((w[mask] <= hi + 1e-12).all())
    assert torch.equal(w[:5][mask[:5]], torch.ones_like(w[:5][mask[:5]]))
    # one saturated token among 50: v = (max_weight, 1, ..., 1) / mean, below the bound
    top = max_weight / ((max_weight + t - 1) / t)
    want = torch.full((5,), (1 - beta) + beta * top, dtype=torch.float64)
    torch.testing.assert_close(w[5:10, 0], want, rtol=0, atol=1e-12)
    assert torch.equal(w[~mask], torch.ones_like(w[~mask]))


def test_not_replayed_and_empty_responses_keep_weight_one() -> None:
    d = torch.tensor([[[1.0, 2.0, 0.0]], [[5.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    replayed = torch.tensor([[True], [False], [True]])
    w = cort_weights(d, mask, replayed, 1.0)
    assert not torch.equal(w[0], torch.ones(3))
    assert torch.equal(w[1:], torch.ones(2, 3))


def test_bad_knobs_name_the_key() -> None:
    for kwargs, key in (
        ({"beta": 1.5}, "method.beta"),
        ({"beta_warmup_steps": -1}, "method.beta_warmup_steps"),
        ({"contrast_clip": 0.0}, "method.contrast_clip"),
        ({"max_weight": 0.5}, "method.max_weight"),
        ({"eps": -1.0}, "method.eps"),
    ):
        with pytest.raises(ValueError, match=key):
            CoRT(**kwargs)


# ---- advantages ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_zero_beta_is_grpo_bit_for_bit(seed: int) -> None:
    inputs = _inputs(seed)
    grpo = GRPO(reward_weights={"c1": 2.0})
    grpo.setup(RewardSet(("c0", "c1", "c2"), False))
    ref = grpo(inputs).advantages
    for m in (CoRT(beta=0.0, reward_weights={"c1": 2.0}),  # β = 0 outright
              CoRT(beta=1.0, beta_warmup_steps=10, reward_weights={"c1": 2.0})):  # fmt: skip
        m.setup(RewardSet(("c0", "c1", "c2"), info_in_prompt=True))
        assert m.beta(inputs.step) == 0.0
        assert torch.equal(m(inputs).advantages, ref)  # contrasts given, schedule at 0
    nothing = CreditInputs(inputs.rewards, inputs.group, inputs.mask, step=50)
    m = CoRT(reward_weights={"c1": 2.0})
    m.setup(RewardSet(("c0", "c1", "c2"), info_in_prompt=True))
    assert torch.equal(m(nothing).advantages, ref)  # nothing replayed


def test_advantage_is_grpo_times_weight_by_hand() -> None:
    # One group of two: summed rewards 1 and 0 -> mean 1/2, unbiased std sqrt(1/2), so
    # A = +-(1/2) / (sqrt(1/2) + eps).
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    group = torch.tensor([0, 0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    d = torch.tensor([[[0.0, 2.0, -4.0]], [[-3.0, 0.0, 7.0]]], dtype=torch.float64)
    m = CoRT(beta=1.0, beta_warmup_steps=0, contrast_clip=2.0, max_weight=4.0)
    m.setup(RewardSet(("a", "b"), info_in_prompt=True))
    replayed = m.replay_pairs(rewards, group, torch.ones(2, 2, dtype=torch.bool))
    assert replayed.tolist() == [[True], [True]]
    out = m(CreditInputs(rewards, group, mask, step=0, q=d, replayed=replayed))
    a = 0.5 / (0.5**0.5 + 1e-4)
    # response 0: u = 0, 1, 1 -> v = 1, 4, 4, mean 3 -> w = 1/3, 4/3, 4/3
    # response 1 (2 tokens): u = 1, 0 -> v = 4, 1, mean 5/2 -> w = 8/5, 2/5; pad -> 0
    want = [[a / 3, 4 * a / 3, 4 * a / 3], [-8 * a / 5, -2 * a / 5, 0.0]]
    torch.testing.assert_close(
        out.advantages, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-14
    )
    # the response's mean token advantage is GRPO's; the sign is kept on every token
    per = out.advantages.sum(-1) / mask.sum(-1)
    torch.testing.assert_close(per, grpo_advantages(rewards, group), rtol=0, atol=1e-14)
    assert out.stats["beta"] == 1.0 and out.stats["replayed_share"] == 1.0
    assert out.stats["weight_max"] == pytest.approx(8 / 5)
    assert out.stats["weight_min"] == pytest.approx(1 / 3)
    assert out.stats["contrast_abs_mean"] == pytest.approx((0 + 2 + 4 + 3 + 0) / 5)


@pytest.mark.parametrize("seed", range(3))
def test_mean_token_advantage_is_grpos(seed: int) -> None:
    inputs = _inputs(seed, step=100)
    m = CoRT()
    m.setup(RewardSet(("c0", "c1", "c2"), info_in_prompt=True))
    out = m(inputs)
    mask = inputs.mask
    per = (out.advantages * mask).sum(-1) / mask.sum(-1)
    torch.testing.assert_close(
        per, grpo_advantages(inputs.rewards, inputs.group), atol=1e-5, rtol=0
    )
    assert torch.equal(out.advantages[~mask], torch.zeros_like(out.advantages[~mask]))
    adv = grpo_advantages(inputs.rewards, inputs.group)[:, None].expand_as(mask)
    assert bool((out.advantages[mask] * adv[mask] >= 0).all())  # weights > 0: signs kept
    moved = inputs.replayed[:, 0] & (mask.sum(-1) > 1)
    assert not torch.equal(out.advantages[moved], adv[moved] * mask[moved])


def test_wrong_relevance_shape_is_an_error() -> None:
    inputs = _inputs(0, step=100)
    inputs.q = inputs.q.expand(-1, 3, -1)
    m = CoRT()
    m.setup(RewardSet(("c0", "c1", "c2"), info_in_prompt=True))
    with pytest.raises(ValueError, match=r"cort expects .* \[N=12, 1, T\]"):
        m(inputs)


# ---- schedule, replay pairs, interface ---------------------------------------------------------
def test_smoothstep_schedule() -> None:
    # beta * (3u^2 - 2u^3), u = step / 4: 0, 5/32, 1/2, 27/32, 1, then flat
    m = CoRT(beta=1.0, beta_warmup_steps=4)
    assert [m.beta(s) for s in range(6)] == [0.0, 0.15625, 0.5, 0.84375, 1.0, 1.0]
    half = CoRT(beta=0.5, beta_warmup_steps=4)
    assert [half.beta(s) for s in range(6)] == [0.0, 0.078125, 0.25, 0.421875, 0.5, 0.5]
    assert CoRT(beta=0.7, beta_warmup_steps=0).beta(0) == 0.7


def test_replay_pairs_follow_grpos_summed_reward() -> None:
    rewards = torch.tensor(
        [
            [1.0, 0.0], [0.0, 1.0],  # group 0: the sums are equal (1, 1): A = 0, no replay
            [1.0, 0.0], [0.0, 0.0],  # group 1: the sums differ
            [NAN, 1.0], [0.0, 0.0],  # group 2: absent counts as 0 in GRPO's sum -> differ
            [NAN, NAN], [1.0, 1.0],  # group 3: no reward for the first: nothing to replay
        ]
    )  # fmt: skip
    group = torch.arange(8) // 2
    has = ~rewards.isnan()
    m = CoRT()
    m.setup(RewardSet(("a", "b"), info_in_prompt=True))
    got = m.replay_pairs(rewards, group, has)
    assert got.shape == (8, 1)
    assert got[:, 0].tolist() == [False, False, True, True, True, True, False, True]
    weighted = CoRT(reward_weights={"b": 2.0})  # sums 1, 2 in group 0 now differ
    weighted.setup(RewardSet(("a", "b"), info_in_prompt=True))
    assert weighted.replay_pairs(rewards, group, has)[:2, 0].tolist() == [True, True]


def test_relevance_request() -> None:
    assert CoRT.relevance == RelevanceRequest(contexts="joint", score="logp_diff")


def test_config_defaults_are_the_documented_ones() -> None:
    m = instantiate(OmegaConf.load(CONFIG / "method" / "cort.yaml"))
    assert isinstance(m, CoRT)
    assert (m.beta_max, m.beta_warmup_steps, m.contrast_clip, m.max_weight, m.eps) == (
        1.0, 30, 2.0, 4.0, 1e-4,
    )  # fmt: skip
    text = (CONFIG.parent / "docs" / "method.md").read_text()
    assert "reconstruction decision" in text.lower()
    for value in ("30", "2 nats", "[1/4, 4]"):
        assert value in text.split("## CoRT")[1], value


# ---- tasks --------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["text2sql", "toolcall"])
def test_refuses_tasks_without_the_rubric_in_the_prompt(task: str) -> None:
    cfg = compose_config("train.yaml", [f"task={task}", "method=cort"])
    with pytest.raises(ValueError, match=rf"method=cort .* task={task} .*info_in_prompt=False"):
        instantiate(cfg.method).setup(instantiate(cfg.task))


@pytest.mark.parametrize("task", ["ifeval", "synthetic"])
def test_accepts_tasks_with_the_rubric_in_the_prompt(task: str) -> None:
    cfg = compose_config("train.yaml", [f"task={task}", "method=cort"])
    t = instantiate(cfg.task)
    m = instantiate(cfg.method)

    m.setup(t)


def test_start_up_fails_before_the_model_loads(tmp_path) -> None:
    from mrtpo.lightning.pipeline import build

    cfg = compose_config(
        "train.yaml",
        ["task=text2sql", "method=cort", f"paths.output_dir={tmp_path}", "print_config=false",
         "model.name_or_path=/nonexistent/model"],
    )  # fmt: skip
    with pytest.raises(ValueError, match="method=cort needs a task whose rubric"):
        build(cfg)


def test_ifeval_preset_is_the_ifeval_setting_with_cort() -> None:
    cort = compose_config("train.yaml", ["experiment=ifeval_cort_qwen25_7b"])
    base = compose_config("train.yaml", ["experiment=ifeval_qwen25_7b"])
    assert cort.method._target_ == "mrtpo.core.credit.cort.CoRT"
    a, b = (OmegaConf.to_container(c, resolve=False) for c in (cort, base))
    for key in ("method", "hydra"):  # hydra: the choice and override names
        a.pop(key), b.pop(key)
    assert a == b


def test_relevance_dumps_use_cort_weights_not_mrtpo_weights():
    """The relevance dump asks the method for its weights: CoRT's come from the contrasts."""
    from mrtpo.core.credit.cort import CoRT, cort_weights
    from mrtpo.core.credit.relevance import relevance_weights

    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 1, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    replayed = torch.tensor([[True], [True], [False], [True]])
    method = CoRT(beta=1.0, beta_warmup_steps=0)
    got = method.token_weights(q, mask, replayed, step=5)
    want = cort_weights(q, mask, replayed, 1.0, method.contrast_clip, method.max_weight)
    assert torch.equal(got[:, 0], want)
    assert not torch.allclose(got, relevance_weights(q.abs(), mask, replayed, 1.0))
