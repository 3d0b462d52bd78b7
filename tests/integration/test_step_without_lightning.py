"""The RL step runs without Lightning (issue 38): ``mrtpo.step`` imports neither Lightning nor
Hydra, and a plain loop (a rollout source, the step, a torch optimizer) gives the numbers the
Lightning run recorded in ``step_reference.json``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tests.integration.test_step_equivalence import (
    REFERENCE,
    _overrides,
    _tensor,
    check_step,
    check_updates,
    watch_updates,
)

from mrtpo.core.models import eos_token_ids
from mrtpo.lightning.pipeline import build
from mrtpo.rollout.source import RolloutSource
from mrtpo.step import TorchHost

FRAMEWORKS = ("lightning", "pytorch_lightning", "hydra", "omegaconf")


def test_the_step_imports_no_training_framework():
    code = (
        "import sys, mrtpo.step, mrtpo.rollout.source, mrtpo.rollout.hf; "
        f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported: {out.stdout.strip()}"


@pytest.mark.recorded
def test_a_plain_loop_gives_the_lightning_runs_numbers(train_cfg):
    method, shape = "mrtpo", "several"
    want = json.loads(REFERENCE.read_text())[f"{method}/{shape}"]
    cfg = train_cfg(*_overrides(method, shape))
    # the pieces a run is made of; Lightning's trainer itself is not used below
    trainer, module, dm = build(cfg)
    [callback] = [c for c in trainer.callbacks if hasattr(c, "source")]
    source: RolloutSource = callback.source
    step, policy = module.step, module.policy
    source.bind(policy, module.tokenizer, eos_token_ids(module.tokenizer, policy))
    # the recorded runs' optimizer (SGD: see test_step_equivalence), its updates watched
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=cfg.optim.lr)
    updates: list[dict] = []
    watch_updates(opt, dict(policy.named_parameters()), updates)
    host = TorchHost(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    policy.train()
    for i in range(2):
        batch = next(batches)
        roll = source.sample(batch.examples, RolloutSource.seed(int(cfg.seed), step.iteration, 0))
        record = step.run(roll, host).record
        got = {"response_ids": _tensor(record.rollout.response_ids)}
        for key in ("rewards", "old_logp", "ref_logp", "tis_weights", "q", "advantages"):
            got[key] = _tensor(getattr(record, key))
        check_step(got, {k: want["steps"][i][k] for k in got}, f"plain loop step {i}")
    check_updates(updates, want["updates"], "plain loop")
