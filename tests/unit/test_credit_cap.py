"""The cap on MRTPO's reallocated credit (method.cap): batch, token, response and none forms.

Each form is checked against a reference written here from the spec alone (float64 numpy,
one loop per group, response and token), with its logged statistics; beta = 0 is GDPO bit for
bit under every form, and under the per-token cap no token's advantage has the sign opposite
to its response's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrtpo.core.credit import (
    MRTPO,
    CreditInputs,
    gdpo_advantages,
    mrtpo_advantages,
    replay_mask,
)
from mrtpo.core.credit.methods import RewardSet
from mrtpo.core.credit.relevance import CAPS

NAN = float("nan")
EPS = 1e-4


def random_batch(seed: int, n_groups: int = 4, size: int = 4, k: int = 3, t: int = 9):
    gen = torch.Generator().manual_seed(seed)
    n = n_groups * size
    rewards = torch.randint(0, 3, (n, k), generator=gen).double()
    rewards[torch.rand(n, k, generator=gen) < 0.2] = NAN
    group = torch.arange(n) // size
    mask = torch.arange(t)[None, :] < torch.randint(1, t + 1, (n, 1), generator=gen)
    # spiky relevance (a few tokens far above their mean), so that caps bind
    q = torch.rand(n, k, t, generator=gen).double() ** 6
    replayed = replay_mask(rewards, group)
    return rewards, group, q, mask, replayed


# ---- the reference, from docs/method.md sections 4-5 ------------------------------------------
def ref_gdpo(rewards: np.ndarray, group: np.ndarray, c: np.ndarray):
    """A_k [N, K], S [N], A [N], sigma + eps."""
    n, k = rewards.shape
    a_k = np.zeros((n, k))
    for g in np.unique(group):
        rows = np.flatnonzero(group == g)
        for r in range(k):
            present = [j for j in rows if not math.isnan(rewards[j, r])]
            vals = np.array([rewards[j, r] for j in present])
            if len(vals) < 2 or vals.max() == vals.min():
                continue
            mean, std = vals.mean(), vals.std(ddof=1)
            for j in present:
                a_k[j, r] = (rewards[j, r] - mean) / (std + EPS)
    s = np.array([sum(c[r] * a_k[j, r] for r in range(k)) for j in range(n)])
    denom = (s.std(ddof=1) if n > 1 else 0.0) + EPS
    return a_k, s, (s - s.mean()) / denom, denom


def ref_mrtpo(rewards, group, q, mask, replayed, beta, cap, c=None):
    """Token advantages [N, T] and the statistics, one token at a time."""
    rewards, q, mask, replayed = (np.asarray(x) for x in (rewards, q, mask, replayed))
    n, k = rewards.shape
    t_max = mask.shape[1]
    c = np.ones(k) if c is None else np.asarray(c, dtype=float)
    a_k, s, a, denom = ref_gdpo(rewards, np.asarray(group), c)
    realloc = np.zeros((n, t_max))  # R_t, before normalization
    for j in range(n):
        valid = [t for t in range(t_max) if mask[j, t]]
        for r in range(k):
            qbar = sum(q[j, r, t] for t in valid) / max(len(valid), 1)
            if not replayed[j, r] or qbar <= 1e-8:
                continue
            for t in valid:
                w = (1 - beta) + beta * q[j, r, t] / qbar
                realloc[j, t] += c[r] * a_k[j, r] * (w - 1)
    scale = 1.0
    if cap == "batch":
        sum_s2 = sum(s[j] ** 2 * mask[j].sum() for j in range(n))
        sum_r2 = (realloc**2).sum()
        scale = min(1.0, math.sqrt(sum_s2 / sum_r2)) if sum_r2 > 0 else 1.0
    tok = np.zeros((n, t_max))
    bound = flips = tokens = 0
    changes = []
    for j in range(n):
        valid = [t for t in range(t_max) if mask[j, t]]
        x = [realloc[j, t] / denom for t in valid]
        factor = scale
        if cap == "response":
            factor = min([1.0] + [abs(a[j]) / abs(v) for v in x if v != 0])
        for t, v in zip(valid, x, strict=True):
            if cap == "token":
                moved = min(max(v, -abs(a[j])), abs(a[j]))
            elif cap == "response":  # within the cap, exactly (f v can round past it)
                moved = min(max(factor * v, -abs(a[j])), abs(a[j]))
            else:
                moved = factor * v
            tok[j, t] = a[j] + moved
            bound += abs(moved - v) > 1e-6 * (abs(v) + abs(a[j]))
            flips += tok[j, t] * a[j] < 0
            tokens += 1
        if valid and abs(a[j]) > 1e-6:
            total = sum(tok[j, t] for t in valid)
            changes.append(abs(total - len(valid) * a[j]) / abs(len(valid) * a[j]))
    stats = {
        "cap_bound_share": bound / tokens,
        "sign_flip_share": flips / tokens,
        "credit_change": float(np.mean(changes)) if changes else 0.0,
    }
    return tok, stats


# ---- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("beta", [0.5, 0.9])
def test_each_cap_matches_the_reference(cap: str, seed: int, beta: float) -> None:
    rewards, group, q, mask, replayed = random_batch(seed)
    c = [1.0, 0.5, 2.0]
    got, stats = mrtpo_advantages(
        rewards, group, q, mask, replayed, beta, weights=c, cap=cap, return_stats=True
    )
    ref, ref_stats = ref_mrtpo(rewards, group, q, mask, replayed, beta, cap, c)
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-12, rtol=0)
    for key, value in ref_stats.items():
        assert stats[key] == pytest.approx(value, abs=1e-12), key
    # the batch gives each form something to do
    if cap in ("token", "response"):
        assert 0 < stats["cap_bound_share"] < 1
    if cap == "none":
        assert stats["cap_bound_share"] == 0


def test_float32_follows_the_reference() -> None:
    rewards, group, q, mask, replayed = random_batch(11)
    for cap in CAPS:
        got = mrtpo_advantages(rewards.float(), group, q.float(), mask, replayed, 0.75, cap=cap)
        ref, _ = ref_mrtpo(rewards, group, q, mask, replayed, 0.75, cap)
        np.testing.assert_allclose(got.numpy(), ref, atol=2e-5, rtol=0, err_msg=cap)


def test_batch_is_todays_form_and_the_default() -> None:
    """cap=batch is the default and gives the numbers of the form before the option."""
    rewards, group, q, mask, replayed = random_batch(4)
    default, st_d = mrtpo_advantages(rewards, group, q, mask, replayed, 1.0, return_stats=True)
    batch, st_b = mrtpo_advantages(
        rewards, group, q, mask, replayed, 1.0, cap="batch", return_stats=True
    )
    assert torch.equal(default, batch) and st_d["cap_s"] == st_b["cap_s"] < 1
    assert MRTPO().cap == "batch"


def test_every_mrtpo_preset_caps_per_token() -> None:
    """Issue 49: the configs' default is cap=token for every MRTPO variant; cap=batch stays
    one override away (the class and the function keep batch for code that builds them)."""
    from hydra.utils import instantiate
    from tests.conftest import CONFIG_DIR, compose_config

    presets = sorted(p.stem for p in (CONFIG_DIR / "method").glob("mrtpo*.yaml"))
    assert presets == ["mrtpo", "mrtpo_joint", "mrtpo_saw", "mrtpo_shuffle"]
    for name in presets:
        method = instantiate(compose_config("train.yaml", [f"method={name}"]).method)
        assert isinstance(method, MRTPO) and method.cap == "token", name
        pinned = compose_config("train.yaml", [f"method={name}", "method.cap=batch"])
        assert instantiate(pinned.method).cap == "batch", name


def test_token_cap_hand_example() -> None:
    # one group of two, one reward: A = +-a; beta = 1 puts a response's whole credit on token 0
    rewards = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    q = torch.zeros(2, 1, 4, dtype=torch.float64)
    q[:, 0, 0] = 1.0
    rep = torch.ones(2, 1, dtype=torch.bool)
    tok, stats = mrtpo_advantages(
        rewards, torch.zeros(2), q, mask, rep, 1.0, cap="token", return_stats=True
    )
    a = float(gdpo_advantages(rewards, torch.zeros(2))[0])
    # uncapped: token 0 gets A + 3A, the others A - A = 0; the cap keeps token 0 at 2A
    assert tok[0].tolist() == pytest.approx([2 * a, 0.0, 0.0, 0.0], abs=1e-12)
    assert tok[1].tolist() == pytest.approx([-2 * a, 0.0, 0.0, 0.0], abs=1e-12)
    assert stats["cap_bound_share"] == 2 / 8 and stats["sign_flip_share"] == 0
    assert stats["credit_change"] == pytest.approx(0.5)  # 2A of the uncapped 4A kept


@pytest.mark.parametrize("cap", CAPS)
def test_beta_zero_is_gdpo_bit_for_bit(cap: str) -> None:
    for dtype in (torch.float32, torch.float64):
        rewards, group, q, mask, replayed = random_batch(2)
        rewards, q = rewards.to(dtype), q.to(dtype)
        ref = gdpo_advantages(rewards, group)
        ref = torch.where(mask, ref[:, None].expand(mask.shape), torch.zeros((), dtype=dtype))
        got = mrtpo_advantages(rewards, group, q, mask, replayed, 0.0, cap=cap)
        assert torch.equal(got, ref)
        assert torch.equal(mrtpo_advantages(rewards, group, None, mask, None, 0.5, cap=cap), ref)


def test_unknown_cap_is_one_clear_error() -> None:
    rewards, group, q, mask, replayed = random_batch(0)
    with pytest.raises(ValueError, match=r"cap='tokens'.*batch.*token.*response.*none"):
        mrtpo_advantages(rewards, group, q, mask, replayed, 0.5, cap="tokens")
    with pytest.raises(ValueError, match=r"method.cap='soft'.*batch, token, response, none"):
        MRTPO(cap="soft")


def test_method_logs_the_cap_statistics() -> None:
    rewards, group, q, mask, replayed = random_batch(5)
    method = MRTPO(beta=0.9, cap="token")
    method.setup(RewardSet(("a", "b", "c")))
    out = method(CreditInputs(rewards, group, mask, q=q, replayed=replayed))
    _, ref_stats = ref_mrtpo(rewards, group, q, mask, replayed, 0.9, "token")
    for key, value in ref_stats.items():
        assert out.stats[key] == pytest.approx(value, abs=1e-12)
    assert out.stats["sign_flip_share"] == 0 and "cap_s" not in out.stats
    # the uncapped reallocation R_t / (sigma + eps), for the step's diagnostics
    _, _, _, denom = ref_gdpo(rewards.numpy(), group.numpy(), np.ones(3))
    capped = ref_mrtpo(rewards, group, q, mask, replayed, 0.9, "none")[0]
    a = gdpo_advantages(rewards, group).numpy()
    expected = np.where(mask.numpy(), capped - a[:, None], 0.0)
    np.testing.assert_allclose(out.realloc.numpy(), expected, atol=1e-12)
    assert denom > 0


@st.composite
def batches(draw: st.DrawFn) -> dict:
    n_groups, size = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    k, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    n = n_groups * size
    levels = st.sampled_from([0.0, 0.5, 1.0, 2.0, -3.0, NAN])
    rewards = torch.tensor(draw(st.lists(levels, min_size=n * k, max_size=n * k))).view(n, k)
    lengths = torch.tensor(draw(st.lists(st.integers(0, t), min_size=n, max_size=n)))
    qs = st.sampled_from([0.0, 1e-3, 0.1, 0.5, 1.0])
    q = torch.tensor(draw(st.lists(qs, min_size=n * k * t, max_size=n * k * t))).view(n, k, t)
    group = torch.arange(n) // size
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return {
        "rewards": rewards.to(dtype),
        "group": group,
        "q": q.to(dtype),
        "mask": torch.arange(t)[None] < lengths[:, None],
        "replayed": replay_mask(rewards, group),
        "beta": draw(st.sampled_from([0.1, 0.5, 0.9, 1.0])),
        "weights": draw(st.sampled_from([None, [1.0, 0.5, 2.0, 1.0][:k], [3.0] * k])),
    }


@settings(max_examples=200, deadline=None)
@given(b=batches())
def test_token_cap_never_flips_a_sign(b: dict) -> None:
    args = (b["rewards"], b["group"], b["q"], b["mask"], b["replayed"], b["beta"], b["weights"])
    tok, stats = mrtpo_advantages(*args, cap="token", return_stats=True)
    a = gdpo_advantages(b["rewards"], b["group"], b["weights"])[:, None].expand_as(tok)
    valid = b["mask"]
    assert (tok[valid] * a[valid] >= 0).all()  # a token may reach 0, never cross it
    assert (tok[valid].abs() <= 2 * a[valid].abs()).all()
    assert stats["sign_flip_share"] == 0
    # the response form keeps every token within its cap too (up to rounding at the bound)
    resp = mrtpo_advantages(*args, cap="response")
    assert ((resp - a).abs()[valid] <= a[valid].abs() * (1 + 1e-6) + 1e-12).all()
    # and keeps each response's total credit
    n_tok = valid.sum(-1)
    rows = n_tok > 0
    mean = (resp * valid).sum(-1)[rows] / n_tok[rows]
    assert torch.allclose(mean, a[:, 0][rows], atol=1e-5)
