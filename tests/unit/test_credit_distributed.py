"""Two gloo ranks holding parts of a batch give the advantages of one rank holding all of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mrtpo.core.credit import (
    GDPOSAW,
    MRTPO,
    MRTPOSAW,
    CreditInputs,
    MRTPOJoint,
    MRTPOShuffle,
    gdpo_advantages,
    mrtpo_advantages,
    replay_mask,
    saw_weights,
)
from mrtpo.core.credit.methods import RewardSet

NAN = float("nan")
SPLIT = 12  # rank 0 holds 3 groups of 4, rank 1 the other 5: unequal shares on purpose


def make_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    n, k, t = 32, 3, 10
    rewards = torch.randint(0, 4, (n, k), generator=gen).float() * 0.37
    rewards[torch.rand(n, k, generator=gen) < 0.2] = NAN
    group = torch.arange(n) // 4
    mask = torch.arange(t)[None] < torch.randint(1, t + 1, (n, 1), generator=gen)
    q = torch.rand(n, k, t, generator=gen) ** 2
    replayed = replay_mask(rewards, group)
    return {"rewards": rewards, "group": group, "mask": mask, "q": q, "replayed": replayed}


def compute_all(b: dict[str, torch.Tensor], pg: object) -> dict[str, torch.Tensor]:
    """Every batch-statistic path: GDPO, SAW, MRTPO (per reward, joint, SAW)."""
    r, g, mask, q, rep = (b[x] for x in ("rewards", "group", "mask", "q", "replayed"))
    out = {
        "gdpo": gdpo_advantages(r, g, process_group=pg),
        "saw": saw_weights(r, process_group=pg),
        "saw_signed": saw_weights(r - 0.5, process_group=pg, lower_bounds=[-0.5, 0.0, -1.0]),
        "mrtpo_fn": mrtpo_advantages(r, g, q, mask, rep, 1.0, process_group=pg),
    }
    names = ("a", "b", "c")
    for key, method, qq, rr in (
        ("mrtpo", MRTPO(beta=0.5), q, rep),
        ("mrtpo_saw", MRTPOSAW(beta=0.75), q, rep),
        ("mrtpo_joint", MRTPOJoint(beta=0.5), q[:, :1], rep.any(-1, keepdim=True)),
        ("mrtpo_shuffle", MRTPOShuffle(beta=0.5), q, rep),
        ("gdpo_saw", GDPOSAW(), None, None),
        ("mrtpo_token", MRTPO(beta=0.9, cap="token"), q, rep),
        ("mrtpo_response", MRTPO(beta=0.9, cap="response"), q, rep),
        ("mrtpo_none", MRTPO(beta=0.9, cap="none"), q, rep),
    ):
        method.setup(RewardSet(names, False, {"b": (-1.0, 2.0)}))
        # the same generator seed on every rank, as the module seeds it
        gen = torch.Generator().manual_seed(2024)
        res = method(CreditInputs(r, g, mask, q=qq, replayed=rr, process_group=pg, generator=gen))
        out[key] = res.advantages
        if "cap_s" in res.stats:
            out[key + "_cap"] = torch.tensor(res.stats["cap_s"])
        # the cap's statistics are the global batch's, the same on every rank
        for stat in ("cap_bound_share", "sign_flip_share", "credit_change"):
            if stat in res.stats:
                out[f"{key}_{stat}_cap"] = torch.tensor(res.stats[stat], dtype=torch.float64)
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        b = make_batch()
        part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
        local = {k: v[part] for k, v in b.items()}
        torch.save(compute_all(local, dist.group.WORLD), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_ranks_equal_one_rank(tmp_path: Path) -> None:
    # fork (where available) skips re-importing torch in the children: seconds on a busy CI box.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method=method
    )
    full = compute_all(make_batch(), None)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    # Sanity: the batch statistics matter (a local-only computation would differ).
    local_only = compute_all({k: v[:SPLIT] for k, v in make_batch().items()}, None)
    assert not torch.allclose(local_only["gdpo"], full["gdpo"][:SPLIT])
    # ... and the shuffle moves weights (so its rank invariance below is not trivial)
    assert (full["mrtpo_shuffle"] - full["mrtpo"]).abs().max() > 0.1
    # ... and the per-token cap binds on some tokens of both ranks' shares
    assert 0 < float(full["mrtpo_token_cap_bound_share_cap"]) < 1
    for key, ref in full.items():
        if key.startswith("saw") or key.endswith("_cap"):  # global quantities: same on both ranks
            for got in (r0[key], r1[key]):
                torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
        else:
            got = torch.cat([r0[key], r1[key]])
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=0, msg=key)
