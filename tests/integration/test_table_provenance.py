"""src/table.py checks what it is given and says what each cell was computed from (issue 40
items 3 and 4): the synthetic demo runs evaluated on Spider gave a table of 0.000 with no
warning, and a table of eval.limit=8 read as a full-benchmark table."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT
from tests.task_fixtures import make_spider

from mrtpo.evaluate import tables
from mrtpo.run.trained_run import model_identity, trained_task

SMALL = ["trainer.max_steps=1", "rl.prompts_per_step=2", "rl.group_size=2",
         "rollout.sampling.max_new_tokens=4", "callbacks.progress=null"]  # fmt: skip


def _run(tmp: Path, cache: Path, name: str, *overrides: str) -> Path:
    """A one-step training run of the tiny model, as src/train.py leaves it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    folder = tmp / name
    res = subprocess.run(
        [sys.executable, str(ROOT / "src" / "train.py"), *SMALL, *overrides,
         f"hydra.run.dir={folder}", f"paths.cache_dir={cache}"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    tmp = tmp_path_factory.mktemp("provenance")
    narrow = [f"model.name_or_path={cache_dir}/models/tiny-narrow", "model.tiny.hidden_size=32"]
    return {
        "synthetic": _run(tmp, cache_dir, "synthetic"),
        "seed1": _run(tmp, cache_dir, "seed1", "seed=1"),
        "narrow": _run(tmp, cache_dir, "narrow", "seed=2", *narrow),
    }


def test_what_a_folder_was_trained_on_is_read_from_it(runs, cache_dir):
    assert trained_task(runs["synthetic"]) == ("mrtpo.tasks.synthetic.SyntheticTask", "synthetic")
    assert trained_task(runs["synthetic"] / "policy") == (
        "mrtpo.tasks.synthetic.SyntheticTask",
        "synthetic",
    )  # the export's own record
    assert trained_task(cache_dir / "models" / "tiny-qwen2") is None  # a base model: unknown
    assert model_identity(runs["synthetic"]) == "hidden 64 x 2 layers, MLP 128"
    assert model_identity(runs["narrow"]) == "hidden 32 x 2 layers, MLP 128"


def test_a_run_of_another_task_is_refused_before_anything_is_evaluated(runs, tmp_path):
    out = tmp_path / "table"
    with pytest.raises(SystemExit) as info:
        tables.main(["text2sql", str(runs["synthetic"]), "--out", str(out)])
    text = str(info.value)
    assert f"{runs['synthetic']} was trained on task=synthetic" in text
    assert "not on the text2sql family (task=text2sql" in text and "\n" not in text
    assert not out.exists()  # nothing evaluated, nothing written


def test_a_row_mixing_models_across_its_seeds_is_refused(runs, tmp_path):
    """Seeds of one command whose model differs (the config it composed changed between
    them: a preset's model, configs/local/): here the narrow run's record of its command is
    made the others' (its seed kept), so the three are one row, method=mrtpo x seeds 0-2."""
    import shutil

    narrow = tmp_path / "narrow"
    shutil.copytree(runs["narrow"], narrow)
    for name in ("job.json", ".hydra/overrides.yaml"):
        theirs = (runs["seed1"] / name).read_text()
        (narrow / name).write_text(
            theirs.replace("seed=1", "seed=2").replace('"seed": 1', '"seed": 2')
        )
    folders = [runs["synthetic"], runs["seed1"], narrow]
    assert len({tables._source(p).method for p in folders}) == 1  # one row
    with pytest.raises(SystemExit) as info:
        tables.main(["text2sql", *map(str, folders), "--out", str(tmp_path / "t")])
    text = str(info.value)
    assert "mixes models across its seeds" in text, text
    assert "hidden 32 x 2 layers" in text and "hidden 64 x 2 layers" in text


def test_each_cell_says_how_many_prompts_it_scored_and_marks_partial_ones(
    tmp_path, cache_dir, tiny
):
    """Fixture Spider dev's concert_singer questions (eval.categories) at eval.limit=2: the
    cell reads (2/N*), the table says it is partial, table.csv holds the counts; without a
    limit the cell is whole, (N/N)."""
    data = make_spider(tmp_path / "data")
    tiny = cache_dir / "models" / "tiny-qwen2"
    sets = [f"paths.cache_dir={cache_dir}", f"paths.data_dir={data}",
            "rollout.sampling.max_new_tokens=4", "eval.categories=[concert_singer]"]  # fmt: skip
    argv = ["text2sql", str(tiny), "--out", str(tmp_path / "part")]
    for s in [*sets, "eval.limit=2"]:
        argv += ["--set", s]
    assert tables.main(argv) == 0
    md = (tmp_path / "part" / "table.md").read_text()
    dev = json.loads((data / "spider" / "dev.json").read_text())
    n = sum(q["db_id"] == "concert_singer" for q in dev)
    assert n > 2
    assert f"(2/{n}*)" in md and "**Partial**: cells marked *" in md
    recs = csv.DictReader((tmp_path / "part" / "table.csv").read_text().splitlines())
    dev = next(r for r in recs if r["benchmark"] == "Spider dev")
    assert (
        dev["examples"] == "[2]" and dev["split_examples"] == f"[{n}]" and dev["partial"] == "True"
    )
    argv = ["text2sql", str(tiny), "--out", str(tmp_path / "whole")]
    for s in sets:
        argv += ["--set", s]
    assert tables.main(argv) == 0
    md = (tmp_path / "whole" / "table.md").read_text()
    assert f"({n}/{n})" in md and "Partial" not in md


def test_counts_of_a_cell_over_seeds():
    c = tables.Cell
    assert tables.counted([c(value=0.5, examples=8, split_examples=541)] * 3) == " (8/541*)"
    assert tables.counted([c(value=0.5, examples=541, split_examples=541)]) == " (541/541)"
    mixed = [c(value=0.5, examples=8, split_examples=541), c(value=0.5, examples=541,
             split_examples=541)]  # fmt: skip
    assert tables.counted(mixed) == " (8-541/541*)"
    assert tables.counted([c(value=0.5)]) == ""  # an evaluation that did not record them
