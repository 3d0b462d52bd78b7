"""The engine-trainer gap for free (issue 28 item 1), on the tiny model.

With one update per step, the update's own forward gives pi_old's log-probs: the gap metrics
and the TIS weights come from it, with the same numbers as the extra no-grad pass that used to
compute them, and that pass is gone. Where it is still needed (several updates, a method that
reads pi_old's log-probs before the advantages, a policy with dropout) it stays.
"""

from __future__ import annotations

import csv
import logging
import math

import lightning as L
import pytest
import torch
from tests.integration.test_on_policy import OffsetEngine

from mrtpo.core.loss import EngineGap, engine_gap
from mrtpo.lightning.pipeline import build, metrics_csv
from mrtpo.step.passes import LogprobPasses

TAU = 0.7
CAP = 1.1  # some tokens' ratios are above it, some below


class WobblyEngine(OffsetEngine):
    """The HF engine, reporting the trainer's log-probs off by a different amount at every
    token (-0.3..0.3 nats): ratios on both sides of ``CAP``, sequences of differing ratio."""

    def offsets(self, row: int, n_tokens: int) -> torch.Tensor:
        return torch.tensor([0.3 * math.sin(1.7 * t + row) for t in range(n_tokens)])


class FirstGradients(L.Callback):
    """The gradients the first optimizer step applies (after clipping)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.grads is None:
            self.grads = {
                n: p.grad.detach().clone()
                for n, p in pl_module.policy.named_parameters()
                if p.grad is not None
            }


def _run(cfg, *, old_path: bool, monkeypatch):
    """One fit; returns (module, metrics rows, first gradients, no-grad forwards per step)."""
    with monkeypatch.context() as mp:
        if old_path:  # the extra no-grad pass, as before: the reference the new path must equal
            mp.setattr(LogprobPasses, "gap_in_update", lambda *a: False)
        return _fit(cfg)


def _fit(cfg):
    trainer, module, dm = build(cfg)
    grads = FirstGradients()
    trainer.callbacks.append(grads)
    counts = {"in_step": False, "no_grad": 0, "grad": 0}

    def count(mod, args, kwargs):
        if counts["in_step"]:
            counts["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    module.policy.register_forward_pre_hook(count, with_kwargs=True)
    step = module.training_step

    def counted_step(*a, **k):
        counts["in_step"] = True
        try:
            return step(*a, **k)
        finally:
            counts["in_step"] = False

    module.training_step = counted_step
    trainer.fit(module, datamodule=dm)
    with open(metrics_csv(trainer)) as f:
        rows = list(csv.DictReader(f))
    steps = max(1, int(trainer.global_step))
    return module, rows, grads.grads, counts["no_grad"] / steps, counts["grad"] / steps


def _cfg(train_cfg, tmp_path, name, *extra):
    return train_cfg(
        "rollout.engine._target_=tests.integration.test_gap_for_free.WobblyEngine",
        f"rollout.sampling.temperature={TAU}",
        "trainer.max_steps=1",
        "rl.prompts_per_step=3",
        "rl.micro_batch_size=4",  # two micro-batches of the one update
        f"paths.output_dir={tmp_path}/{name}",
        *extra,
    )


GAP_KEYS = (
    "train/rollout/logp_gap/mean",
    "train/rollout/logp_gap/max",
    "train/rollout/seq_ratio/mean",
    "train/rollout/seq_ratio/min",
    "train/rollout/seq_ratio/max",
    "train/rollout/tis_weight/mean",
    "train/rollout/tis_capped_frac",
)


@pytest.mark.parametrize("method", ["gdpo", "mrtpo"])
def test_gap_and_tis_from_the_update_equal_the_extra_pass(train_cfg, tmp_path, monkeypatch, method):
    extra = (f"method={method}", f"rl.tis_cap={CAP}", "optim.lr=1e-3")
    old, old_rows, old_grads, old_nograd, old_grad = _run(
        _cfg(train_cfg, tmp_path, "old", *extra), old_path=True, monkeypatch=monkeypatch
    )
    new, new_rows, new_grads, new_nograd, new_grad = _run(
        _cfg(train_cfg, tmp_path, "new", *extra), old_path=False, monkeypatch=monkeypatch
    )
    assert torch.equal(old.last.rollout.response_ids, new.last.rollout.response_ids)
    (a,), (b,) = old_rows, new_rows
    assert 0 < float(a["train/rollout/tis_capped_frac"]) < 1  # the cap bites on some tokens
    for k in (*GAP_KEYS, "train/loss", "train/clip_frac", "train/ratio_mean"):
        assert float(b[k]) == pytest.approx(float(a[k]), abs=1e-6, rel=1e-6), k
    assert sorted(a) == sorted(b)  # the same columns
    mask = old.last.rollout.response_mask
    torch.testing.assert_close(new.last.tis_weights, old.last.tis_weights, atol=1e-6, rtol=0)
    assert bool((new.last.tis_weights[~mask] == 0).all())
    assert old_grads.keys() == new_grads.keys()
    for k in old_grads:
        torch.testing.assert_close(new_grads[k], old_grads[k], atol=1e-6, rtol=1e-5)
    # 6 rows in micro-batches of 4: the old-policy pass was 2 forwards (mrtpo's replay
    # forwards are in both counts)
    assert old_nograd - new_nograd == 2, (old_nograd, new_nograd)
    assert old_grad == new_grad == 2


def test_without_tis_the_gap_is_logged_and_costs_no_forward(train_cfg, tmp_path, monkeypatch):
    _, old_rows, *_, old_nograd, _ = _run(
        _cfg(train_cfg, tmp_path, "old", "method=gdpo"), old_path=True, monkeypatch=monkeypatch
    )
    new, new_rows, *_, new_nograd, _ = _run(
        _cfg(train_cfg, tmp_path, "new", "method=gdpo"), old_path=False, monkeypatch=monkeypatch
    )
    assert (old_nograd, new_nograd) == (2, 0)
    for k in GAP_KEYS[:5]:
        assert float(new_rows[0][k]) == pytest.approx(float(old_rows[0][k]), abs=1e-6), k
    assert "train/rollout/tis_weight/mean" not in new_rows[0]
    assert new.last.tis_weights is None


def test_several_updates_keep_the_old_policy_pass(train_cfg, tmp_path, monkeypatch):
    _, rows, *_, nograd, grad = _run(
        _cfg(train_cfg, tmp_path, "ppo", "method=gdpo", "rl.ppo_epochs=2", f"rl.tis_cap={CAP}"),
        old_path=False,
        monkeypatch=monkeypatch,
    )
    assert (nograd, grad) == (2, 4)  # pi_old once; two epochs of two micro-batches
    assert float(rows[0]["train/rollout/tis_weight/mean"]) > 0


def test_a_policy_with_dropout_keeps_its_own_eval_pass(train_cfg, tmp_path, monkeypatch, caplog):
    cfg = _cfg(train_cfg, tmp_path, "drop", "method=gdpo")
    real_build = build

    def with_dropout(c):
        trainer, module, dm = real_build(c)
        module.policy.config.attention_dropout = 0.1
        return trainer, module, dm

    monkeypatch.setattr(f"{__name__}.build", with_dropout)
    with caplog.at_level(logging.INFO, logger="mrtpo.step.passes"):
        _, rows, *_, nograd, _ = _run(cfg, old_path=False, monkeypatch=monkeypatch)
    assert nograd == 2
    assert "attention_dropout=0.1" in caplog.text
    assert float(rows[0]["train/rollout/logp_gap/max"]) > 0


def test_engine_gap_over_row_blocks_equals_one_call():
    g = torch.Generator().manual_seed(1)
    trainer = -torch.rand((7, 9), generator=g) * 3
    engine = trainer + (torch.rand((7, 9), generator=g) - 0.5)
    mask = torch.rand((7, 9), generator=g) > 0.3
    mask[:, 0] = True
    whole, w_whole = engine_gap(trainer, engine, mask, tis_cap=1.2)
    acc, parts = EngineGap(1.2), []
    for rows in ([4, 0], [6, 2, 5], [1, 3]):
        idx = torch.tensor(rows)
        parts.append((idx, acc.add(trainer[idx], engine[idx], mask[idx])))
    for k, v in whole.items():
        assert acc.metrics()[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    for idx, w in parts:
        assert torch.equal(w, w_whole[idx])
