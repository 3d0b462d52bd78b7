"""Text-to-SQL on a user's clone: the real task config on Spider-shaped data built here
(tests/task_fixtures.py), the paper's 4,096-token prompt drop with the tiny tokenizer, and a
one-step training run. Nothing here needs ../shared."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
from hydra.utils import instantiate
from tests.task_fixtures import CONCERT_QUESTIONS, make_spider


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return make_spider(tmp_path_factory.mktemp("spider_like"))


def test_config_loads_the_fixture_and_drops_what_cannot_be_scored(train_cfg, data_dir):
    cfg = train_cfg("task=text2sql", f"paths.data_dir={data_dir}")
    assert cfg.task.schema_max_chars is None  # full schemas unless a budget is asked for
    task = instantiate(cfg.task)
    try:
        train = task.examples("train")
        stats = task.load_stats["train"]
        assert stats["read"] == len(CONCERT_QUESTIONS) + 3 + 2
        assert stats["missing_databases"] == {"missing_db": 1}
        assert [why for _, why in stats["gold_failures"]] == ["no such column: no_such_column"]
        assert len(train) == stats["kept"] == len(CONCERT_QUESTIONS) + 3
        scores = task.score_many(train, [e.reference for e in train])
        assert all(s.rewards == dict.fromkeys(task.reward_names, 1.0) for s in scores)
    finally:
        task.close()


def test_prompts_over_max_prompt_tokens_are_dropped_and_counted(train_cfg, data_dir, tiny, caplog):
    """Full schemas plus the paper's drop: ``wide_db``'s three prompts are far over 4,096
    tokens of the tiny tokenizer, the six others far under; the DataModule drops and logs 3."""
    from mrtpo.lightning.data import PromptDataModule

    _, tok = tiny
    cfg = train_cfg("task=text2sql", f"paths.data_dir={data_dir}")
    task = instantiate(cfg.task)
    try:
        train = list(task.examples("train"))
        lengths = [
            len(tok(tok.apply_chat_template(e.messages, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"])
            for e in train
        ]  # fmt: skip
        long = {e.id for e, n in zip(train, lengths, strict=True) if n > 4096}
        assert {e.data["db_id"] for e in train if e.id in long} == {"wide_db"}
        assert len(long) == 3 and max(n for n in lengths if n <= 4096) < 2048
        dm = PromptDataModule(task, max_prompt_tokens=4096, tokenizer=tok)
        with caplog.at_level(logging.WARNING, logger="mrtpo.lightning.data"):
            dm.setup("fit")
        assert {e.id for e in dm.train_examples} == {e.id for e in train} - long
        assert "dropped 3 of 9 train prompts longer than data.max_prompt_tokens=4096" in caplog.text
    finally:
        task.close()


def test_one_training_step_on_the_fixture(train_cfg, data_dir):
    from mrtpo.lightning.pipeline import build, metrics_csv

    cfg = train_cfg(
        "task=text2sql", "method=mrtpo", f"paths.data_dir={data_dir}", "trainer.max_steps=1"
    )
    trainer, module, dm = build(cfg)
    try:
        trainer.fit(module, datamodule=dm)
        assert trainer.global_step == 1
        with open(metrics_csv(trainer)) as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 1
        for name in ("format", "executability", "execution"):
            assert 0.0 <= float(rows[0][f"train/reward/{name}/mean"]) <= 1.0
    finally:
        module.task.close()
