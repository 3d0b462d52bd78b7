"""``rollout=vllm`` trains for real: every task, the methods that matter for the engine, LoRA,
several updates per step, temperature 0.7, resume and FSDP. After every sync the engine holds
the trainer's weights, so the logged engine-trainer gap stays at fp32 noise; with the sync
switched off the same gap grows.

In-process runs share the session's engine (the callback's engine is swapped for it before
``fit``; ``bind`` pushes each run's policy into it before its first rollout)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
from tests.conftest import ROOT, SHARED_DATA
from tests.vllm.conftest import TINY_OVERRIDES

from mrtpo.lightning.callbacks.rollout import RolloutCallback
from mrtpo.lightning.pipeline import build, metrics_csv

GAP = "train/rollout/logp_gap/max"
NOISE = 1e-4  # fp32 noise is ~1e-6 here; a stale engine is off by > 1e-3


def fit_with_engine(cfg, engine, ckpt_path=None):
    trainer, module, dm = build(cfg)
    [cb] = [c for c in trainer.callbacks if isinstance(c, RolloutCallback)]
    cb.engine = engine
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, module, cb


def gaps(trainer) -> list[float]:
    with open(metrics_csv(trainer)) as f:
        rows = list(csv.DictReader(f))
    return [float(r[GAP]) for r in rows if r.get(GAP)]


def vllm_cfg(train_cfg, *overrides):
    return train_cfg("rollout=vllm", *TINY_OVERRIDES, *overrides)


def test_mrtpo_at_temperature_07_keeps_the_gap_at_fp32_noise(train_cfg, engine):
    cfg = vllm_cfg(
        train_cfg,
        "method=mrtpo",
        "trainer.max_steps=5",
        "rollout.sampling.temperature=0.7",
        "method.beta_warmup_steps=0",
        "optim.lr=1e-3",
    )
    trainer, module, _ = fit_with_engine(cfg, engine)
    g = gaps(trainer)
    assert module.iteration == 5 and len(g) == 5
    assert max(g) <= NOISE, g
    assert engine.weight_sync.num_syncs >= 5


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["model.lora.r=4", "optim.lr=1e-2"], id="lora"),
        pytest.param(["rl.ppo_epochs=2", "rl.mini_batch_size=2", "optim.lr=1e-3"], id="ppo2"),
        pytest.param(["method=gdpo", "optim.lr=1e-3"], id="gdpo"),
        pytest.param(["method=opsd", "optim.lr=1e-3"], id="opsd"),
    ],
)
def test_engine_matches_the_trainer_after_every_sync(train_cfg, engine, extra):
    cfg = vllm_cfg(train_cfg, "trainer.max_steps=3", "rollout.sampling.temperature=0.7", *extra)
    trainer, module, _ = fit_with_engine(cfg, engine)
    g = gaps(trainer)
    assert module.iteration == 3 and len(g) == 3
    assert max(g) <= NOISE, g


@pytest.mark.parametrize("task", ["text2sql", "ifeval", "toolcall"])
def test_every_task_trains_with_vllm(train_cfg, engine, task):
    if not SHARED_DATA.is_dir():
        pytest.skip(f"task={task} needs the public data files at {SHARED_DATA}")
    cfg = vllm_cfg(train_cfg, f"task={task}", "method=gdpo", "rollout.sampling.temperature=0.7")
    trainer, module, _ = fit_with_engine(cfg, engine)
    g = gaps(trainer)
    assert module.iteration == 2 and len(g) == 2
    assert max(g) <= NOISE, g


def test_custom_task_trains_with_vllm(train_cfg, engine, tmp_path, monkeypatch):
    mod = tmp_path / "user_rewards_vllm.py"
    mod.write_text("def has_a(prompt, response, **row):\n    return float('a' in response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [
        {"id": f"p{i}", "prompt": f"Write a word with the letter {c}."}
        for i, c in enumerate("abcdefgh")
    ]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = vllm_cfg(
        train_cfg,
        "task=custom",
        f"task.data.path={data}",
        "task.rewards=[user_rewards_vllm.has_a]",
        "task.data.id_column=id",
        "method=gdpo",
    )
    trainer, module, _ = fit_with_engine(cfg, engine)
    assert module.iteration == 2
    assert max(gaps(trainer)) <= NOISE


def test_a_switched_off_sync_shows_in_the_gap(train_cfg, engine, monkeypatch):
    monkeypatch.setattr(RolloutCallback, "on_train_batch_end", lambda *a, **k: None)
    cfg = vllm_cfg(
        train_cfg, "trainer.max_steps=3", "method=gdpo", "optim.lr=5e-2", "rl.group_size=4"
    )
    trainer, _, _ = fit_with_engine(cfg, engine)
    g = gaps(trainer)
    assert g[0] <= NOISE  # the first rollout follows bind's sync
    assert max(g[1:]) > 1e-3, g  # later ones sample from stale weights, and it shows


def test_resume_resyncs_the_engine(train_cfg, engine, tmp_path):
    from tests.vllm.conftest import perturbed_copy

    first = vllm_cfg(train_cfg, "trainer.max_steps=2", "method=gdpo", "optim.lr=1e-3")
    trainer, module, _ = fit_with_engine(first, engine)
    ckpt = trainer.checkpoint_callback.last_model_path or str(next((tmp_path).rglob("last.ckpt")))
    engine.sync_weights(perturbed_copy(module.policy))  # an engine holding other weights
    more = vllm_cfg(train_cfg, "trainer.max_steps=4", "method=gdpo", "optim.lr=1e-3")
    trainer2, module2, cb = fit_with_engine(more, engine, ckpt_path=ckpt)
    g = gaps(trainer2)
    assert module2.iteration == 4 and cb.resyncs == 1
    assert max(g) <= NOISE, g


def test_fsdp_two_gloo_ranks_sync_gathered_weights(tmp_path, cache_dir):
    """Each rank all-gathers the shards a bucket at a time and reloads its own engine."""
    cmd = [
        sys.executable,
        str(ROOT / "src" / "train.py"),
        "rollout=vllm",
        *TINY_OVERRIDES,
        "trainer=fsdp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "trainer.max_steps=2",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rollout.sampling.max_new_tokens=8",
        "rollout.sampling.temperature=0.7",
        "method=gdpo",
        "optim.lr=1e-3",
        f"paths.cache_dir={cache_dir}",
        f"hydra.run.dir={tmp_path}/run",
        "callbacks.progress=null",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        g = [float(r[GAP]) for r in csv.DictReader(f) if r.get(GAP)]
    assert len(g) == 2 and max(g) <= NOISE, g
