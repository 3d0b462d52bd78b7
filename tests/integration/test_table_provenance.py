"""src/table.py checks what it is given (issue 40 item 3): the synthetic demo runs evaluated
on Spider gave a table of 0.000 with no warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT

from mrtpo import tables
from mrtpo.provenance import model_identity, trained_task

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
