"""The step's record carries the method's beta and per-token weights (issue 48, item 3), so
the relevance dumps and batch dumps read them rather than asking the method again."""

from __future__ import annotations

import torch
from tests.integration.test_step_equivalence import _overrides

from mrtpo.core.models import eos_token_ids
from mrtpo.lightning.pipeline import build
from mrtpo.rollout.source import RolloutSource
from mrtpo.step import TorchHost


def _records(train_cfg, method: str, steps: int = 2) -> list:
    cfg = train_cfg(*_overrides(method, "several"))
    trainer, module, dm = build(cfg)
    [callback] = [c for c in trainer.callbacks if hasattr(c, "source")]
    source: RolloutSource = callback.source
    step, policy = module.step, module.policy
    source.bind(policy, module.tokenizer, eos_token_ids(module.tokenizer, policy))
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=cfg.optim.lr)
    host = TorchHost(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    policy.train()
    out = []
    for _ in range(steps):
        batch = next(batches)
        roll = source.sample(batch.examples, RolloutSource.seed(int(cfg.seed), step.iteration, 0))
        out.append((step.run(roll, host).record, step.iteration))
    return [(r, it, module.method) for r, it in out]


def test_the_record_holds_beta_and_the_methods_token_weights(train_cfg):
    for record, it, method in _records(train_cfg, "mrtpo"):
        assert record.beta == float(method.schedule(it - 1)["beta"]) > 0  # no warm-up
        assert record.q is not None and record.token_weights is not None
        mask, replayed = record.rollout.response_mask, record.replayed
        want = method.token_weights(record.q, mask, replayed, it - 1)
        assert torch.equal(record.token_weights, want)
