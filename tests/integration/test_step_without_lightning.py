"""The RL step runs without Lightning (issue 38): ``mrtpo.step`` imports neither Lightning nor
Hydra, and a plain loop (a rollout source, the step, a torch optimizer) gives the numbers the
Lightning run recorded in ``step_reference.json``."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from tests.integration.test_step_equivalence import REFERENCE, _close, _overrides, _tensor

from mrtpo.models import eos_token_ids
from mrtpo.pipeline import build
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
    before = {n: p.detach().double().clone() for n, p in policy.named_parameters()}
    opt = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=float(cfg.optim.lr),
        weight_decay=float(cfg.optim.weight_decay),
        betas=tuple(cfg.optim.betas),
    )
    host = TorchHost(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    policy.train()
    for i in range(2):
        batch = next(batches)
        roll = source.sample(batch.examples, RolloutSource.seed(int(cfg.seed), step.iteration, 0))
        record = step.run(roll, host).record
        w = want["steps"][i]
        _close(_tensor(record.rollout.response_ids), w["response_ids"], f"step {i} tokens")
        for key in ("rewards", "old_logp", "ref_logp", "tis_weights", "q", "advantages"):
            _close(_tensor(getattr(record, key)), w[key], f"plain loop step {i} {key}")
    lr = float(cfg.optim.lr)
    for n, p in policy.named_parameters():
        d = (p.detach().double() - before[n]) / lr
        _close([float(d.sum()), float(d.square().sum())], want["params"][n], f"params {n}")
