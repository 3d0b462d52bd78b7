"""Nothing the user points the project at is written to, and a refused resume changes nothing.

Regression tests for two data-loss bugs: the tiny-model builder overwrote a user's model folder
when ``model.name_or_path`` was set with the default ``model=tiny``; a refused or failed resume
deleted the run's ``metrics.csv`` and overwrote its ``.hydra/overrides.yaml``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import ROOT, SMALL_RUN, compose_config

from mrtpo.core.models import load_policy
from mrtpo.lightning.pipeline import train
from mrtpo.run.resume import ResumeRefused


def tree_hash(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` with the sha256 of its bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


@pytest.fixture
def user_model(tiny, tmp_path) -> Path:
    """A user's own model folder: the tiny architecture with other weights, no build stamp."""
    model, tok = tiny
    folder = tmp_path / "my_hf_model"
    other = type(model)(model.config)
    torch.manual_seed(123)
    for p in other.parameters():
        torch.nn.init.normal_(p, std=0.05)
    other.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_train_and_eval_never_write_to_a_user_model_folder(train_cfg, user_model, tmp_path):
    before = tree_hash(user_model)
    # The README's way to use a local model, keeping the default model=tiny.
    cfg = train_cfg(f"model.name_or_path={user_model}", f"paths.output_dir={tmp_path}/run")
    train(cfg)
    from mrtpo.evaluate.job import run

    out = tmp_path / "eval"
    run(
        compose_config(
            "eval.yaml",
            [
                f"model.name_or_path={user_model}",
                f"paths.cache_dir={tmp_path}/cache",
                f"paths.log_dir={tmp_path}/logs",
                "task=synthetic",
                "eval.limit=4",
                f"eval.output={out}",
                "rollout.sampling.max_new_tokens=4",
            ],
        )
    )
    assert tree_hash(user_model) == before
    assert not (user_model / "mrtpo_tiny.json").exists()


def test_the_users_weights_are_the_ones_loaded(train_cfg, user_model):
    cfg = train_cfg(f"model.name_or_path={user_model}")
    from omegaconf import OmegaConf

    model, _ = load_policy(**OmegaConf.to_container(cfg.model, resolve=True))
    from safetensors.torch import load_file

    saved = load_file(user_model / "model.safetensors")
    key = next(k for k in saved if "embed_tokens" in k)
    assert torch.equal(model.state_dict()[key], saved[key])


def test_a_copy_of_the_tiny_model_outside_the_cache_is_read_only(tiny, train_cfg, tmp_path):
    """Even a folder that carries the tiny model's build stamp is not rebuilt outside the cache
    (here with another shape in the config, which would trigger a rebuild inside it)."""
    model, _ = tiny
    folder = tmp_path / "copied_tiny"
    shutil.copytree(Path(model.name_or_path), folder)
    before = tree_hash(folder)
    cfg = train_cfg(f"model.name_or_path={folder}", "model.tiny.hidden_size=32")
    from omegaconf import OmegaConf

    loaded, _ = load_policy(**OmegaConf.to_container(cfg.model, resolve=True))
    assert loaded.config.hidden_size == model.config.hidden_size
    assert tree_hash(folder) == before


def test_a_missing_user_path_is_an_error_not_a_build(train_cfg, tmp_path):
    target = tmp_path / "not_there"
    cfg = train_cfg(f"model.name_or_path={target}")
    from omegaconf import OmegaConf

    with pytest.raises(FileNotFoundError, match=r"model\.name_or_path"):
        load_policy(**OmegaConf.to_container(cfg.model, resolve=True))
    assert not target.exists()


# ---- resume ------------------------------------------------------------------------------------

RUN = ("callbacks.model_checkpoint.every_n_train_steps=1", "callbacks.sample_table=null")


@pytest.fixture
def finished_run(train_cfg, tmp_path) -> Path:
    """A 2-step MRTPO run with checkpoints, metrics and a saved .hydra/overrides.yaml."""
    run = tmp_path / "run"
    train(train_cfg(*RUN, f"paths.output_dir={run}"))
    hyd = run / ".hydra"
    hyd.mkdir()
    (hyd / "overrides.yaml").write_text("- method=mrtpo\n")
    assert (run / "csv" / "metrics.csv").is_file()
    assert (run / "checkpoints" / "last.ckpt").is_file()
    return run


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 3])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "header":
        path.write_bytes(b"\x00" * 64 + data[64:])


@pytest.mark.parametrize(
    ("overrides", "damage", "message"),
    [
        (["method=gdpo"], None, "method="),
        (["task.num_constraints=3"], None, "reward_names="),
        (
            ["model.name_or_path=${paths.cache_dir}/models/tiny-wide", "model.tiny.hidden_size=32"],
            None,
            "different model",
        ),
        ([], "truncated", "last.ckpt"),
        ([], "empty", "last.ckpt"),
        ([], "header", "last.ckpt"),
    ],
    ids=["method", "task", "model", "truncated", "empty", "header"],
)
def test_a_refused_resume_leaves_the_run_folder_unchanged(
    train_cfg, finished_run, overrides, damage, message
):
    if damage:
        _damage(finished_run / "checkpoints" / "last.ckpt", damage)
    before = tree_hash(finished_run)
    cfg = train_cfg(
        *RUN,
        f"paths.output_dir={finished_run}",
        f"+resume={finished_run}",
        "trainer.max_steps=4",
        *overrides,
    )
    with pytest.raises(ResumeRefused, match=message) as info:
        train(cfg)
    if damage:  # the message names the damaged file and a checkpoint that can be used instead
        assert "last.ckpt" in str(info.value) and "step000002.ckpt" in str(info.value)
    assert tree_hash(finished_run) == before


def test_a_failed_restore_puts_metrics_back(train_cfg, finished_run, monkeypatch):
    """Belt and braces: a failure inside Lightning's restore (after its CSV writer removed
    the old file) still leaves metrics.csv as it was."""
    from mrtpo.lightning.module import PolicyModule

    def boom(self, checkpoint):
        raise RuntimeError("restore failed")

    monkeypatch.setattr(PolicyModule, "on_load_checkpoint", boom)
    metrics = finished_run / "csv" / "metrics.csv"
    before = metrics.read_bytes()
    cfg = train_cfg(
        *RUN, f"paths.output_dir={finished_run}", f"+resume={finished_run}", "trainer.max_steps=4"
    )
    with pytest.raises(RuntimeError, match="restore failed"):
        train(cfg)
    assert metrics.read_bytes() == before


# ---- the entry point: Hydra's own writes, and run folders of simultaneous runs -----------------

CLI = [*SMALL_RUN, "trainer.max_steps=1"]


def _cli(args, cache_dir, log_dir, **kw):
    env = {**os.environ, "MRTPO_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "src" / "train.py"), f"paths.log_dir={log_dir}", *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw
    )


def test_runs_started_together_get_their_own_folders_and_a_cli_refusal_changes_nothing(
    cache_dir, tmp_path, tiny
):
    logs = tmp_path / "logs"
    procs = [_cli(CLI, cache_dir, logs) for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    runs = sorted((logs / "train" / "runs").iterdir())
    assert len(runs) == 2, runs
    for run in runs:  # each folder holds exactly one run's rows
        rows = (run / "csv" / "metrics.csv").read_text().strip().splitlines()
        assert len(rows) == 2, rows

    run = runs[0]
    original = (run / ".hydra" / "overrides.yaml").read_text()
    before = tree_hash(run)
    p = _cli([*CLI, f"+resume={run}", "method=gdpo", "trainer.max_steps=2"], cache_dir, logs)
    out = p.communicate(timeout=900)[0]
    assert p.returncode != 0
    assert "method='mrtpo'" in out and "method='gdpo'" in out
    assert tree_hash(run) == before
    assert (run / ".hydra" / "overrides.yaml").read_text() == original


def test_a_tokenizer_without_eos_or_pad_fails_at_load_naming_it(tiny, tmp_path):
    """It used to crash in the HF engine at the first rollout."""
    import json

    model, tok = tiny
    folder = tmp_path / "no_eos"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token"] = None
    cfg["pad_token"] = None
    cfg_path.write_text(json.dumps(cfg))
    gen = folder / "generation_config.json"
    g = json.loads(gen.read_text())
    g.pop("eos_token_id", None)
    g.pop("pad_token_id", None)
    gen.write_text(json.dumps(g))
    conf = folder / "config.json"
    c = json.loads(conf.read_text())
    c["eos_token_id"] = None
    conf.write_text(json.dumps(c))
    with pytest.raises(ValueError, match="has no EOS token"):
        load_policy(str(folder))
