"""Property tests (hypothesis) over shapes, NaN patterns, masks and β."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrtpo.core.credit import (
    gdpo_advantages,
    group_advantages,
    grpo_advantages,
    mrtpo_advantages,
    relevance_weights,
    replay_mask,
    saw_weights,
    shuffle_weights,
)

NAN = float("nan")


@st.composite
def batches(draw: st.DrawFn, dtype: torch.dtype = torch.float64) -> dict:
    n_groups = draw(st.integers(1, 4))
    size = draw(st.integers(1, 4))
    k = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    n = n_groups * size
    levels = st.sampled_from([0.0, 0.5, 1.0, 2.0, -3.0, NAN])
    rewards = torch.tensor(draw(st.lists(levels, min_size=n * k, max_size=n * k)), dtype=dtype)
    lengths = draw(st.lists(st.integers(0, t), min_size=n, max_size=n))
    qs = st.sampled_from([0.0, 1e-3, 0.1, 0.5, 1.0])
    q = torch.tensor(draw(st.lists(qs, min_size=n * k * t, max_size=n * k * t)), dtype=dtype)
    shuffle = draw(st.permutations(list(range(n))))
    group = (torch.arange(n) // size)[torch.tensor(shuffle)]
    mask = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    rewards = rewards.view(n, k)
    return {
        "rewards": rewards,
        "group": group,
        "mask": mask,
        "q": q.view(n, k, t),
        "replayed": replay_mask(rewards, group),
        "beta": draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])),
    }


@settings(max_examples=150, deadline=None)
@given(b=batches())
def test_baselines_finite_and_zero_where_undefined(b: dict) -> None:
    r, g = b["rewards"], b["group"]
    a_k = group_advantages(r, g)
    assert torch.isfinite(a_k).all()
    assert torch.equal(a_k[torch.isnan(r)], torch.zeros_like(a_k[torch.isnan(r)]))
    # Within a group, each reward's present advantages sum to ~0.
    for gid in g.unique():
        sel = g == gid
        assert torch.allclose(a_k[sel].sum(0), torch.zeros(r.shape[1], dtype=r.dtype), atol=1e-9)
    assert torch.isfinite(grpo_advantages(r, g)).all()
    gdpo = gdpo_advantages(r, g)
    assert torch.isfinite(gdpo).all()
    assert abs(gdpo.mean().item()) < 1e-9
    w = saw_weights(r)
    k_eff = int(((~torch.isnan(r)).sum(0) >= 2).sum())
    assert torch.isfinite(w).all() and abs(w.sum().item() - k_eff) < 1e-9


@settings(max_examples=150, deadline=None)
@given(b=batches())
def test_mrtpo_properties(b: dict) -> None:
    r, g, mask, q, rep, beta = (b[x] for x in ("rewards", "group", "mask", "q", "replayed", "beta"))
    w = relevance_weights(q, mask, rep, beta)
    valid = mask[:, None, :].expand_as(w)
    assert (w[valid] >= 1 - beta - 1e-12).all()
    n_tok = valid.sum(-1)
    has = n_tok > 0
    mean_w = (w * valid).sum(-1)[has] / n_tok[has]
    assert torch.allclose(mean_w, torch.ones_like(mean_w), atol=1e-12)

    tok, stats = mrtpo_advantages(r, g, q, mask, rep, beta, return_stats=True)
    assert torch.isfinite(tok).all()
    assert torch.equal(tok[~mask], torch.zeros_like(tok[~mask]))
    gdpo = gdpo_advantages(r, g)
    rows = mask.any(-1)
    mean_tok = (tok * mask).sum(-1)[rows] / mask.sum(-1)[rows]
    assert torch.allclose(mean_tok, gdpo[rows], atol=1e-6)
    assert 0 <= stats["cap_s"] <= 1  # 0 when every S cancels (sum S^2 = 0 < sum R^2)
    # Energy bound before normalization: sum (S + sR)^2 <= 2 sum S^2 (within rounding).
    a_k = group_advantages(r, g)
    s = a_k.sum(-1)[:, None] * mask
    realloc = (a_k[:, :, None] * (w - 1)).sum(1) * mask
    assert ((s + stats["cap_s"] * realloc) ** 2).sum() <= 2 * (s**2).sum() + 1e-9
    if beta == 0.0:
        ref = torch.where(mask, gdpo[:, None].expand(mask.shape), 0.0)
        assert torch.equal(tok, ref)


@settings(max_examples=100, deadline=None)
@given(b=batches(dtype=torch.float32), seed=st.integers(0, 2**31 - 1))
def test_beta0_bit_for_bit_float32_and_shuffle_multisets(b: dict, seed: int) -> None:
    r, g, mask, q, rep = (b[x] for x in ("rewards", "group", "mask", "q", "replayed"))
    tok = mrtpo_advantages(r, g, q, mask, rep, 0.0)
    gdpo = gdpo_advantages(r, g)
    assert torch.equal(tok, torch.where(mask, gdpo[:, None].expand(mask.shape), 0.0))
    w = relevance_weights(q, mask, rep, 0.5)
    ws = shuffle_weights(w, mask, rep, torch.Generator().manual_seed(seed))
    for i in range(w.shape[0]):
        sel = mask[i]
        assert torch.equal(ws[i][:, sel].sort(-1).values, w[i][:, sel].sort(-1).values)
        assert torch.equal(ws[i][:, ~sel], w[i][:, ~sel])
