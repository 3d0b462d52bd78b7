"""rl.shared_prompt_forward in training: the update, old-policy and reference passes run each
prompt once and the step's numbers are those of the plain forwards (one process, and two gloo
DDP ranks)."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest
from tests.conftest import ROOT
from tests.integration.test_ddp import _env

from mrtpo import forward


def _first_step(path) -> dict[str, float]:
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/iteration")]
    out = {}
    for k, v in rows[0].items():
        timed = k.startswith("train/time/") or k.endswith("_per_s")
        if k.startswith("train/") and not timed and v not in ("", "nan"):
            out[k] = float(v)
    return out


def _assert_same_numbers(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys() and "train/loss" in a
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])


def test_shared_prompt_step_matches_plain_step(train_cfg, tmp_path, monkeypatch):
    from mrtpo.pipeline import train

    calls = []
    real = forward._shared_prompt_logits

    def counted(model, groups, *args):
        calls.append((model.training, len(groups.first), len(groups.row_prefix)))
        return real(model, groups, *args)

    monkeypatch.setattr(forward, "_shared_prompt_logits", counted)
    steps = {}
    for mode in ("always", "false"):
        out = tmp_path / mode
        # kl_coef > 0: the reference pass too; two epochs: the old-policy pass too
        cfg = train_cfg(
            "method=gdpo",
            f"rl.shared_prompt_forward={mode}",
            "rl.kl_coef=0.05",
            "rl.ppo_epochs=2",
            "trainer.max_steps=1",
            f"paths.output_dir={out}",
        )
        train(cfg)
        steps[mode] = _first_step(out / "csv" / "metrics.csv")
        if mode == "always":
            # old-policy and reference passes (eval) and the two updates (train)
            assert [c[0] for c in calls].count(True) == 2, calls
            assert [c[0] for c in calls].count(False) >= 2, calls
            assert all(c[1] < c[2] for c in calls), calls  # fewer prompts than rows
            calls.clear()
    assert calls == []
    _assert_same_numbers(steps["always"], steps["false"])


@pytest.mark.slow
def test_shared_prompt_under_ddp_matches_plain(tmp_path, cache_dir):
    """Two gloo ranks: the shared forward keeps the ranks in step (one backward, one gradient
    all-reduce per micro-batch) and the first step's numbers are the plain run's."""
    steps = {}
    for mode in ("always", "false"):
        res = subprocess.run(
            [
                sys.executable,
                "src/train.py",
                "trainer=ddp",
                "task=synthetic",
                "method=gdpo",
                "trainer.max_steps=1",
                "rl.prompts_per_step=2",
                "rl.group_size=3",
                "rl.ppo_epochs=2",
                f"rl.shared_prompt_forward={mode}",
                "rollout.sampling.max_new_tokens=8",
                "callbacks.progress=null",
                f"paths.log_dir={tmp_path}/{mode}",
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
        (metrics,) = (tmp_path / mode).rglob("metrics.csv")
        steps[mode] = _first_step(metrics)
    _assert_same_numbers(steps["always"], steps["false"])
