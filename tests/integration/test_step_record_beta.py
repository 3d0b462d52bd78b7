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


def test_each_step_makes_its_token_weights_once(train_cfg, monkeypatch):
    """The record holds the weights the advantages used, not a second computation of them:
    one call of the weight function per replayed step (two before: the method's, then the
    step's own for the record), and for CoRT its weights are the record's."""
    import mrtpo.core.credit.cort as cort
    import mrtpo.core.credit.methods as methods

    calls = []
    for mod, name in ((methods, "relevance_weights"), (cort, "cort_weights")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=real, **k: calls.append(1) or _f(*a, **k))
    for method in ("mrtpo", "cort"):
        calls.clear()
        records = _records(train_cfg, method)
        assert len(calls) == len(records), method
        for record, it, m in records:
            mask, replayed = record.rollout.response_mask, record.replayed
            assert torch.equal(
                record.token_weights, m.token_weights(record.q, mask, replayed, it - 1)
            )
