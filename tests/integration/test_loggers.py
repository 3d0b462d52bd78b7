"""Every logger the README lists runs for real, and a missing logger package is reported
before anything is loaded, naming the extra that installs it."""

from __future__ import annotations

import csv
import importlib.util
import os

import pytest

from mrtpo.lightning.pipeline import build, metrics_csv
from mrtpo.run.loggers import LoggerPackageMissing, check_loggers


def fit(cfg):
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    return trainer, module


def event_files(folder) -> list:
    return sorted(folder.rglob("events.out.tfevents.*"))


def test_tensorboard_logger_writes_event_files(train_cfg, tmp_path):
    cfg = train_cfg("logger=tensorboard", "method=gdpo")
    check_loggers(cfg.logger)  # installed in the dev environment: no error
    _, module = fit(cfg)
    assert module.iteration == 2
    files = event_files(tmp_path / "tensorboard")
    assert files, f"no event files under {tmp_path / 'tensorboard'}"
    assert all(f.stat().st_size > 0 for f in files)

    # The scalars are really there, one point per RL step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    name = module.task.reward_names[0]
    assert f"train/reward/{name}/mean" in tags, tags
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 1]


def test_many_writes_csv_and_tensorboard(train_cfg, tmp_path):
    cfg = train_cfg("logger=many", "method=gdpo", "trainer.max_steps=1")
    assert set(cfg.logger) == {"csv", "tensorboard"}
    check_loggers(cfg.logger)
    trainer, _ = fit(cfg)
    with open(metrics_csv(trainer)) as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0"]
    assert event_files(tmp_path / "tensorboard")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline(train_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = train_cfg("logger=wandb", "method=gdpo", "trainer.max_steps=1")
    check_loggers(cfg.logger)
    fit(cfg)
    import wandb

    wandb.finish()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, f"no offline run under {tmp_path / 'wandb'}: {os.listdir(tmp_path)}"
    assert list(runs[0].glob("*.wandb")), "the offline run holds no data file"


def _hide(monkeypatch, *missing: str) -> None:
    """Make ``find_spec`` report ``missing`` modules as absent (as on a machine without them)."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name.split(".")[0] in missing:
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize(
    ("logger", "hidden", "extra"),
    [
        ("tensorboard", ("tensorboard", "tensorboardX"), "tensorboard"),
        ("many", ("tensorboard", "tensorboardX"), "tensorboard"),
        ("wandb", ("wandb",), "wandb"),
    ],
)
def test_missing_package_names_logger_and_extra(logger, hidden, extra, train_cfg, monkeypatch):
    _hide(monkeypatch, *hidden)
    cfg = train_cfg(f"logger={logger}")
    with pytest.raises(LoggerPackageMissing) as err:
        check_loggers(cfg.logger)
    msg = str(err.value)
    assert f"pip install -e .[{extra}]" in msg
    key = "wandb" if logger == "wandb" else "tensorboard"
    assert f"logger.{key}" in msg
    assert "logger.csv" not in msg  # the CSV logger needs nothing


def test_csv_and_no_logger_need_nothing(train_cfg):
    check_loggers(train_cfg("logger=csv").logger)
    check_loggers(None)
    check_loggers({})


def test_unknown_logger_module_is_named(train_cfg):
    cfg = train_cfg("+logger.mine._target_=no_such_pkg.loggers.MyLogger")
    with pytest.raises(LoggerPackageMissing, match=r"logger\.mine.*no_such_pkg\.loggers"):
        check_loggers(cfg.logger)


def test_training_stops_before_the_model_loads(train_cfg, monkeypatch):
    """The entry point's order: the logger check comes before the policy is loaded."""
    import mrtpo.core.models

    loaded = []
    real = mrtpo.core.models.load_policy

    def spy(*args, **kwargs):
        loaded.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(mrtpo.core.models, "load_policy", spy)
    _hide(monkeypatch, "wandb")
    from mrtpo.lightning.pipeline import train

    with pytest.raises(LoggerPackageMissing, match=r"pip install -e \.\[wandb\]"):
        train(train_cfg("logger=wandb"))
    assert not loaded, "the policy was loaded before the missing logger package was reported"
