"""Two gloo ranks holding halves of a batch update and log as one process holding all of it
(issue 37, case 11): the global mini-batches are drawn from the whole batch, and the logged
means of per-token statistics (the engine gap, TIS weights) and the advantages' spread are
those of the global batch, not unweighted means of the ranks' values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mrtpo.core.batch import ScoredBatch, rewards_tensor
from mrtpo.core.loss import engine_gap
from mrtpo.core.models import load_policy
from mrtpo.distributed import Ranks
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.rollout.hf import HFEngine
from mrtpo.run.settings import RLConfig
from mrtpo.step import Advantages, OldPolicy, StepRecord, TorchHost
from mrtpo.step import metrics as step_metrics
from mrtpo.step.update import Updater
from mrtpo.tasks.synthetic.task import SyntheticTask

SPLIT = 6  # rank 0 holds 3 prompts' responses, rank 1 the other 5 (unequal on purpose)
# per rank: 2 ranks x 2 responses make the one process's global mini-batch of 4
RL = {"micro_batch_size": 2, "ppo_epochs": 2, "max_grad_norm": 1.0}


def _batch(model_dir: str):
    """A real rollout of the tiny model (8 prompts x 2 samples), its rewards, fixed
    advantages and pi_old log-probs a little off the policy's (ratios away from 1)."""
    torch.manual_seed(0)
    model, tok = load_policy(model_dir, tiny={})
    task = SyntheticTask(num_constraints=3)
    engine = HFEngine()
    eos = [tok.eos_token_id]
    engine.bind(model, tok, eos)
    sampling = SamplingConfig(max_new_tokens=6)
    roll = build_rollout(engine, tok, list(task.examples("train"))[:8], 2, sampling, 11, eos)
    scores = task.score_many(roll.examples, roll.texts)
    names = tuple(task.reward_names)
    scored = ScoredBatch(roll, scores, names, rewards_tensor(scores, names))
    g = torch.Generator().manual_seed(5)
    mask = roll.response_mask
    adv = torch.randn(roll.n, generator=g)[:, None].expand(mask.shape) * mask
    old = -torch.rand(mask.shape, generator=g) * 3 * mask
    engine_logp = old + (torch.rand(mask.shape, generator=g) - 0.5) * mask
    return model, tok, scored, adv, old, engine_logp


def _rows(scored: ScoredBatch, idx: torch.Tensor) -> ScoredBatch:
    sub = scored.rollout.select(idx)
    return ScoredBatch(sub, [scored.scores[i] for i in idx.tolist()], scored.reward_names,
                       scored.rewards[idx])  # fmt: skip


def _update(model, tok, scored, adv, old, engine_logp, ranks: Ranks, mini: int) -> dict:
    """One step's updates (DDP's gradient mean done by hand) and the step's logged metrics."""
    model.train()
    updater = Updater(
        model,
        RLConfig(**RL, mini_batch_size=mini),
        ranks,
        tok.pad_token_id,
        lambda: torch.device("cpu"),
    )

    class Host(TorchHost):
        """DDP's gradient mean over ranks, done by hand before the clipping and the step."""

        averaged = False

        def _average(self) -> None:
            if ranks.group is not None and not self.averaged:
                for p in self.params:
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=ranks.group)
                        p.grad /= ranks.world_size
            self.averaged = True

        def zero_grad(self) -> None:
            super().zero_grad()
            self.averaged = False

        def clip_gradients(self, max_norm: float) -> None:
            self._average()
            super().clip_gradients(max_norm)

        def optimizer_step(self, counted: bool) -> None:
            self._average()
            super().optimizer_step(counted)

    host = Host(torch.optim.SGD(model.parameters(), lr=0.5))

    class NoTokenLoss:
        wants_logits = False

        @staticmethod
        def token_loss(*a, **k):
            return None

    gen = torch.Generator().manual_seed(104729)
    upd = updater(host, NoTokenLoss(), scored, OldPolicy(logp=old), Advantages(adv), gen)
    gap, _ = engine_gap(old, engine_logp, scored.rollout.response_mask, tis_cap=1.05)
    record = StepRecord(scored.rollout, scored.scores, scored.reward_names, scored.rewards,
                        advantages=adv, stats={})  # fmt: skip
    stats = step_metrics.assemble(
        record, {**upd.metrics, **gap}, {}, {}, {}, success_check=None, schedule={},
        iteration=1, nonfinite_skips=0, scoring_errors=0.0,
    )  # fmt: skip
    m = step_metrics.combine(stats, ranks)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "metrics": m}


def _worker(rank: int, init_file: str, out_dir: str, model_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model, tok, scored, adv, old, elp = _batch(model_dir)
        idx = torch.arange(SPLIT) if rank == 0 else torch.arange(SPLIT, scored.rollout.n)
        out = _update(model, tok, _rows(scored, idx), adv[idx], old[idx], elp[idx], Ranks(), 2)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_ranks_update_and_log_as_one_process(tmp_path: Path, cache_dir: Path, tiny) -> None:
    model_dir = str(cache_dir / "models" / "tiny-qwen2")  # built by the tiny fixture
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker,
        args=(str(tmp_path / "init"), str(tmp_path), model_dir),
        nprocs=2,
        start_method=method,
    )
    model, tok, scored, adv, old, elp = _batch(model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    one = _update(model, tok, scored, adv, old, elp, Ranks(), 4)
    moved = max(float((one["params"][n] - before[n]).abs().max()) for n in before)
    assert moved > 1e-3  # the updates do something
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for n, p in one["params"].items():
            torch.testing.assert_close(got["params"][n], p, atol=2e-6, rtol=1e-5, msg=n)
        for key in (
            "rollout/logp_gap/mean",
            "rollout/tis_capped_frac",
            "rollout/tis_weight/mean",
            "rollout/seq_ratio/mean",
            "adv/std",
            "adv/mean",
            "ratio_mean",
            "clip_frac",
        ):
            assert got["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), (
                key
            )
