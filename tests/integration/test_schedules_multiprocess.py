"""Resuming a multi-process one_step_off run (issue 47 item 12).

The batch each rank generates ahead lives in the rollout callback's state, and Lightning saves
the callbacks' state of rank 0 only. Each rank's batches are now gathered into the checkpoint,
tagged with the rank and the ids of their prompts; on resume a rank takes a kept batch only
when both match what it draws now, and otherwise generates it again, saying so in its log.

The slow tests start ``python src/train.py trainer=ddp`` (2 gloo processes) with the HF
engine's own copy, which runs the schedules without vLLM; the fast ones drive
``RolloutSource`` directly.
"""

from __future__ import annotations

import csv
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from tests.conftest import ROOT
from tests.integration.test_ddp import _env

from mrtpo.core.models import eos_token_ids
from mrtpo.lightning.pipeline import build

#: 2 prompts x 2 samples per rank on 2 ranks, stated globally so that a resume on one
#: process keeps the run's batch (tests/integration/test_resume_world_size.py).
RUN = [
    "trainer=ddp",
    "method=mrtpo",
    "method.beta_warmup_steps=2",
    "optim.lr=1e-3",
    "rl.prompts_per_step=null",
    "rl.global_prompts_per_step=4",
    "rl.global_mini_batch_size=8",
    "rl.group_size=2",
    "rollout.sampling.max_new_tokens=8",
    "rollout.engine.own_copy=true",
    "rollout.schedule=one_step_off",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.progress=null",
    "callbacks.sample_table=null",
    "callbacks.relevance_dump=null",
    "callbacks.export=null",
    "+callbacks.rollout_dump._target_=tests.integration.test_schedules_multiprocess.RolloutDump",
    "print_config=false",
]

#: timings and what depends on them; everything else must match to 1e-6
SKIP = ("train/time/", "train/tokens_per_s", "train/rollout/generate_s", "train/rollout/push_s")


class RolloutDump(L.Callback):
    """Writes each rank's rollout of each step (tokens, versions, engine log-probs)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        roll = batch.rollout
        out = Path(trainer.default_root_dir) / "rollouts"
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "ids": [e.id for e in roll.examples],
            "tokens": roll.response_ids,
            "versions": roll.versions,
            "engine_logp": roll.engine_logp,
        }
        name = f"step{pl_module.iteration - 1:06d}_rank{trainer.global_rank}.pt"
        torch.save(record, out / name)


def _train(logs: Path, cache_dir: Path, *extra: str, run: list[str] = RUN):
    return subprocess.run(
        [sys.executable, "src/train.py", *run, f"paths.log_dir={logs}",
         f"paths.cache_dir={cache_dir}", *extra],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip


def _run_folder(logs: Path) -> Path:
    (run,) = (logs / "train" / "runs").iterdir()
    return run


def _rows(run: Path) -> dict[int, dict[str, float]]:
    with open(run / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/iteration")]
    return {
        int(r["step"]): {k: float(v) for k, v in r.items() if v not in ("", "nan")} for r in rows
    }


def _dump(run: Path, step: int, rank: int) -> dict:
    return torch.load(run / "rollouts" / f"step{step:06d}_rank{rank}.pt", weights_only=False)


def _log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted(run.glob("train*.log")))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, cache_dir) -> tuple[Path, Path, Path]:
    """(an uninterrupted 4-step run, a run stopped after step 2, a copy of the stopped
    run's checkpoint at step 2, which the resume in place replaces) on 2 ranks."""
    base = tmp_path_factory.mktemp("mp")
    full = _train(base / "full", cache_dir, "trainer.max_steps=4")
    assert full.returncode == 0, full.stderr[-4000:]
    part = _train(base / "part", cache_dir, "trainer.max_steps=2")
    assert part.returncode == 0, part.stderr[-4000:]
    ckpt = _run_folder(base / "part") / "checkpoints" / "step000002.ckpt"
    (base / "kept").mkdir()
    for f in (ckpt, ckpt.with_name(ckpt.name + ".sha256")):
        shutil.copy2(f, base / "kept" / f.name)
    return _run_folder(base / "full"), _run_folder(base / "part"), base / "kept" / ckpt.name


@pytest.mark.slow
def test_a_resumed_two_rank_run_equals_an_uninterrupted_one(two_ranks, cache_dir):
    full, part, kept = two_ranks
    res = _train(part.parents[2], cache_dir, f"+resume={part}", "trainer.max_steps=4")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "generating it again" not in _log(part)
    for step in (2, 3):
        for rank in (0, 1):
            want, got = _dump(full, step, rank), _dump(part, step, rank)
            assert got["ids"] == want["ids"], (step, rank)
            assert torch.equal(got["tokens"], want["tokens"]), (step, rank)
            assert torch.equal(got["versions"], want["versions"]), (step, rank)
            torch.testing.assert_close(got["engine_logp"], want["engine_logp"], atol=1e-6, rtol=0)
    want, got = _rows(full), _rows(part)
    assert sorted(got) == [0, 1, 2, 3]
    for step in (2, 3):
        for k, v in want[step].items():
            if k.startswith(SKIP) or k in ("epoch", "step"):
                continue
            assert got[step].get(k) == pytest.approx(v, rel=1e-6, abs=1e-6), (step, k)
    ckpt = torch.load(kept, weights_only=False)
    [state] = [v for k, v in ckpt["callbacks"].items() if "RolloutCallback" in k]
    # both ranks' batch for step 2 (generated by step 1's weights) are in the checkpoint
    assert sorted((a["rank"], a["index"], a["version"]) for a in state["ahead"]) == [
        (0, 2, 1),
        (1, 2, 1),
    ]


@pytest.mark.slow
def test_a_resume_on_another_number_of_processes_generates_the_kept_batches_again(
    two_ranks, cache_dir
):
    _, part, kept = two_ranks
    # 2 -> 1: rank 0 now draws all 4 prompts of step 2; rank 0's kept batch holds 2 of them
    one = part.parents[3] / "one"
    res = _train(
        one, cache_dir, f"ckpt_path={kept}",
        "trainer.devices=1", "trainer.max_steps=4",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    run = _run_folder(one)
    assert "batch 2 kept by the checkpoint" in _log(run), _log(run)[-3000:]
    assert "generating it again" in _log(run)
    step2 = _dump(run, 2, 0)
    assert len(step2["ids"]) == 8 and set(step2["versions"].tolist()) == {2}
    assert sorted(_rows(run)) == [2, 3]
    # 1 -> 2: rank 0's kept batch holds 4 prompts, rank 1 has none
    two = part.parents[3] / "two"
    res = _train(
        two, cache_dir, f"ckpt_path={run / 'checkpoints' / 'step000004.ckpt'}",
        "trainer.max_steps=5",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    run2 = _run_folder(two)
    text = _log(run2)
    assert "generating it again" in text and "train_ddp_process_1" in " ".join(
        p.name for p in run2.glob("train*.log")
    )
    for rank in (0, 1):
        d = _dump(run2, 4, rank)
        assert len(d["ids"]) == 4 and set(d["versions"].tolist()) == {4}


@pytest.mark.slow
def test_a_two_rank_async_run_resumes_with_each_rank_s_kept_batches(tmp_path, cache_dir):
    """async keeps up to max_staleness batches per rank; which weights sample them depends
    on timing, so the resumed run is compared by what it took, not by its numbers."""
    run = [o for o in RUN if not o.startswith("rollout.schedule=")]
    run += ["rollout.schedule=async", "rollout.max_staleness=2"]
    res = _train(tmp_path / "logs", cache_dir, "trainer.max_steps=2", run=run)
    assert res.returncode == 0, res.stderr[-4000:]
    folder = _run_folder(tmp_path / "logs")
    ckpt = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)
    [state] = [v for k, v in ckpt["callbacks"].items() if "RolloutCallback" in k]
    kept = {(a["rank"], a["index"]): a for a in state["ahead"]}
    assert sorted(kept) == [(0, 2), (0, 3), (1, 2), (1, 3)]
    res = _train(tmp_path / "logs", cache_dir, f"+resume={folder}", "trainer.max_steps=4", run=run)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "generating it again" not in _log(folder)
    for step in (2, 3):
        for rank in (0, 1):
            got = _dump(folder, step, rank)
            assert got["ids"][::2] == kept[rank, step]["ids"], (step, rank)  # G = 2
            gens = kept[rank, step]["generations"]
            rows = [row[: len(g["token_ids"])] for row, g in zip(got["tokens"].tolist(), gens)]
            assert rows == [g["token_ids"] for g in gens], (step, rank)
            assert set(got["versions"].tolist()) == {kept[rank, step]["version"]}
    assert sorted(_rows(folder)) == [0, 1, 2, 3]


# -- fast: RolloutSource alone -------------------------------------------------------------


COMMON = (
    "rl.group_size=2",
    "rollout.engine.own_copy=true",
    "rollout.schedule=one_step_off",
    "callbacks.sample_table=null",
    "callbacks.relevance_dump=null",
)


@pytest.fixture
def source_and_batch(train_cfg, one_torch_thread):
    trainer, module, dm = build(train_cfg(*COMMON, "rl.prompts_per_step=4"))
    source = next(c for c in trainer.callbacks if hasattr(c, "source")).source
    source.bind(module.policy, module.tokenizer, eos_token_ids(module.tokenizer, module.policy))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    yield source, batch.examples
    source.close()


def test_the_saved_batches_carry_their_rank_and_prompt_ids(source_and_batch):
    source, examples = source_and_batch
    source.rank = 1
    source.take(0, examples, 7, ahead=lambda j: (examples[:2], 8))
    [saved] = source.state_dict()["ahead"]
    assert saved["rank"] == 1 and saved["ids"] == [e.id for e in examples[:2]]


def test_a_kept_batch_is_taken_only_by_its_rank_for_its_prompts(source_and_batch, caplog):
    source, examples = source_and_batch
    source.take(0, examples, 7, ahead=lambda j: (examples[:2], 8))
    state = source.state_dict()
    [kept] = state["ahead"]
    source.close()
    # its own rank, the same prompts and seed: the kept generations, at their version
    source.load_state_dict(state)
    again = source.take(1, examples[:2], 8)
    assert int(again.versions.max()) == kept["version"] == 0
    assert again.response_ids.shape[0] == 4 and source.dropped == 0
    # another number of prompts (a resume on another number of processes): generated again
    source.load_state_dict(state | {"version": 1})
    with caplog.at_level(logging.INFO, logger="mrtpo.rollout.source"):
        more = source.take(1, examples, 8)
    assert more.response_ids.shape[0] == 8 and set(more.versions.tolist()) == {1}
    assert "batch 1 kept by the checkpoint" in caplog.text
    assert "generating it again" in caplog.text
    # the same prompts kept for another rank only: this rank generates its own
    caplog.clear()
    source.rank = 1
    source.load_state_dict(state | {"version": 1})
    with caplog.at_level(logging.INFO, logger="mrtpo.rollout.source"):
        other = source.take(1, examples[:2], 8)
    assert set(other.versions.tolist()) == {1}
    assert "for rank 0 only" in caplog.text


def test_a_batch_kept_by_an_older_checkpoint_without_prompt_ids_is_generated_again(
    source_and_batch,
):
    source, examples = source_and_batch
    source.take(0, examples, 7, ahead=lambda j: (examples[:2], 8))
    state = source.state_dict()
    source.close()
    old = [{k: v for k, v in a.items() if k not in ("rank", "ids")} for a in state["ahead"]]
    source.load_state_dict(state | {"version": 1, "ahead": old})
    again = source.take(1, examples[:2], 8)
    assert set(again.versions.tolist()) == {1}
