"""Text-to-SQL on the real public files (../shared/data): loaders, self-scoring of every
reference query, scoring a predictions file, and the Hydra configs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mrtpo.core.evaluation import score_responses
from mrtpo.tasks.text2sql import Text2SQLTask

ROOT = Path(__file__).resolve().parents[2]


def make_task(data: Path, **kw) -> Text2SQLTask:
    spider_db = str(data / "spider" / "database")
    return Text2SQLTask(
        splits={
            "train": {
                "file": str(data / "spider_syn" / "train_spider.json"),
                "db_dir": [spider_db],
                "question_field": "SpiderQuestion",
                "drop_failing_gold": True,
            },
            "spider_dev": {"file": str(data / "spider" / "dev.json"), "db_dir": [spider_db]},
            "spider_syn_dev": {
                "file": str(data / "spider_syn" / "dev.json"),
                "db_dir": [spider_db],
                "question_field": "SpiderSynQuestion",
            },
            "spider_dk": {
                "file": str(data / "spider_dk" / "Spider-DK.json"),
                "db_dir": [str(data / "spider_dk" / "database"), spider_db],
            },
        },
        **kw,
    )


@pytest.fixture(scope="module")
def task(shared_data):
    t = make_task(shared_data)
    yield t
    t.close()


def test_first_50_dev_references_match_themselves(shared_data):
    t = make_task(shared_data, max_examples=50)
    try:
        exs = t.examples("val")
        assert len(exs) == 50
        scores = t.score_many(exs, [e.reference for e in exs])
        assert t.summarize(exs, scores)["exec_acc"] == 1.0
    finally:
        t.close()


def test_all_972_dev_references_match_themselves_quickly(task):
    t0 = time.monotonic()
    exs = task.examples("spider_dev")
    loaded = time.monotonic() - t0
    scores = task.score_many(exs, [e.reference for e in exs])
    took = time.monotonic() - t0
    print(
        f"spider dev: {len(exs)} questions loaded in {loaded:.2f} s, scored in {took:.2f} s total"
    )
    assert len(exs) == 972
    assert task.load_stats["spider_dev"]["missing_databases"] == {"wta_1": 62}
    metrics = task.summarize(exs, scores)
    assert metrics["exec_acc"] == 1.0
    assert metrics["reward/format"] == 1.0 and metrics["reward/executability"] == 1.0
    assert metrics["n_databases"] == 19.0
    assert all(metrics[f"exec_acc/{e.data['db_id']}"] == 1.0 for e in exs)
    assert took < 120


def test_ids_are_positions_in_the_file(task, shared_data):
    rows = json.loads((shared_data / "spider" / "dev.json").read_text())
    for e in task.examples("spider_dev")[::97]:
        row = rows[int(e.id)]
        assert row["query"] == e.data["query"] and row["question"] in e.messages[-1]["content"]


def test_spider_syn_uses_the_synonym_questions(task):
    syn = task.examples("spider_syn_dev")
    dev = task.examples("spider_dev")
    assert len(syn) == 972 and [e.id for e in syn] == [e.id for e in dev]
    assert "How many vocalists do we have?" in syn[0].messages[-1]["content"]
    scores = task.score_many(syn, [e.reference for e in syn])
    assert task.summarize(syn, scores)["exec_acc"] == 1.0


def test_spider_dk_finds_databases_in_both_folders(task):
    exs = task.examples("spider_dk")
    assert len(exs) == 535 - 62  # wta_1 is missing here too
    dbs = {e.data["db_id"]: e.data["db_path"] for e in exs}
    assert "spider_dk" in dbs["new_concert_singer"] and "spider_dk" not in dbs["car_1"]
    scores = task.score_many(exs, [e.reference for e in exs])
    failing = [
        (e.id, s.reasons["executability"])
        for e, s in zip(exs, scores)
        if s.rewards["execution"] != 1.0
    ]
    # one Spider-DK reference has a missing comma ("T1.LName  T1.age"): a real annotation error
    assert failing == [("76", 'near ".": syntax error')]


def test_training_split_with_limit_checks_only_what_it_needs(shared_data):
    t = make_task(shared_data, max_examples=20)
    try:
        exs = t.examples("train")
        assert len(exs) == 20 and exs[0].id == "0"
        assert (
            "How many heads of the departments are older than 56 ?"
            in exs[0].messages[-1]["content"]
        )
        assert (
            exs[0].reference.startswith("<think>")
            and "SELECT count(*) FROM head" in exs[0].reference
        )
    finally:
        t.close()


@pytest.mark.slow
def test_training_split_drops_failing_references_and_remembers_them(shared_data, tmp_path):
    t = make_task(shared_data, cache_dir=str(tmp_path))
    try:
        t0 = time.monotonic()
        exs = t.examples("train")
        first = time.monotonic() - t0
        stats = t.load_stats["train"]
        assert stats["read"] == 7000 and len(exs) == 6901
        assert stats["missing_databases"] == {"baseball_1": 82, "soccer_1": 14}
        assert [qid for qid, _ in stats["gold_failures"]] == ["3153", "4513", "4514"]
        assert list(tmp_path.rglob("gold_check_train_*.json"))
    finally:
        t.close()
    again = make_task(shared_data, cache_dir=str(tmp_path))
    t0 = time.monotonic()
    assert [e.id for e in again.examples("train")] == [e.id for e in exs]
    print(
        f"train load: {first:.1f} s checking references, {time.monotonic() - t0:.1f} s from cache"
    )
    assert again._executor is None  # nothing was executed the second time


def test_scoring_a_predictions_file(task, tmp_path):
    exs = task.examples("spider_dev")[:40]
    lines = [{"id": e.id, "response": e.reference} for e in exs[:30]]
    lines.append(
        {"id": exs[30].id, "response": "<think>x</think><answer>```sql\nSELECT 1\n```</answer>"}
    )
    lines.append({"id": exs[31].id, "response": "I don't know"})
    lines.append(
        {
            "id": exs[32].id,
            "response": "<think>x</think><answer>```sql\nDROP TABLE singer\n```</answer>",
        }
    )
    path = tmp_path / "preds.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    metrics = score_responses(task, task.eval_examples("spider_dev", {}), path, tmp_path / "out")
    assert metrics["exec_acc"] == pytest.approx(30 / 33)
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["exec_acc"] == pytest.approx(30 / 33)
    rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 33
    assert rows[30]["reward/execution"] == 0.0 and "differs" in rows[30]["reasons"]["execution"]
    assert rows[31]["reasons"]["executability"] == "no <answer> tag"
    assert "not authorized" in rows[32]["reasons"]["executability"]
    assert rows[0]["check/db"] == exs[0].data["db_id"]


def test_eval_examples_selectors(task):
    every = task.eval_examples("spider_dev", {})
    exs = task.eval_examples("spider_dev", {"categories": ["concert_singer"], "limit": 5})
    assert {e.data["db_id"] for e in exs} == {"concert_singer"}
    # eval.limit is the evaluation job's, which counts the whole split (issue 40 item 4)
    assert len(exs) == sum(e.data["db_id"] == "concert_singer" for e in every) > 5
    with pytest.raises(ValueError, match="db_id"):
        task.eval_examples("spider_dev", {"categories": ["nope"]})


def test_offline_missing_splits_name_their_config_key(shared_data):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "configs" / "task" / "text2sql.yaml")
    cfg = OmegaConf.merge(
        {"paths": {"data_dir": str(shared_data), "cache_dir": None}}, {"task": cfg}
    )
    splits = OmegaConf.to_container(cfg.task.splits, resolve=True)
    for name in ("spider_realistic", "spider_test", "bird_dev"):
        if Path(splits[name]["file"]).exists():
            continue
        t = Text2SQLTask(
            splits={name: {k: v for k, v in splits[name].items() if k not in ("hub", "hub_split")}}
        )
        with pytest.raises(FileNotFoundError, match=rf"task\.splits\.{name}\.file"):
            t.examples(name)


def test_task_config_instantiates(shared_data):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(
        {"paths": {"data_dir": str(shared_data), "cache_dir": None}},
        {"task": OmegaConf.load(ROOT / "configs" / "task" / "text2sql.yaml")},
    )
    cfg.task.max_examples = 3
    t = instantiate(cfg.task)
    try:
        assert isinstance(t, Text2SQLTask)
        assert [e.id for e in t.examples("val")] == ["0", "1", "2"]
        assert t.splits["train"].question_field == "SpiderQuestion"
        assert t.executor.limits.timeout_s == 5.0
    finally:
        t.close()


@pytest.mark.parametrize("preset", ["text2sql_coder3b", "text2sql_coder7b"])
def test_experiment_presets_compose(preset):
    if not (ROOT / "configs" / "train.yaml").exists():
        pytest.skip("configs/train.yaml not present")
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="train.yaml",
            overrides=[f"experiment={preset}", "method=gdpo"],
            return_hydra_config=True,
        )
    assert cfg.task._target_ == "mrtpo.tasks.text2sql.Text2SQLTask"
    assert cfg.trainer.max_steps == 100
    assert cfg.data.max_prompt_tokens == 4096
    assert cfg.model.name_or_path.startswith("Qwen/Qwen2.5-Coder-")
    assert preset[-2:].upper() in cfg.model.name_or_path
    assert "vllm" in cfg.rollout.engine._target_


def test_hub_fallback_failure_names_the_config_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    t = Text2SQLTask(
        splits={"spider_dev": {"file": str(tmp_path / "absent.json"), "hub": "no-such/dataset"}}
    )
    with pytest.raises(RuntimeError, match=r"task\.splits\.spider_dev\.hub"):
        t.examples("val")
