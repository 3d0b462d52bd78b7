"""Step metrics combine over ranks as each is declared (``step_metrics.Stat``), never by a
guess from the name (issue 48, item 3): a metric named like another reduction keeps its own,
an undeclared one is refused with a line naming it, and two gloo ranks agree with the pure
``merge`` of their two mappings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mrtpo.distributed import Ranks
from mrtpo.step.metrics import DECLARED, Reduce, Stat, combine, declare, merge

VALUES = ([1.0, 2.0, 4.0], [3.0, 5.0])  # rank 0's tokens, rank 1's


def _rank(r: int) -> dict[str, Stat]:
    v = np.array(VALUES[r])
    n = float(v.size)
    return {
        # named like maxima, minima, times and sums, declared otherwise: the declaration wins
        "new/max": Stat(float(v.mean()), Reduce.MEAN_BY_TOKENS, n),
        "new/min": Stat(float(v.max()), Reduce.MAX),
        "time/new": Stat(float(v.min()), Reduce.MIN),
        "new/std": Stat(float(v.std()), Reduce.POOLED_STD, n, float(v.mean())),
        "new/count": Stat(n, Reduce.SUM),
        "new/per_rank": Stat(float(r), Reduce.MEAN),
        "new/beta": Stat(0.25, Reduce.SAME),
    }


def _want() -> dict[str, float]:
    both = np.concatenate([np.array(x) for x in VALUES])
    return {
        "new/max": float(both.mean()),
        "new/min": float(both.max()),
        "time/new": float(both.min()),
        "new/std": float(both.std()),
        "new/count": float(both.size),
        "new/per_rank": 0.5,
        "new/beta": 0.25,
    }


def test_merge_combines_each_metric_as_declared() -> None:
    got = merge([_rank(0), _rank(1)])
    assert got.keys() == _want().keys()
    for k, v in _want().items():
        assert got[k] == pytest.approx(v, rel=1e-12), k


def test_an_undeclared_metric_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'new/plain' has no declared reduction"):
        combine({"new/plain": 1.0}, Ranks())
    with pytest.raises(ValueError, match="'rollout/new' has no declared reduction"):
        declare({"rollout/new": 1.0}, DECLARED)


def test_ranks_declaring_one_metric_differently_are_refused() -> None:
    with pytest.raises(ValueError, match="'x' is declared differently"):
        merge([{"x": Stat(1.0, Reduce.MAX)}, {"x": Stat(2.0, Reduce.MIN)}])


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.save(combine(_rank(rank), Ranks()), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_gloo_ranks_combine_as_declared(tmp_path: Path) -> None:
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method=method
    )
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == _want().keys()
        for k, v in _want().items():
            assert got[k] == pytest.approx(v, rel=1e-12), (rank, k)
