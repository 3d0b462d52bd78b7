"""Credit diagnostics at scale and over ranks: the q/q̄ quantiles of more than 2^24 tokens
(torch.quantile's limit), and energy shares that two gloo ranks combine into exactly the
one-process batch's even where a rank's responses lack a segment."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mrtpo.distributed import Ranks
from mrtpo.step.diagnostics import (
    PREFIX,
    CreditDiagnostics,
    q_ratio_quantiles,
    quantiles,
    share_stats,
)
from mrtpo.step.metrics import combine
from mrtpo.tasks.synthetic import SyntheticTask

BIG = 2**24 + 7


def test_quantiles_follow_torch_quantile():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 10, 101, 1000):
        x = torch.rand(n, generator=gen, dtype=torch.float64) ** 3
        want = torch.quantile(x, torch.tensor([0.0, 0.5, 0.99, 1.0], dtype=x.dtype)).tolist()
        assert quantiles(x, (0.0, 0.5, 0.99, 1.0)) == pytest.approx(want, rel=1e-15, abs=0), n


def test_ratio_quantiles_of_more_than_2_24_tokens():
    # replayed pairs x valid tokens of one rank reach this at scale (1024 x 3 x 6k): the step
    # must not crash where torch.quantile refuses its input ("input tensor is too large")
    gen = torch.Generator().manual_seed(1)
    q = torch.rand(1, 1, BIG, generator=gen)
    mask = torch.ones(1, BIG, dtype=torch.bool)
    m, w = q_ratio_quantiles(q, mask, torch.ones(1, 1, dtype=torch.bool))
    ratio = (q.double() / q.double().mean()).flatten().numpy()
    assert w["q_ratio/p50"] == BIG
    assert m["q_ratio/p50"] == pytest.approx(float(np.quantile(ratio, 0.5)), rel=1e-12)
    assert m["q_ratio/p99"] == pytest.approx(float(np.quantile(ratio, 0.99)), rel=1e-12)
    assert m["q_ratio/max"] == pytest.approx(float(ratio.max()), rel=1e-12)


# ---- energy shares over two ranks ---------------------------------------------------------
CHARS = "<>/thinkabcdeplrvw !."
# rank 0's responses have every toy segment; rank 1's lack the mark and (one) the closing tag
TEXTS = [
    "<think> a b </think> apple!",
    "<think> c </think> river.",
    "<think> a b </think> pear",
    "<think> a b c",
]
SPLIT = 2


class CharTokenizer:
    """One token per character of CHARS (the decode the diagnostics call)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(CHARS[i] for i in ids)


def _batch(rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    texts = TEXTS[rows]
    t = max(len(s) for s in TEXTS) + 1
    ids = torch.zeros(len(texts), t, dtype=torch.long)
    mask = torch.zeros(len(texts), t, dtype=torch.bool)
    for j, s in enumerate(texts):
        ids[j, : len(s)] = torch.tensor([CHARS.index(c) for c in s])
        mask[j, : len(s)] = True
    realloc = torch.linspace(-2.0, 3.0, 4 * t).reshape(4, t)[rows] * mask
    return realloc, ids, mask


def _shares(diag: CreditDiagnostics, rows: slice) -> tuple[dict, dict]:
    m, w = diag.energy_shares(*_batch(rows))
    return {PREFIX + k: v for k, v in m.items()}, {PREFIX + k: v for k, v in w.items()}


def _declared(rows: slice, renamed: bool = False) -> dict:
    """This rank's shares as the step declares them (``share_stats``)."""
    m, w = _diag().energy_shares(*_batch(rows))
    if renamed:
        m, w = ({k.replace("/mark", "/max"): v for k, v in d.items()} for d in (m, w))
    return share_stats(m, w)


def _diag() -> CreditDiagnostics:
    return CreditDiagnostics(SyntheticTask(num_constraints=2, closing_mark=True, free_tokens=3),
                             CharTokenizer())  # fmt: skip


def _renamed(shares: tuple[dict, dict]) -> tuple[dict, dict]:
    """A custom task's segment named like a reduction (``max``): still a share."""
    return tuple({k.replace("/mark", "/max"): v for k, v in d.items()} for d in shares)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
        out = {
            "plain": combine(_declared(part), Ranks()),
            "renamed": combine(_declared(part, renamed=True), Ranks()),
        }
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_ranks_give_the_one_process_energy_shares(tmp_path: Path) -> None:
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method=method
    )
    full, _ = _shares(_diag(), slice(None))
    # sanity: rank 1 lacks the mark, and the segments have energy to share
    rank1, _ = _shares(_diag(), slice(SPLIT, None))
    assert (
        full[PREFIX + "energy_share/mark"] > 0 and rank1.get(PREFIX + "energy_share/mark", 0) == 0
    )
    assert math.isclose(sum(full.values()), 1.0, rel_tol=1e-12)
    renamed = _renamed((full, {}))[0]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, want in (("plain", full), ("renamed", renamed)):
            assert got[name].keys() == want.keys()
            for k, v in want.items():
                assert got[name][k] == pytest.approx(v, rel=1e-12, abs=1e-15), (rank, name, k)


def test_a_segment_seen_before_is_logged_as_zero():
    diag = _diag()
    first, _ = _shares(diag, slice(0, SPLIT))
    assert first[PREFIX + "energy_share/mark"] > 0
    later, _ = _shares(diag, slice(SPLIT, None))  # no mark in this step's responses
    assert later[PREFIX + "energy_share/mark"] == 0.0
    assert math.isclose(sum(later.values()), 1.0, rel_tol=1e-12)
