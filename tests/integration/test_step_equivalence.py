"""Two RL steps of every method give the numbers recorded before the step's redesign (issue 38).

The reference (``step_reference.json`` beside this file) was written by this module's
``record`` at commit f3428bb, before the step moved out of the LightningModule: for each
method, each step's sampled tokens, rewards, old-policy / reference / engine log-probs,
relevance, token advantages, the logged metrics (times left out), and after the two steps a
per-tensor sum and sum of squares of every parameter's change (in units of the learning
rate). Any change to how a step computes fails here, to 1e-6.

Rewrite the reference only for an intended change of numbers, saying why in the commit:
``python -m tests.integration.test_step_equivalence`` (from the repository root).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from mrtpo.pipeline import build

REFERENCE = Path(__file__).with_name("step_reference.json")
TOL = 1e-6

#: method -> its overrides; every relevance method replays from the first step (no warm-up).
METHODS = {
    "grpo": (),
    "gdpo": (),
    "gdpo_saw": (),
    "mrtpo": ("method.beta_warmup_steps=0",),
    "mrtpo_saw": ("method.beta_warmup_steps=0",),
    "mrtpo_shuffle": ("method.beta_warmup_steps=0",),
    "mrtpo_joint": ("method.beta_warmup_steps=0",),
    "opsd": ("rollout.sampling.temperature=1.0",),
    "cort": ("method.beta_warmup_steps=0",),
}

#: Two shapes of step: several updates (pi_old's own pass, a KL reference, TIS weights from
#: the engine's log-probs) and one update (the engine gap measured in the update's forward).
SHAPES = {
    "several": ("rl.mini_batch_size=2", "rl.kl_coef=0.01", "rl.tis_cap=2.0"),
    "one": ("rl.mini_batch_size=8", "rl.measure_logp_gap=true"),
}

# Metrics that measure time (or depend on it) differ run to run.
_TIMED = ("time/", "tokens_per_s")


def _rounded(x):
    """Floats to 10 significant digits (far below the tolerance; a smaller file)."""
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return float(f"{x:.10g}") if isinstance(x, float) and math.isfinite(x) else x


def _tensor(x) -> list | None:
    if x is None:
        return None
    return torch.as_tensor(x).detach().to(torch.float64).cpu().tolist()


class _Record(L.Callback):
    """Each step's tensors and metrics, read after the step (and its weight push)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        last = pl_module.last
        metrics = {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith("train/") and not any(t in k for t in _TIMED)
        }
        self.steps.append(
            {
                "response_ids": _tensor(last.rollout.response_ids),
                "rewards": _tensor(last.rewards),
                "engine_logp": _tensor(last.rollout.engine_logp),
                "old_logp": _tensor(last.old_logp),
                "ref_logp": _tensor(last.ref_logp),
                "tis_weights": _tensor(last.tis_weights),
                "q": _tensor(last.q),
                "advantages": _tensor(last.advantages),
                "metrics": metrics,
            }
        )


def record(cfg) -> dict:
    """Two steps of ``cfg``: each step's record and the parameters' sums afterwards."""
    trainer, module, dm = build(cfg)
    rec = _Record()
    trainer.callbacks.append(rec)
    before = {n: p.detach().double().clone() for n, p in module.policy.named_parameters()}
    trainer.fit(module, datamodule=dm)
    # the two steps' change of each parameter tensor in units of the learning rate (its sum
    # and sum of squares): the parameters themselves would hide a wrong update of that size
    lr = float(cfg.optim.lr)
    params = {}
    for n, p in module.policy.named_parameters():
        d = (p.detach().double() - before[n]) / lr
        params[n] = [float(d.sum()), float(d.square().sum())]
    return {"steps": rec.steps, "params": params}


def _overrides(method: str, shape: str) -> list[str]:
    return [
        f"method={method}",
        "trainer.max_steps=2",
        "rl.prompts_per_step=2",
        "rl.group_size=4",
        "rollout.sampling.max_new_tokens=8",
        "logger=csv",
        *METHODS[method],
        *SHAPES[shape],
    ]


def _close(got, want, where: str) -> None:
    if want is None or got is None:
        assert got is None and want is None, f"{where}: {got!r} vs {want!r}"
        return
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), f"{where}: keys {sorted(got)} vs {sorted(want)}"
        for k in want:
            _close(got[k], want[k], f"{where}.{k}")
        return
    g = torch.tensor(got, dtype=torch.float64)
    w = torch.tensor(want, dtype=torch.float64)
    assert g.shape == w.shape, f"{where}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
    same_nan = torch.isnan(g) == torch.isnan(w)
    assert bool(same_nan.all()), f"{where}: NaN at other places"
    ok = torch.isnan(w) | torch.isclose(g, w, rtol=TOL, atol=TOL)
    assert bool(ok.all()), f"{where}: max difference {float((g - w)[~ok].abs().max())}"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", list(METHODS))
def test_two_steps_equal_the_recorded_ones(train_cfg, method, shape):
    want = json.loads(REFERENCE.read_text())[f"{method}/{shape}"]
    got = record(train_cfg(*_overrides(method, shape)))
    assert len(got["steps"]) == len(want["steps"]) == 2
    for i, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        for key in w:
            _close(g[key], w[key], f"{method}/{shape} step {i} {key}")
    _close(got["params"], want["params"], f"{method}/{shape} params")


def _write_reference() -> None:  # pragma: no cover - run by hand, see the module docstring
    import tempfile

    from tests.conftest import SHARED_DATA, compose_config  # (sets threads, offline)

    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            for shape in SHAPES:
                base = [
                    f"paths.output_dir={tmp}/{method}-{shape}",
                    f"paths.log_dir={tmp}/logs",
                    f"paths.cache_dir={tmp}/cache",
                    f"paths.data_dir={SHARED_DATA}",
                    "print_config=false",
                    "callbacks.progress=null",
                ]
                cfg = compose_config("train.yaml", base + _overrides(method, shape))
                out[f"{method}/{shape}"] = record(cfg)
                print(method, shape, "recorded", file=sys.stderr)
    assert all(math.isfinite(v) for r in out.values() for p in r["params"].values() for v in p)
    REFERENCE.write_text(json.dumps(_rounded(out), indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {REFERENCE} ({REFERENCE.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    _write_reference()
