"""src/eval.py's errors for bad values, missing data and a folder that holds no model: the
message alone (no traceback), exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _eval(tmp_path, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "src/eval.py", f"eval.output={tmp_path / 'out'}",
         f"paths.cache_dir={tmp_path / 'cache'}", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.limit=0"], "eval.limit=0 is not allowed: use an integer >= 1 or null"),
        (
            ["task=text2sql", "eval.split=spider_dev", "paths.data_dir=/nonexistent"],
            "text2sql split 'spider_dev': question file not found",
        ),
        (
            ["model.name_or_path={tmp}/empty", "eval.limit=1"],
            "model.name_or_path={tmp}/empty: cannot load the model",
        ),
        (["seed=abc"], "seed='abc' is not allowed: an integer in [0, 4294967295]"),
    ],
    ids=["range", "missing-split", "no-model", "seed"],
)
def test_user_errors_are_short(tmp_path, overrides, message):
    (tmp_path / "empty").mkdir()
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    res = _eval(tmp_path, *overrides)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message.replace("{tmp}", str(tmp_path)) in errors[0]
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 4


def test_help_says_what_each_group_chooses():
    res = subprocess.run([sys.executable, "src/eval.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "the benchmark family; eval.split picks the split" in res.stdout
    assert "the generation engine (hf, or vllm)" in res.stdout
