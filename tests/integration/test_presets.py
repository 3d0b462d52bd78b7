"""Every paper preset (configs/experiment/) runs one RL step end to end: the preset as written,
with only the model swapped to ``tiny``, the engine to ``hf`` and the sizes shrunk (2 prompts,
2 samples, 4 new tokens) on the CPU trainer. The toy presets (demo, toy_*) have their own
tests (test_replication.py, test_sft.py). Nothing here needs ../shared: text-to-SQL and tool
calling train on tests/task_fixtures.py's data, instruction following on its generated set."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pandas as pd
import pytest
from tests.conftest import CONFIG_DIR
from tests.task_fixtures import make_public_data, rlla_rows

from mrtpo.pipeline import build, metrics_csv

TOY = ("demo", "toy_")
PRESETS = sorted(
    p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml") if not p.stem.startswith(TOY)
)
SMALL = [
    "model=tiny",
    "rollout=hf",
    "trainer=cpu",
    "trainer.max_steps=1",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rollout.sampling.max_new_tokens=4",
    "callbacks.progress=null",
    "data.val_prompts=0",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The task fixtures laid out as ``paths.data_dir``, plus ToolRL's RL training file under
    the name the tool-calling presets read (``toolrl_rlla/rlla_4k/train.parquet``)."""
    root = make_public_data(tmp_path_factory.mktemp("preset_data"))
    folder = root / "toolrl_rlla" / "rlla_4k"
    folder.mkdir(parents=True)
    pd.DataFrame(rlla_rows()).to_parquet(folder / "train.parquet")
    return root


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_one_step(preset, train_cfg, data_dir, tmp_path):
    task = preset.split("_", 1)[0]
    # text2sql and toolcall read the fixtures; ifeval trains on its offline generated set
    base = f"paths.data_dir={data_dir}"
    cfg = train_cfg(f"experiment={preset}", *SMALL, base)
    # the swaps took, and the rest is the preset's own (its optimizer, mini-batch, task)
    assert cfg.model.name_or_path.endswith("tiny-qwen2") and cfg.rollout.engine._target_.endswith(
        "HFEngine"
    )
    assert cfg.optim.lr == 1.0e-6 and cfg.rl.mini_batch_size in (256, 512)
    assert cfg.hydra.runtime.choices.task == task
    trainer, module, dm = build(cfg)
    try:
        trainer.fit(module, datamodule=dm)
    finally:
        close = getattr(module.task, "close", None)
        if callable(close):
            close()
    assert trainer.global_step == 1 and module.iteration == 1
    with open(metrics_csv(trainer)) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1
    names = module.task.reward_names
    values = [rows[0].get(f"train/reward/{k}/mean") for k in names]
    assert any(v not in (None, "") and not math.isnan(float(v)) for v in values), rows[0]
    assert (tmp_path / "policy" / "config.json").is_file()  # the end-of-run export
