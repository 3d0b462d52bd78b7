"""Jensen–Shannon distance, token weights, shuffle, β schedule and MRTPO token advantages."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon

from mrtpo.core.credit import (
    beta_schedule,
    gdpo_advantages,
    js_distance,
    js_distance_chunked,
    mrtpo_advantages,
    mrtpo_advantages_from_weights,
    relevance_weights,
    shuffle_weights,
)
from mrtpo.core.credit.advantages import group_advantages

NAN = float("nan")


def random_batch(
    seed: int,
    n_groups: int = 4,
    size: int = 4,
    k: int = 3,
    t: int = 9,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Binary/graded rewards with NaNs, ragged masks, an all-equal group, relevance in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    n = n_groups * size
    rewards = torch.randint(0, 3, (n, k), generator=gen).to(dtype)
    rewards[torch.rand(n, k, generator=gen) < 0.2] = NAN
    rewards[:size] = 1.0  # one group where every reward is constant
    group = torch.arange(n) // size
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    q = torch.rand(n, k, t, generator=gen).to(dtype) ** 3
    q[:, :, -1] = NAN  # garbage on (some) pads must not leak
    q = torch.where(mask[:, None, :], q, torch.full_like(q, NAN))
    replayed = ~torch.isnan(rewards) & (torch.rand(n, k, generator=gen) < 0.8)
    return {"rewards": rewards, "group": group, "mask": mask, "q": q, "replayed": replayed}


# ------------------------------------------------------------------ Jensen–Shannon distance


def _probs(rng: np.random.Generator, v: int, zeros: int = 0) -> np.ndarray:
    p = rng.random(v) ** 2
    if zeros:
        p[rng.choice(v, zeros, replace=False)] = 0.0
    return p / p.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_js_distance_matches_scipy(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    cases = [(_probs(rng, 50), _probs(rng, 50)) for _ in range(20)]
    cases += [(_probs(rng, 50, zeros=10), _probs(rng, 50, zeros=10)) for _ in range(10)]
    p0 = _probs(rng, 50)
    cases += [(p0, (p0 + 1e-3 * _probs(rng, 50)) / (1 + 1e-3))]  # nearly identical
    with np.errstate(divide="ignore"):
        la = torch.tensor(np.log([c[0] for c in cases]), dtype=dtype)
        lb = torch.tensor(np.log([c[1] for c in cases]), dtype=dtype)
    got = js_distance(la, lb)
    assert got.dtype == dtype
    ref = np.array([jensenshannon(p, q, base=2) for p, q in cases])
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-6, rtol=0)


def test_js_distance_float32_from_log_softmax_of_large_vocab() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5000, generator=gen, dtype=torch.float64) * 4
    la, lb = torch.log_softmax(logits, -1), torch.log_softmax(logits.flip(0), -1)
    ref = jensenshannon(la[0].exp().numpy(), lb[0].exp().numpy(), base=2)
    got = js_distance(la.float(), lb.float())
    assert got.dtype == torch.float32
    assert got[0].item() == pytest.approx(ref, abs=1e-6)


def test_js_distance_identical_disjoint_symmetric() -> None:
    gen = torch.Generator().manual_seed(1)
    la = torch.log_softmax(torch.randn(3, 7, 100, generator=gen), -1)
    assert torch.equal(js_distance(la, la), torch.zeros(3, 7))
    lb = torch.log_softmax(torch.randn(3, 7, 100, generator=gen), -1)
    assert torch.equal(js_distance(la, lb), js_distance(lb, la))
    ninf = -float("inf")
    a = torch.tensor([[math.log(0.5), math.log(0.5), ninf, ninf]])
    b = torch.tensor([[ninf, ninf, math.log(0.25), math.log(0.75)]])
    assert js_distance(a, b).item() == pytest.approx(1.0, abs=1e-7)
    one_hot = torch.tensor([[0.0, ninf, ninf]])
    assert js_distance(one_hot, one_hot).item() == 0.0
    assert js_distance(one_hot, torch.tensor([[ninf, 0.0, ninf]])).item() == 1.0


def test_js_distance_chunked_matches_unchunked_and_bf16() -> None:
    gen = torch.Generator().manual_seed(2)
    la = torch.randn(37, 300, generator=gen) * 3
    lb = la + 0.5 * torch.randn(37, 300, generator=gen)
    full = js_distance(torch.log_softmax(la, -1), torch.log_softmax(lb, -1))
    for chunk in (1, 8, 37, 100):
        assert torch.equal(js_distance_chunked(la, lb, chunk=chunk), full)
    got = js_distance_chunked(la.bfloat16(), lb.bfloat16(), chunk=5)
    assert got.dtype == torch.float32 and got.shape == (37,)
    assert torch.allclose(got, full, atol=2e-2)
    assert torch.equal(js_distance_chunked(la, la), torch.zeros(37))


# ------------------------------------------------------------------ token weights, schedule


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
def test_relevance_weights_properties(beta: float) -> None:
    b = random_batch(0, dtype=torch.float64)
    w = relevance_weights(b["q"], b["mask"], b["replayed"], beta)
    valid = b["mask"][:, None, :].expand_as(w)
    assert torch.equal(w[~valid], torch.ones_like(w[~valid]))
    assert bool((w[valid] >= 1 - beta - 1e-12).all())
    mean = (w * valid).sum(-1) / valid.sum(-1)
    assert torch.allclose(mean, torch.ones_like(mean), atol=1e-12)
    assert torch.equal(w[~b["replayed"]], torch.ones_like(w[~b["replayed"]]))


def test_relevance_weights_hand_example_and_zero_mean() -> None:
    q = torch.tensor([[[0.3, 0.1, 0.2, 9.0], [0.0, 0.0, 0.0, 0.0]]])
    mask = torch.tensor([[True, True, True, False]])
    w = relevance_weights(q, mask, torch.tensor([[True, True]]), beta=0.5)
    # qbar = 0.2: w = 0.5 + 0.5 * q / 0.2 = 1.25, 0.75, 1.0; pad 1; all-zero profile -> 1.
    assert w[0, 0].tolist() == pytest.approx([1.25, 0.75, 1.0, 1.0])
    assert w[0, 1].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_beta_schedule() -> None:
    assert beta_schedule(0.5, 0, 10) == 0.0
    assert beta_schedule(0.5, 5, 10) == pytest.approx(0.25)
    assert beta_schedule(0.5, 10, 10) == 0.5
    assert beta_schedule(0.5, 50, 10) == 0.5
    assert beta_schedule(0.5, 0, 0) == 0.5
    assert beta_schedule(0.8, 2, 10) == pytest.approx(0.8 * (3 * 0.04 - 2 * 0.008))
    vals = [beta_schedule(1.0, s, 20) for s in range(21)]
    assert all(x < y for x, y in itertools.pairwise(vals))
    # Zero slope at both ends: the first and last steps move less than the middle ones.
    assert vals[1] - vals[0] < vals[11] - vals[10] and vals[20] - vals[19] < vals[11] - vals[10]


def test_shuffle_keeps_each_responses_weights() -> None:
    b = random_batch(4, t=12)
    w = relevance_weights(b["q"], b["mask"], b["replayed"], 0.5)
    s1 = shuffle_weights(w, b["mask"], b["replayed"], torch.Generator().manual_seed(0))
    s2 = shuffle_weights(w, b["mask"], b["replayed"], torch.Generator().manual_seed(0))
    assert torch.equal(s1, s2)
    assert not torch.equal(s1, w)
    valid = b["mask"][:, None, :].expand_as(w)
    assert torch.equal(s1[~valid], w[~valid])
    n, k, _ = w.shape
    for i in range(n):
        for j in range(k):
            sel = b["mask"][i]
            assert torch.equal(s1[i, j, sel].sort().values, w[i, j, sel].sort().values)


# ------------------------------------------------------------------ MRTPO token advantages


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mrtpo_beta0_is_gdpo_bit_for_bit(seed: int, dtype: torch.dtype) -> None:
    b = random_batch(seed, dtype=dtype)
    c = torch.tensor([1.0, 0.5, 2.0], dtype=dtype)
    for weights in (None, c):
        gdpo = gdpo_advantages(b["rewards"], b["group"], weights)
        ref = torch.where(b["mask"], gdpo[:, None].expand(b["mask"].shape), 0.0)
        got = mrtpo_advantages(
            b["rewards"], b["group"], b["q"], b["mask"], b["replayed"], 0.0, weights
        )
        assert got.dtype == dtype
        assert torch.equal(got, ref)
        joint = mrtpo_advantages(
            b["rewards"], b["group"], b["q"][:, :1], b["mask"], b["replayed"][:, :1], 0.0, weights
        )
        assert torch.equal(joint, ref)


@pytest.mark.parametrize("beta", [0.25, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_mrtpo_properties(beta: float, seed: int) -> None:
    b = random_batch(seed, dtype=torch.float64)
    mask = b["mask"]
    tok, stats = mrtpo_advantages(
        b["rewards"], b["group"], b["q"], mask, b["replayed"], beta, return_stats=True
    )
    assert not torch.isnan(tok).any()
    assert torch.equal(tok[~mask], torch.zeros_like(tok[~mask]))
    gdpo = gdpo_advantages(b["rewards"], b["group"])
    mean_tok = (tok * mask).sum(-1) / mask.sum(-1)
    assert torch.allclose(mean_tok, gdpo, atol=1e-6)
    # Before normalization: the second moment of S + sR is at most twice that of S.
    a_k = group_advantages(b["rewards"], b["group"])
    s = a_k.sum(-1)
    w = relevance_weights(b["q"], mask, b["replayed"], beta)
    r = (a_k[:, :, None] * (w - 1)).sum(1) * mask
    cap = stats["cap_s"]
    assert 0 < cap <= 1
    m_s = (s[:, None] ** 2 * mask).sum()
    m_tot = ((s[:, None] + cap * r) ** 2 * mask).sum()
    assert m_tot <= 2 * m_s * (1 + 1e-9)
    assert cap == pytest.approx(min(1.0, math.sqrt(m_s / (r**2).sum())) if (r**2).sum() else 1.0)


def test_mrtpo_hand_example() -> None:
    # One group of two, one reward 1 / 0 (A = +-0.5 / sqrt(0.5)); the other group all-equal.
    rewards = torch.tensor([[1.0], [0.0], [1.0], [1.0]], dtype=torch.float64)
    group = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    q = torch.tensor(
        [[[0.6, 0.2, 0.0]], [[0.1, 0.1, 0.4]], [[1.0, 0, 0]], [[0.5, 0.5, 0]]], dtype=torch.float64
    )
    replayed = torch.tensor([[True], [True], [False], [False]])
    eps = 1e-4
    tok, stats = mrtpo_advantages(
        rewards, group, q, mask, replayed, 0.5, eps=eps, return_stats=True
    )
    a = 0.5 / (math.sqrt(0.5) + eps)
    # w: response 0 qbar 0.4 -> 1.25, 0.75; response 1 qbar 0.2 -> 0.75, 0.75, 1.5.
    r0 = [a * 0.25, -a * 0.25]
    r1 = [-a * -0.25, -a * -0.25, -a * 0.5]
    sum_s2 = a * a * 2 + a * a * 3
    sum_r2 = sum(x * x for x in r0 + r1)
    assert sum_r2 < sum_s2 and stats["cap_s"] == 1.0
    sigma = math.sqrt((2 * a * a) / 3)  # S = a, -a, 0, 0: mean 0
    d = sigma + eps
    expected = [
        [(a + r0[0]) / d, (a + r0[1]) / d, 0.0],
        [(-a + r1[0]) / d, (-a + r1[1]) / d, (-a + r1[2]) / d],
        [0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0],
    ]
    assert tok.tolist() == [pytest.approx(row, rel=1e-12) for row in expected]


def test_mrtpo_cap_binds() -> None:
    # Concentrated relevance with β = 1 puts all credit on one token: R dominates S, s < 1.
    rewards = torch.tensor([[1.0], [0.0]])
    mask = torch.ones(2, 8, dtype=torch.bool)
    q = torch.zeros(2, 1, 8)
    q[:, 0, 0] = 1.0
    tok, stats = mrtpo_advantages(
        rewards, torch.zeros(2), q, mask, torch.ones(2, 1, dtype=torch.bool), 1.0,
        return_stats=True,
    )  # fmt: skip
    # w - 1 = 7, -1 x 7 per response: sum R^2 = 2 a^2 (49 + 7), sum S^2 = 16 a^2.
    assert stats["cap_s"] == pytest.approx(math.sqrt(16 / 112))
    assert torch.allclose(tok.mean(-1), gdpo_advantages(rewards, torch.zeros(2)), atol=1e-6)


def test_mrtpo_without_relevance_is_gdpo() -> None:
    b = random_batch(7)
    ref = gdpo_advantages(b["rewards"], b["group"])
    got, stats = mrtpo_advantages(
        b["rewards"], b["group"], None, b["mask"], None, 0.5, return_stats=True
    )
    assert torch.equal(got, torch.where(b["mask"], ref[:, None].expand(b["mask"].shape), 0.0))
    assert stats["cap_s"] == 1.0


def test_joint_with_one_reward_equals_per_reward() -> None:
    b = random_batch(5, k=1, dtype=torch.float64)
    args = (b["rewards"], b["group"], b["q"], b["mask"], b["replayed"], 0.5)
    per = mrtpo_advantages(*args, joint=False)
    joint = mrtpo_advantages(*args, joint=True)
    assert torch.allclose(per, joint, atol=1e-12)


def test_joint_applies_one_profile_to_summed_credit() -> None:
    b = random_batch(6, dtype=torch.float64)
    qj = b["q"][:, :1]
    rj = b["replayed"].any(-1, keepdim=True)
    # With identical profiles for every reward, per-reward == joint.
    per = mrtpo_advantages(
        b["rewards"], b["group"], qj.expand_as(b["q"]), b["mask"], rj.expand_as(b["replayed"]), 0.5
    )
    joint = mrtpo_advantages(b["rewards"], b["group"], qj, b["mask"], rj, 0.5)
    assert torch.allclose(per, joint, atol=1e-12)
    assert not torch.allclose(joint, mrtpo_advantages(*[b[x] for x in ("rewards", "group")],
                                                      b["q"], b["mask"], b["replayed"], 0.5))  # fmt: skip


def test_shuffled_weights_keep_response_means() -> None:
    b = random_batch(8, dtype=torch.float64)
    w = relevance_weights(b["q"], b["mask"], b["replayed"], 0.5)
    ws = shuffle_weights(w, b["mask"], b["replayed"], torch.Generator().manual_seed(1))
    tok, st = mrtpo_advantages_from_weights(
        b["rewards"], b["group"], w, b["mask"], return_stats=True
    )
    tok_s, st_s = mrtpo_advantages_from_weights(
        b["rewards"], b["group"], ws, b["mask"], return_stats=True
    )
    assert st["cap_s"] == pytest.approx(st_s["cap_s"], rel=1e-12)  # the same multisets
    n_tok = b["mask"].sum(-1)
    assert torch.allclose(tok.sum(-1) / n_tok, tok_s.sum(-1) / n_tok, atol=1e-9)
    assert not torch.allclose(tok, tok_s)


def test_garbage_relevance_on_skipped_pairs_is_ignored() -> None:
    b = random_batch(9)
    q_nan = torch.where(b["replayed"][:, :, None], b["q"], torch.full_like(b["q"], NAN))
    q_zero = torch.where(b["replayed"][:, :, None], b["q"], torch.zeros_like(b["q"]))
    args = (b["rewards"], b["group"])
    got = mrtpo_advantages(*args, q_nan, b["mask"], b["replayed"], 0.5)
    ref = mrtpo_advantages(*args, q_zero, b["mask"], b["replayed"], 0.5)
    assert torch.isfinite(got).all() and torch.equal(got, ref)
