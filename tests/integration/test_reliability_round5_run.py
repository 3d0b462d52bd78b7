"""Issue 47, the run layer (items 5, 7, 9, 10, 15): a new run never writes into a folder
that holds anything, ``run_name`` stays under ``logs/``, ``rollout.max_staleness`` is a
bounded integer, ``--check`` runs the engine's own checks, the printed resume command is
accepted as printed, and ``api.train`` takes a mapping."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT, SHARED_DATA, compose_config

from mrtpo.run.settings import ConfigError

TRAIN = str(ROOT / "src" / "train.py")


def _train(args, cwd, cache_dir=None, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("MRTPO_DATA_DIR", None)
    if cache_dir is not None:
        env["MRTPO_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, TRAIN, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _tree(folder: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(folder))] = p.read_bytes() if p.is_file() else b"<dir>"
    return out


def _a_finished_run(folder: Path) -> Path:
    """What a finished run and a user's notes look like on disk (no training needed: the
    refusal must come before anything reads them)."""
    for name, data in {
        ".hydra/config.yaml": b"seed: 0\n",
        ".hydra/overrides.yaml": b"- trainer.max_steps=2\n",
        ".hydra/hydra.yaml": b"hydra: {}\n",
        "csv/metrics.csv": b"step,train/loss\n0,0.5\n1,0.4\n",
        "checkpoints/last.ckpt": b"weights",
        "samples.jsonl": b'{"step": 0}\n',
        "train.log": b"[the run's log]\n",
        "notes.txt": b"my own notes\n",
    }.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


# ---- item 5: a new run into a folder that holds anything -------------------------------------


@pytest.mark.parametrize("key", ["hydra.run.dir", "paths.output_dir"])
def test_a_new_run_into_a_used_folder_is_refused_and_changes_nothing(key, tmp_path):
    run = _a_finished_run(tmp_path / "run")
    before = _tree(run)
    logs = tmp_path / "logs"
    res = _train([f"{key}={run}", f"paths.log_dir={logs}", "trainer.max_steps=1"], tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    assert key in lines[0] and "+resume=" in lines[0]
    assert _tree(run) == before  # not a byte changed, nothing added
    assert not logs.exists()  # and no other run folder was made for it


def test_a_new_run_into_an_empty_or_new_folder_is_accepted_as_before(tmp_path):
    from mrtpo.run.folder import check_new_run_folder

    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (empty, tmp_path / "new" / "run"):
        cfg = compose_config("train.yaml", [f"hydra.run.dir={folder}"])
        check_new_run_folder(cfg)
    resumed = _a_finished_run(tmp_path / "run")  # +resume into the run's own folder: allowed
    check_new_run_folder(compose_config("train.yaml", [f"+resume={resumed}"]))


# ---- item 7: run_name and job_name stay one folder name under logs/ --------------------------


@pytest.mark.parametrize(
    "override",
    ["run_name=x/../../../../escaped", "run_name=..", "job_name=../../escaped", "run_name=a/b"],
)
def test_a_name_with_a_separator_or_dots_is_refused_leaving_nothing(override, tmp_path):
    logs = tmp_path / "deep" / "logs"
    res = _train([f"paths.log_dir={logs}", override], tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    key = override.split("=", 1)[0]
    assert res.stderr.startswith(f"error: {key}="), res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no escaped run


# ---- item 9: rollout.max_staleness ------------------------------------------------------------

ASYNC = ["rollout.engine.own_copy=true", "rollout.schedule=async"]


@pytest.mark.parametrize("value", ["100000", "abc", "1.5", "true", "-1"])
def test_max_staleness_is_a_bounded_integer(value):
    from mrtpo.rollout.source import MAX_STALENESS
    from mrtpo.run.checks import validate

    cfg = compose_config("train.yaml", [*ASYNC, f"rollout.max_staleness={value}"])
    with pytest.raises(ConfigError, match=r"^rollout\.max_staleness=") as err:
        validate(cfg)
    assert str(MAX_STALENESS) in str(err.value) or value == "-1"


def test_max_staleness_at_its_maximum_is_accepted():
    from mrtpo.rollout.source import MAX_STALENESS
    from mrtpo.run.checks import validate

    validate(compose_config("train.yaml", [*ASYNC, f"rollout.max_staleness={MAX_STALENESS}"]))


# ---- item 10: --check runs the engine's own checks --------------------------------------------

SERVER = ["rollout=vllm_server"]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["rollout.engine.host=0.0.0.0"], "rollout.engine.host=0.0.0.0"),
        (["rollout.engine.url=ftp://x", "rollout.engine.weight_dir=/tmp"], "rollout.engine.url"),
        (["rollout.engine.max_concurrency=0"], "rollout.engine.max_concurrency"),
        (["rollout.engine.request_timeout_s=0"], "rollout.engine.request_timeout_s"),
        (
            ["rollout.engine.url=http://127.0.0.1:9", "rollout.engine.weight_dir=/nonexistent/w"],
            "rollout.engine.weight_dir=/nonexistent/w",
        ),
        (["rollout.engine.port=70000"], "rollout.engine.port=70000"),
    ],
)
def test_check_names_what_the_engine_refuses(overrides, says, monkeypatch, tmp_path):
    from mrtpo.run.checks import validate
    from mrtpo.run.dryrun import check_all

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    cfg = compose_config("train.yaml", [*SERVER, *overrides, f"paths.output_dir={tmp_path}"])
    found = check_all(cfg)
    assert any(says in p for p in found.problems), found.problems
    with pytest.raises(ConfigError, match=re.escape(says)):  # the run's own validation
        validate(cfg)


def test_check_accepts_the_server_engines_defaults(monkeypatch, tmp_path):
    from mrtpo.run.checks import validate

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    validate(compose_config("train.yaml", [*SERVER, f"paths.output_dir={tmp_path}"]))


# ---- item 15: api.train with a mapping; the resume command as printed ------------------------


def test_api_train_takes_a_mapping_as_overrides(tmp_path):
    from mrtpo import api

    with pytest.raises(ConfigError, match=r"trainer\.max_steps=0 is not allowed"):
        api.train({"trainer.max_steps": 0, "paths.log_dir": str(tmp_path / "logs")})
    with pytest.raises(TypeError, match="overrides"):
        api.train({"rl.group_size": {"a": 1}})


def test_the_printed_resume_command_is_accepted_for_a_one_step_off_run(tmp_path, cache_dir):
    logs = tmp_path / "logs"
    args = [
        f"paths.log_dir={logs}",
        f"paths.data_dir={SHARED_DATA}",
        "rollout.engine.own_copy=true",
        "rollout.schedule=one_step_off",
        "trainer.max_steps=1",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rollout.sampling.max_new_tokens=4",
        "callbacks.progress=null",
        "callbacks.export=null",
    ]
    first = _train(args, tmp_path, cache_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    hint = re.search(r"continue it: (python src/train\.py .*)\)", first.stdout)
    assert hint, first.stdout[-3000:]
    words = shlex.split(hint.group(1))
    (run,) = (logs / "train" / "runs").iterdir()
    # the folder alone: the resume takes the run's overrides from it (issue 50, item 2)
    assert words == ["python", "src/train.py", f"+resume={run}"]
    again = _train([*words[2:], "trainer.max_steps=2"], tmp_path, cache_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    (run,) = (logs / "train" / "runs").iterdir()
    rows = (run / "csv" / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 3  # header, step 0, step 1


def test_a_resumed_metrics_csv_writes_nan_where_an_uninterrupted_run_does(tmp_path, cache_dir):
    """Under one_step_off every step after the first trains on stale samples only: the
    fresh-sample gap is NaN there (``AbsentAsNaN``), and a resumed run left it empty."""
    import csv

    from mrtpo.lightning.pipeline import train

    def run(out: Path, steps: int, *more: str) -> None:
        train(compose_config("train.yaml", [
            f"paths.output_dir={out}", f"paths.log_dir={tmp_path}/logs",
            f"paths.cache_dir={cache_dir}", f"paths.data_dir={SHARED_DATA}",
            "rl.prompts_per_step=2", "rl.group_size=2", "rollout.sampling.max_new_tokens=4",
            "callbacks.progress=null", "callbacks.export=null",
            "callbacks.model_checkpoint.every_n_train_steps=1",
            "rollout.engine.own_copy=true", "rollout.schedule=one_step_off",
            f"trainer.max_steps={steps}", *more,
        ]))  # fmt: skip

    def cells(out: Path) -> list[str]:
        with open(out / "csv" / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("train/iteration")]
        return [r["train/rollout/logp_gap/max"] for r in rows]

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(whole, 2)
    run(resumed, 1)
    run(resumed, 2, f"+resume={resumed}")
    assert cells(whole)[1] == "nan"
    assert cells(resumed) == cells(whole)
