"""Distributed data parallel: sharded prompt stream, global batch statistics, rank-0 outputs.

The slow test launches ``python src/train.py trainer=ddp`` (2 gloo processes on CPU) with the
``BatchDump`` debug callback, then recomputes every step's advantages in one process over the
two ranks' batches put together and compares them with what the ranks used.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from tests.conftest import ROOT

from mrtpo.core.credit.methods import CreditInputs
from mrtpo.lightning.data import PromptStream
from mrtpo.tasks.synthetic import SyntheticTask


def _ids(batch) -> list[str]:
    return [e.id for e in batch.examples]


def test_ranks_get_disjoint_slices_of_the_one_process_stream():
    examples = SyntheticTask(num_train=37).examples("train")
    one = PromptStream(examples, 6, seed=3)
    ranks = [PromptStream(examples, 3, seed=3, rank=r, world_size=2) for r in (0, 1)]
    for i in range(20):  # several passes over 37 prompts: epoch boundaries inside batches
        parts = [_ids(s.batch_at(i)) for s in ranks]
        assert parts[0] + parts[1] == _ids(one.batch_at(i))


def test_resumed_stream_continues_where_it_stopped_even_with_another_world_size():
    examples = SyntheticTask(num_train=50).examples("train")
    straight = PromptStream(examples, 4, seed=1)  # 1 process, 4 prompts per step
    # Stopped after 3 steps (12 prompts consumed), resumed on 2 ranks with 2 prompts each.
    resumed = [
        PromptStream(examples, 2, seed=1, start=3, rank=r, world_size=2, first_position=12)
        for r in (0, 1)
    ]
    for i in range(3, 8):
        assert _ids(resumed[0].batch_at(i)) + _ids(resumed[1].batch_at(i)) == _ids(
            straight.batch_at(i)
        )


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        PromptStream([], 1, 0, rank=2, world_size=2)


def test_ddp_config_composes(train_cfg):
    cfg = train_cfg("trainer=ddp")
    assert cfg.trainer.devices == 2
    assert cfg.trainer.strategy._target_.endswith("DDPStrategy")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["OMP_NUM_THREADS"] = "1"  # two processes on a small machine
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    return env


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t, (0, width - t.shape[-1]))


def _gather(records: list[dict]) -> dict[str, torch.Tensor]:
    """The global batch: ranks' rows concatenated, group ids made unique, T padded."""
    width = max(r["mask"].shape[1] for r in records)
    offset, groups = 0, []
    for r in records:
        groups.append(r["group"] + offset)
        offset += int(r["group"].max()) + 1
    out = {
        "rewards": torch.cat([r["rewards"] for r in records]),
        "group": torch.cat(groups),
        "mask": torch.cat([_pad(r["mask"], width) for r in records]),
        "advantages": torch.cat([_pad(r["advantages"], width) for r in records]),
    }
    if records[0]["q"] is not None:
        out["q"] = torch.cat([_pad(r["q"], width) for r in records])
        out["replayed"] = torch.cat([r["replayed"] for r in records])
    return out


@pytest.mark.slow
def test_two_processes_match_one_process_over_the_gathered_batch(tmp_path, cache_dir, train_cfg):
    steps, b, g = 3, 2, 4
    res = subprocess.run(
        [
            sys.executable,
            "src/train.py",
            "trainer=ddp",
            "task=synthetic",
            "method=mrtpo",
            f"trainer.max_steps={steps}",
            f"rl.prompts_per_step={b}",
            f"rl.group_size={g}",
            "rollout.sampling.max_new_tokens=8",
            "callbacks.model_checkpoint.every_n_train_steps=1",
            "callbacks.progress=null",
            "data.val_prompts=3",  # one validation batch, which both ranks get (padding)
            f"trainer.val_check_interval={steps}",
            "+callbacks.batch_dump._target_=mrtpo.lightning.callbacks.debug.BatchDump",
            f"paths.log_dir={tmp_path}/logs",
            f"paths.cache_dir={cache_dir}",
            "print_config=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-4000:]

    # One output folder for the run (not one per rank), one checkpoint set, one metrics file.
    runs = sorted((tmp_path / "logs").glob("train/runs/*"))
    assert len(runs) == 1, runs
    run = runs[0]
    assert len(list((tmp_path / "logs").rglob("checkpoints"))) == 1
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("*.ckpt"))
    # last.ckpt and the newest callbacks.model_checkpoint.save_top_k (2) step checkpoints
    assert ckpts == ["last.ckpt"] + [f"step{s:06d}.ckpt" for s in (steps - 1, steps)], ckpts
    metric_files = list((tmp_path / "logs").rglob("metrics.csv"))
    assert metric_files == [run / "csv" / "metrics.csv"]
    with open(metric_files[0]) as f:
        rows = list(csv.DictReader(f))
    train_rows = [r for r in rows if r.get("train/iteration")]
    assert [r["step"] for r in train_rows] == [str(s) for s in range(steps)]
    # Validation: each rank generated for its shard; scored once over the unique prompts.
    val_rows = [r for r in rows if r.get("val/synthetic/n_responses")]
    assert len(val_rows) == 1 and float(val_rows[0]["val/synthetic/n_responses"]) == 3.0
    assert (run / ".hydra" / "config.yaml").is_file()
    assert (run / "train_ddp_process_1.log").is_file()  # rank 1 logged into the same folder

    # Recompute the advantages of each step in one process over the gathered batch.
    cfg = train_cfg("method=mrtpo")
    task = instantiate(cfg.task)
    examples = task.examples("train")
    one_process = PromptStream(examples, b * 2, seed=cfg.seed)
    for step in range(steps):
        records = [
            torch.load(run / "debug" / f"step{step:06d}_rank{r}.pt", weights_only=False)
            for r in (0, 1)
        ]
        assert [r["world_size"] for r in records] == [2, 2]
        # Each rank sampled its own B prompts, G samples each, groups whole on one rank.
        for r in records:
            assert r["rewards"].shape[0] == b * g
            assert r["group"].tolist() == [i // g for i in range(b * g)]
        # Together the ranks read the prompts a single process with 2B prompts would read.
        got_ids = [i for r in records for i in r["ids"][::g]]
        assert got_ids == _ids(one_process.batch_at(step))

        batch = _gather(records)
        method = instantiate(cfg.method)
        method.setup(task)
        out = method(
            CreditInputs(
                rewards=batch["rewards"],
                group=batch["group"],
                mask=batch["mask"],
                step=step,
                q=batch.get("q"),
                replayed=batch.get("replayed"),
            )
        )
        torch.testing.assert_close(
            batch["advantages"], out.advantages, atol=1e-6, rtol=0, msg=f"step {step}"
        )
        # The check has teeth: rank 0's batch alone normalizes differently.
        n0 = records[0]["rewards"].shape[0]
        local = method(
            CreditInputs(
                rewards=records[0]["rewards"],
                group=records[0]["group"],
                mask=records[0]["mask"],
                step=step,
                q=records[0]["q"],
                replayed=records[0]["replayed"],
            )
        )
        if batch["advantages"][:n0].abs().sum() > 0:
            assert not torch.allclose(
                _pad(local.advantages, batch["mask"].shape[1]), batch["advantages"][:n0]
            )
        # the cap's statistics (cap=token, the default: its shares) are the global batch's
        cap_stats = {"cap_bound_share", "sign_flip_share", "credit_change"} & set(out.stats)
        assert cap_stats and "cap_s" not in out.stats
        for key in cap_stats:
            assert records[0]["stats"][key] == pytest.approx(out.stats[key], abs=1e-9), key
