"""Group normalization, GRPO, GDPO, SAW and the replay mask on hand-computed batches."""

from __future__ import annotations

import math

import pytest
import torch

from mrtpo.core.credit import (
    gdpo_advantages,
    group_advantages,
    grpo_advantages,
    replay_mask,
    saw_weights,
)

NAN = float("nan")

# Two groups of three responses, two rewards ("a", "b").
#   group 0: a = 0, 1, 2   (mean 1, unbiased std 1)      b = 1, 1, 1 (all equal -> 0)
#   group 1: a = 3, 3, NaN (two equal present values -> 0) b = 0, 2, 4 (mean 2, std 2)
REWARDS = torch.tensor([[0.0, 1.0], [1.0, 1.0], [2.0, 1.0], [3.0, 0.0], [3.0, 2.0], [NAN, 4.0]])
GROUP = torch.tensor([0, 0, 0, 1, 1, 1])


def test_group_advantages_hand_example() -> None:
    adv = group_advantages(REWARDS, GROUP, eps=0.0)
    expected = torch.tensor(
        [[-1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, -1.0], [0.0, 0.0], [0.0, 1.0]]
    )
    assert torch.equal(adv, expected)


def test_group_advantages_eps_in_denominator() -> None:
    eps = 1e-4
    adv = group_advantages(REWARDS, GROUP, eps=eps)
    assert adv[2, 0].item() == pytest.approx(1.0 / (1.0 + eps), rel=1e-6)
    assert adv[5, 1].item() == pytest.approx(2.0 / (2.0 + eps), rel=1e-6)


def test_group_advantages_unbiased_std_hand_example() -> None:
    # [1, 0, 0]: mean 1/3, unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3.
    adv = group_advantages(torch.tensor([[1.0], [0.0], [0.0]]), torch.zeros(3), eps=0.0)
    sd = math.sqrt(1 / 3)
    assert adv[:, 0].tolist() == pytest.approx([(2 / 3) / sd, -(1 / 3) / sd, -(1 / 3) / sd])


def test_group_ids_need_not_be_contiguous() -> None:
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    ref = group_advantages(REWARDS, GROUP)
    got = group_advantages(REWARDS[perm], GROUP[perm] * 7 + 3)
    assert torch.equal(got, ref[perm])


def test_all_equal_values_give_exact_zero() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point; the advantage must still be exactly 0.
    r = torch.tensor([[0.1], [0.1], [0.1]], dtype=torch.float64)
    assert torch.equal(group_advantages(r, torch.zeros(3)), torch.zeros(3, 1, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_edge_cases_never_nan(dtype: torch.dtype) -> None:
    all_nan = torch.full((4, 3), NAN, dtype=dtype)
    g = torch.tensor([0, 0, 1, 1])
    for out in (
        group_advantages(all_nan, g),
        grpo_advantages(all_nan, g),
        gdpo_advantages(all_nan, g),
        saw_weights(all_nan),
        group_advantages(torch.ones(1, 2, dtype=dtype), torch.zeros(1)),
        gdpo_advantages(torch.ones(1, 2, dtype=dtype), torch.zeros(1)),
        grpo_advantages(torch.ones(1, 2, dtype=dtype), torch.zeros(1)),
        saw_weights(torch.ones(1, 2, dtype=dtype)),
    ):
        assert out.dtype == dtype
        assert not torch.isnan(out).any()
    assert torch.equal(gdpo_advantages(all_nan, g), torch.zeros(4, dtype=dtype))
    assert torch.equal(saw_weights(all_nan), torch.zeros(3, dtype=dtype))


def test_grpo_hand_example() -> None:
    # Sums with NaN as 0: group 0 -> 1, 2, 3 (mean 2, std 1); group 1 -> 3, 5, 4 (mean 4, std 1).
    adv = grpo_advantages(REWARDS, GROUP, eps=0.0)
    assert adv.tolist() == [-1.0, 0.0, 1.0, -1.0, 1.0, 0.0]
    # Weights c = (1, 0) keep only reward a: group 1 becomes 3, 3, 0 (mean 2, std sqrt(3)).
    adv = grpo_advantages(REWARDS, GROUP, weights=[1.0, 0.0], eps=0.0)
    s3 = math.sqrt(3.0)
    assert adv.tolist() == pytest.approx([-1.0, 0.0, 1.0, 1 / s3, 1 / s3, -2 / s3])


def test_gdpo_hand_example() -> None:
    # S = A_a + A_b = -1, 0, 1, -1, 0, 1: mean 0, unbiased var 4/5.
    adv = gdpo_advantages(REWARDS, GROUP, eps=0.0)
    a = 1 / math.sqrt(0.8)
    assert adv.tolist() == pytest.approx([-a, 0.0, a, -a, 0.0, a], rel=1e-6)
    # c = (2, 1): S = -2, 0, 2, -1, 0, 1, var = 10/5 = 2.
    adv = gdpo_advantages(REWARDS, GROUP, weights=torch.tensor([2.0, 1.0]), eps=0.0)
    r2 = math.sqrt(2.0)
    assert adv.tolist() == pytest.approx([-2 / r2, 0.0, 2 / r2, -1 / r2, 0.0, 1 / r2], rel=1e-6)


def test_gdpo_default_eps_hand_example() -> None:
    eps = 1e-4
    s = [-1 / (1 + eps), 0.0, 1 / (1 + eps), -2 / (2 + eps), 0.0, 2 / (2 + eps)]
    sigma = math.sqrt(sum(v * v for v in s) / 5)
    adv = gdpo_advantages(REWARDS.double(), GROUP)
    assert adv.dtype == torch.float64
    assert adv.tolist() == pytest.approx([v / (sigma + eps) for v in s], rel=1e-12)


def test_saw_hand_example() -> None:
    # a: present 0, 1, 2, 3, 3 -> mean 1.8, unbiased var 6.8 / 4 = 1.7.
    # b: 1, 1, 1, 0, 2, 4      -> mean 1.5, unbiased var 9.5 / 5 = 1.9.
    cv_a = math.sqrt(1.7) / 1.8
    cv_b = math.sqrt(1.9) / 1.5
    w = saw_weights(REWARDS.double())
    assert w.tolist() == pytest.approx(
        [2 * cv_a / (cv_a + cv_b), 2 * cv_b / (cv_a + cv_b)], rel=1e-7
    )
    assert w.sum().item() == pytest.approx(2.0)


def test_saw_undefined_and_constant_rewards() -> None:
    r = torch.tensor([[1.0, 5.0, NAN], [2.0, 5.0, 1.0], [4.0, 5.0, NAN]])
    w = saw_weights(r)
    # Reward 2 has one present value: weight 0; reward 1 is constant: CV 0 -> weight 0.
    assert w[2].item() == 0.0 and w[1].item() == 0.0
    assert w.sum().item() == pytest.approx(2.0)  # K' = 2 rewards have a CV
    # All CVs 0: nothing to rebalance, each reward with a CV keeps 1.
    assert saw_weights(torch.ones(4, 3)).tolist() == [1.0, 1.0, 1.0]


def test_saw_weights_sum_to_k_random() -> None:
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(32, 5, generator=gen) * torch.tensor([1.0, 10.0, 0.1, 3.0, 7.0])
    assert saw_weights(r).sum().item() == pytest.approx(5.0, rel=1e-6)


def test_saw_shifts_a_signed_reward_before_its_cv() -> None:
    # ToolRL-like batch: format in [0, 1], correctness in [-3, 3].
    #   format      1, 1, 0, 1    -> mean 0.75, unbiased var (3 * 0.0625 + 0.5625) / 3 = 0.25
    #   correctness 3, -3, 3, -3  -> shifted by +3: 6, 0, 6, 0 -> mean 3, var 4 * 9 / 3 = 12
    r = torch.tensor([[1.0, 3.0], [1.0, -3.0], [0.0, 3.0], [1.0, -3.0]], dtype=torch.float64)
    cv_f = 0.5 / 0.75
    cv_c = math.sqrt(12.0) / 3.0
    w = saw_weights(r, lower_bounds=[0.0, -3.0])
    assert w.tolist() == pytest.approx([2 * cv_f / (cv_f + cv_c), 2 * cv_c / (cv_f + cv_c)])
    # Unshifted, correctness's mean is 0 and its CV is std / 1e-8: it takes all the weight.
    unshifted = saw_weights(r)
    assert unshifted[0].item() < 1e-6 and unshifted[1].item() == pytest.approx(2.0)
    # A lower bound of 0 (or above) shifts nothing: binary rewards keep their weights.
    assert torch.equal(saw_weights(r, lower_bounds=[0.0, 0.0]), unshifted)
    assert torch.equal(saw_weights(r, lower_bounds=[0.5, 0.0]), unshifted)
    with pytest.raises(ValueError, match="lower_bounds must have shape"):
        saw_weights(r, lower_bounds=[0.0])


def test_replay_mask_hand_example() -> None:
    m = replay_mask(REWARDS, GROUP)
    expected = torch.tensor(
        [[True, False], [True, False], [True, False], [False, True], [False, True], [False, True]]
    )
    assert torch.equal(m, expected)
    has_block = torch.ones(6, 2, dtype=torch.bool)
    has_block[1, 0] = False
    has_block[5, 1] = False
    m = replay_mask(REWARDS, GROUP, has_block)
    assert not m[1, 0] and not m[5, 1] and m[0, 0] and m[4, 1]


def test_replay_mask_matches_nonzero_group_advantage_support() -> None:
    gen = torch.Generator().manual_seed(1)
    r = torch.randint(0, 2, (24, 4), generator=gen).float()
    r[torch.rand(24, 4, generator=gen) < 0.3] = NAN
    g = torch.arange(24) // 4
    m = replay_mask(r, g)
    adv = group_advantages(r, g)
    # A non-zero advantage implies replay; replayed pairs are present rewards in varying groups.
    assert bool((m | (adv == 0)).all())
    assert not bool((m & torch.isnan(r)).any())
