"""``src/export.py`` writes a model card, ``README.md`` in the exported folder (issue 41,
item 6): base model, task, method and its settings, rewards, steps, the final metrics of the
checkpoint's step and the commands that made it; nothing is written into the model folder,
and a checkpoint without its run's records still gets a card that says what is unknown."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
from tests.conftest import ROOT, SHARED_DATA

from mrtpo import api


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


@pytest.fixture
def run(tmp_path, cache_dir):
    return api.train([
        f"paths.log_dir={tmp_path}/logs", f"paths.cache_dir={cache_dir}",
        f"paths.data_dir={SHARED_DATA}", "trainer.max_steps=3", "rl.prompts_per_step=2",
        "rl.group_size=2", "rollout.sampling.max_new_tokens=8", "method=mrtpo_saw",
        "method.beta=0.25", "callbacks.model_checkpoint.every_n_train_steps=2",
    ])  # fmt: skip


def _export(tmp_path, cache_dir, ckpt, out):
    res = subprocess.run(
        [sys.executable, "src/export.py", f"ckpt_path={ckpt}", f"out={out}",
         f"paths.log_dir={tmp_path}/logs", f"paths.cache_dir={cache_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return (out / "README.md").read_text()


def test_the_card_says_what_made_the_policy(run, tmp_path, cache_dir):
    model_dir = cache_dir / "models" / "tiny-qwen2"
    before = _digest(model_dir)
    ckpt = run.run_dir / "checkpoints" / "step000002.ckpt"  # not the last step
    card = _export(tmp_path, cache_dir, ckpt, tmp_path / "exported")
    assert _digest(model_dir) == before  # the model folder is only read

    assert card.startswith("---\nlibrary_name: transformers\n")
    assert f"| base model | `{model_dir}` (model=tiny) |" in card
    assert "| task | `synthetic` |" in card and "| method | `mrtpo_saw` |" in card
    assert "| rewards | `count`, `first`, `include_1`, `last` |" in card
    assert "| steps | 2 |" in card
    assert "beta: 0.25" in card and "group_size: 2" in card and "lr: " in card
    # the metrics of step 2, not of the run's last step 3
    rows = [r for r in run.history() if "train/reward/total/mean" in r]
    at2 = next(r for r in rows if r["train/iteration"] == 2)
    assert f"| `train/reward/total/mean` | {at2['train/reward/total/mean']:.4g} |" in card
    assert "## Final metrics (the last logged step up to 2)" in card
    assert "python src/train.py " in card and "method=mrtpo_saw method.beta=0.25" in card
    assert f"python src/export.py ckpt_path={ckpt} out={tmp_path / 'exported'}" in card


def test_a_checkpoint_without_its_run_records_still_gets_a_card(run, tmp_path, cache_dir):
    alone = tmp_path / "alone" / "checkpoints"
    alone.mkdir(parents=True)
    for name in ("last.ckpt", "last.ckpt.sha256"):
        shutil.copy(run.run_dir / "checkpoints" / name, alone / name)
    card = _export(tmp_path, cache_dir, alone / "last.ckpt", tmp_path / "exported-alone")
    step = json.loads((tmp_path / "exported-alone" / "mrtpo_export.json").read_text())["step"]
    assert f"| steps | {step} |" in card and "| task | `unknown` |" in card
    assert "(the run's .hydra/config.yaml is missing)" in card
    assert "(no RL step metrics in the run's csv/metrics.csv)" in card
    assert "job.json is missing" in card
