"""src/eval.py on bad inputs, partial predictions, atomic outputs, and a checkpoint's own run."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT, SHARED_DATA, compose_config

from mrtpo.core.evaluation import write_results
from mrtpo.evaluate.job import run


def _eval_cfg(tmp_path, cache_dir, *overrides):
    return compose_config(
        "eval.yaml",
        [
            f"paths.output_dir={tmp_path}",
            f"paths.log_dir={tmp_path}/logs",
            f"paths.cache_dir={cache_dir}",
            f"paths.data_dir={SHARED_DATA}",
            *overrides,
        ],
    )


@pytest.fixture
def val_ids(tmp_path, cache_dir) -> list[str]:
    from hydra.utils import instantiate

    task = instantiate(_eval_cfg(tmp_path, cache_dir).task)
    return [str(e.id) for e in task.examples("val")]


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _rewards(row: dict) -> list[str]:
    return sorted(k.removeprefix("reward/") for k in row if k.startswith("reward/"))


def _good(i: str) -> bytes:
    return json.dumps({"id": i, "response": "a b c"}).encode() + b"\n"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'"str"\n', "expected a JSON object, got a string"),
        (b"5\n", "expected a JSON object, got a number"),
        (b"null\n", "expected a JSON object, got null"),
        (b"[1, 2]\n", "expected a JSON object, got an array"),
        (b'{"id": "x", "response": "caf\xe9"}\n', "not valid UTF-8 (byte 0xe9 at column 29)"),
        (b'{"id": "x", "response": "a\\ud800b"}\n', "field response holds U+D800"),
        (b'{"id": "x", "response": \n', "malformed JSON line"),
    ],
    ids=["string", "number", "null", "array", "latin1", "lone_surrogate", "truncated_json"],
)
def test_a_bad_line_names_file_and_line_and_writes_nothing(
    tmp_path, cache_dir, val_ids, line, message
):
    path = tmp_path / "preds.jsonl"
    path.write_bytes(_good(val_ids[0]) + b"\n" + line)  # the bad line is line 3
    out = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        run(_eval_cfg(tmp_path, cache_dir, f"eval.responses={path}", f"eval.output={out}"))
    assert f"{path}:3: " in str(info.value) and message in str(info.value), str(info.value)
    assert not (out / "metrics.json").exists() and not (out / "results.jsonl").exists()


def test_an_empty_predictions_file_is_an_error(tmp_path, cache_dir):
    path = tmp_path / "preds.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=r"no responses \(the file is empty\)"):
        run(_eval_cfg(tmp_path, cache_dir, f"eval.responses={path}"))


def test_partial_predictions_warn_and_record_coverage(tmp_path, cache_dir, val_ids, caplog):
    path = tmp_path / "preds.jsonl"
    path.write_bytes(_good(val_ids[0]) + _good(val_ids[0]))  # 1 example, 2 samples
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="mrtpo.core.evaluation"):
        metrics = run(
            _eval_cfg(tmp_path, cache_dir, f"eval.responses={path}", f"eval.output={out}")
        )
    n = len(val_ids)
    assert metrics["coverage"] == pytest.approx(1 / n)
    assert f"covers 1 of {n} examples" in caplog.text and "require_complete" in caplog.text
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["coverage"] == pytest.approx(1 / n)
    assert saved["scored"]["examples"] == n and saved["scored"]["examples_covered"] == 1
    assert saved["scored"]["responses_scored"] == 2 and saved["scored"]["mode"] == "responses"
    with pytest.raises(ValueError, match=f"covers 1 of {n} examples.*eval.require_complete"):
        run(
            _eval_cfg(
                tmp_path,
                cache_dir,
                f"eval.responses={path}",
                f"eval.output={tmp_path}/strict",
                "eval.require_complete=true",
            )
        )
    assert not (tmp_path / "strict" / "metrics.json").exists()
    # complete: coverage 1 and no warning
    path.write_bytes(b"".join(_good(i) for i in val_ids))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mrtpo.core.evaluation"):
        metrics = run(
            _eval_cfg(
                tmp_path,
                cache_dir,
                f"eval.responses={path}",
                f"eval.output={out}",
                "eval.require_complete=true",
            )
        )
    assert metrics["coverage"] == 1.0 and "covers" not in caplog.text


def test_results_and_metrics_are_written_both_or_neither(tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_results(out, {"success": 0.5}, [{"id": "a", "response": "old"}])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    saved = json.loads(before["metrics.json"])
    assert saved["scored"]["results_sha256"] == hashlib.sha256(before["results.jsonl"]).hexdigest()

    real, calls = os.fsync, []

    def full_disk(fd):
        calls.append(fd)
        if len(calls) == 2:  # results.jsonl's temp file synced; metrics.json's fails
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_results(out, {"success": 1.0}, [{"id": "a", "response": "new"}])
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old pair, no temp files

    # text that is not valid Unicode (a lone surrogate from some scorer) is kept, escaped
    write_results(out, {"success": 1.0}, [{"id": "a", "response": "x\ud800y"}])
    row = json.loads((out / "results.jsonl").read_text())
    assert row["response"] == "x\ud800y"


@pytest.mark.parametrize(("key", "value"), [("limit", -1), ("batch_size", 0), ("n_samples", 0)])
def test_bad_eval_numbers_are_named(tmp_path, cache_dir, key, value):
    with pytest.raises(ValueError, match=rf"eval\.{key}={value} is not allowed"):
        run(_eval_cfg(tmp_path, cache_dir, f"eval.{key}={value}"))


# ---- the training run behind a checkpoint ---------------------------------------------------


def _rooted(home: Path) -> dict[str, str]:
    """The environment of a command whose project folders (logs/, .cache/) are ``home``'s:
    paths.root_dir is the project's root wherever a command starts (MRTPO_ROOT moves it)."""
    return {**os.environ, "MRTPO_ROOT": str(home)}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, cache_dir) -> tuple[Path, Path]:
    """A real 2-step `src/train.py` run of a tiny model that is *not* eval's default (hidden
    size 32) on a non-default task (3 constraints), launched from its own folder."""
    home = tmp_path_factory.mktemp("home")
    cmd = [
        sys.executable,
        str(ROOT / "src" / "train.py"),
        "trainer.max_steps=2",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rollout.sampling.max_new_tokens=8",
        "callbacks.progress=null",
        "callbacks.model_checkpoint.every_n_train_steps=1",
        "model.name_or_path=${paths.cache_dir}/models/tiny-h32",
        "model.tiny.hidden_size=32",
        "task.num_constraints=3",
        f"paths.cache_dir={cache_dir}",
    ]
    res = subprocess.run(
        cmd, cwd=home, env=_rooted(home), capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = (home / "logs" / "train" / "runs").iterdir()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    return home, run_dir


def test_eval_takes_model_and_task_from_the_checkpoints_run(trained_run, tmp_path):
    home, run_dir = trained_run
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    out = tmp_path / "out"
    logs = tmp_path / "logs"
    before = _tree(run_dir)
    cmd = [
        sys.executable,
        str(ROOT / "src" / "eval.py"),
        f"ckpt_path={ckpt}",
        "eval.limit=4",
        f"eval.output={out}",
        f"paths.log_dir={logs}",
        "rollout.sampling.max_new_tokens=4",
    ]
    res = subprocess.run(
        cmd, cwd=home, env=_rooted(home), capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    saved = json.loads((out / "metrics.json").read_text())
    scored = saved["scored"]
    assert scored["checkpoint"] == str(ckpt) and scored["checkpoint_step"] == 2
    assert scored["run_config"] == str(run_dir / ".hydra" / "config.yaml")
    assert scored["model"].endswith("tiny-h32") and "training run" in scored["model_source"]
    assert scored["split"] == "val" and scored["examples"] == 4 and scored["responses_scored"] == 4
    assert scored["sampling"]["greedy"] is True and scored["sampling"]["max_new_tokens"] == 4
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    # the run's task: 3 constraints, not eval's default 4
    assert len(rows) == 4 and _rewards(rows[0]) == ["first", "include_1", "last"]
    # eval.output is the run folder: nothing under logs/eval/
    assert not logs.exists() and not (home / "logs" / "eval").exists()
    assert (out / ".hydra" / "config.yaml").is_file()
    # the training run's folder is not written to
    assert _tree(run_dir) == before


def test_a_mismatched_model_override_is_a_clear_error(trained_run, tmp_path, cache_dir):
    _, run_dir = trained_run
    cfg = _eval_cfg(
        tmp_path,
        cache_dir,
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        "model=tiny",  # eval's default tiny model: hidden size 64, the run's is 32
        "eval.limit=2",
    )
    with pytest.raises(ValueError, match=r"holds a different model.*Drop model="):
        run(cfg)


def test_a_key_override_changes_only_that_key_of_the_runs_group(trained_run, tmp_path, cache_dir):
    _, run_dir = trained_run
    out = tmp_path / "out"
    cfg = _eval_cfg(
        tmp_path,
        cache_dir,
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        "task.num_val=3",  # the run's task (3 constraints) with fewer validation prompts
        "eval.limit=10",
        "rollout.sampling.max_new_tokens=2",
        f"eval.output={out}",
    )
    metrics = run(cfg)
    assert metrics["n_responses"] == 3.0
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert _rewards(rows[0]) == ["first", "include_1", "last"]


def test_help_lists_only_evals_groups():
    res = subprocess.run(
        [sys.executable, str(ROOT / "src" / "eval.py"), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    groups = res.stdout.split("== Config ==")[0]
    for g in ("model:", "task:", "rollout:", "paths:"):
        assert g in groups
    for g in ("method:", "trainer:", "logger:", "callbacks:", "stage:", "experiment:"):
        assert g not in groups, groups


# ---- issue 25 items 3, 10, 16c: the predictions file is input only; ids are counted right ----


@pytest.mark.parametrize("name", ["results.jsonl", "metrics.json", "link"])
def test_eval_never_writes_over_its_predictions_file(tmp_path, cache_dir, val_ids, name):
    """eval.responses=<dir>/results.jsonl eval.output=<dir> replaced the predictions with the
    results (every field but id and response lost). Refused now, the file untouched; also
    through a symbolic link named like an output."""
    folder = tmp_path / "preds"
    folder.mkdir()
    lines = [json.dumps({"id": i, "response": "a b c", "model": "mine"}) for i in val_ids]
    data = ("\n".join(lines) + "\n").encode()
    if name == "link":
        preds = tmp_path / "elsewhere.jsonl"
        preds.write_bytes(data)
        (folder / "results.jsonl").symlink_to(preds)
        given = folder / "results.jsonl"
    else:
        preds = given = folder / name
        preds.write_bytes(data)
    with pytest.raises(ValueError, match=r"eval\.output") as info:
        run(_eval_cfg(tmp_path, cache_dir, f"eval.responses={given}", f"eval.output={folder}"))
    assert str(given) in str(info.value)
    assert preds.read_bytes() == data
    assert sorted(p.name for p in folder.iterdir()) == ["results.jsonl" if name == "link" else name]


def test_uneven_duplicate_ids_are_refused(tmp_path, cache_dir, val_ids):
    """One example answered 3 times and three others once were averaged over lines, so the
    repeated one counted 3 times (exec_acc 0.5 for 1 correct of 4). Several samples per
    example are fine when every example has the same number."""
    ids = val_ids[:4]
    path = tmp_path / "preds.jsonl"
    path.write_bytes(b"".join(_good(i) for i in [ids[0], ids[0], ids[0], *ids[1:]]))
    out = tmp_path / "out"
    cfg = _eval_cfg(
        tmp_path, cache_dir, f"eval.responses={path}", f"eval.output={out}", "eval.limit=4"
    )
    with pytest.raises(ValueError, match=r"uneven") as info:
        run(cfg)
    msg = str(info.value)
    assert f"{ids[0]!r}" in msg and "3 lines" in msg and f"{path}:2" in msg, msg
    assert not out.exists() or not (out / "metrics.json").exists()
    # two samples for every example: accepted, each example weighs the same
    path.write_bytes(b"".join(_good(i) * 2 for i in ids))
    metrics = run(cfg)
    assert metrics["n_responses"] == 8.0 and metrics["coverage"] == 1.0
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["scored"]["samples_per_example"] == 2


def test_limit_applies_to_the_predictions_too(tmp_path, cache_dir, val_ids, caplog):
    """eval.limit=4 with a predictions file for the whole split said that valid ids beyond
    the first 4 were 'not an example of this split'."""
    path = tmp_path / "preds.jsonl"
    path.write_bytes(b"".join(_good(i) for i in val_ids))
    out = tmp_path / "out"
    cfg = _eval_cfg(
        tmp_path, cache_dir, f"eval.responses={path}", f"eval.output={out}", "eval.limit=4"
    )
    with caplog.at_level(logging.WARNING, logger="mrtpo.core.evaluation"):
        metrics = run(cfg)
    assert metrics["n_responses"] == 4.0 and metrics["coverage"] == 1.0
    skipped = len(val_ids) - 4
    assert f"{skipped} line(s)" in caplog.text and "eval.limit=4" in caplog.text
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["scored"]["responses_skipped_by_limit"] == skipped
    assert saved["scored"]["responses_scored"] == 4
    # an id that is in no example of the split is still an error
    path.write_bytes(_good(val_ids[0]) + _good("no-such-id"))
    with pytest.raises(ValueError, match=r"preds\.jsonl:2: id 'no-such-id' is not an example"):
        run(cfg)
