"""The spine end to end on the tiny model: configs, every method, resume, sweeps, errors."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from tests.conftest import CONFIG_DIR, ROOT, compose_config

from mrtpo.lightning.pipeline import build, metrics_csv

# task=custom needs a user's data file and reward functions: tests/integration/test_custom_task.py
TASKS = sorted(p.stem for p in (CONFIG_DIR / "task").glob("*.yaml") if p.stem != "custom")
METHODS = sorted(p.stem for p in (CONFIG_DIR / "method").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def fit(cfg):
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm, ckpt_path=cfg.get("ckpt_path"))
    return trainer, module


def read_metrics(trainer) -> list[dict[str, str]]:
    with open(metrics_csv(trainer)) as f:
        return list(csv.DictReader(f))


def _has_references(task) -> bool:
    try:  # a task may refuse with its own key (text2sql: task.reference_solutions)
        return any(task.teacher_messages(e) for e in task.examples("train"))
    except ValueError:
        return False
    except FileNotFoundError as exc:  # OPSD reads the training examples: the public data
        pytest.skip(f"the task's training data is absent ({exc})")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("task", TASKS)
def test_every_task_and_method_composes(task, method, train_cfg):
    cfg = train_cfg(f"task={task}", f"method={method}")
    t = instantiate(cfg.task)
    m = instantiate(cfg.method)
    assert t.reward_names, f"task {task} declares no rewards"
    # pairs a method refuses, naming the method and the task: SAW on per-prompt reward sets,
    # CoRT without the rubric in the prompt, OPSD without reference solutions
    refused = (
        (t.rewards_vary_per_prompt and "saw" in method)
        or (method == "cort" and not t.info_in_prompt)
        or (method == "opsd" and not _has_references(t))
    )
    if refused:
        with pytest.raises(ValueError, match=f"method={method}"):
            m.setup(t)
    else:
        m.setup(t)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment, train_cfg):
    cfg = train_cfg(f"experiment={experiment}", "method=gdpo")
    assert cfg.trainer.max_steps > 0
    instantiate(cfg.method)


@pytest.mark.parametrize("method", METHODS)
def test_two_steps_per_method(method, train_cfg):
    trainer, module = fit(train_cfg(f"method={method}"))
    assert module.iteration == 2
    assert trainer.global_step == 2
    rows = read_metrics(trainer)
    assert [r["step"] for r in rows] == ["0", "1"]
    cols = rows[0].keys()
    for name in module.task.reward_names:
        assert f"train/reward/{name}/mean" in cols
    for key in ("train/loss", "train/time/rollout", "train/time/update", "train/clip_frac"):
        assert key in cols
    if module.method.relevance is not None:
        assert "train/replay/share" in cols


def test_several_updates_per_step_count_as_one_step(train_cfg):
    cfg = train_cfg(
        "method=gdpo", "rl.ppo_epochs=2", "rl.mini_batch_size=2", "rl.micro_batch_size=1"
    )
    trainer, module = fit(cfg)
    # 4 responses / mini-batch 2 x 2 epochs = 4 optimizer updates per RL step
    assert module.iteration == 2 and trainer.global_step == 2


def _params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def test_resume_equals_uninterrupted(train_cfg, tmp_path):
    common = [
        "method=mrtpo",
        "method.beta_warmup_steps=2",
        "optim.lr=1e-3",
        "callbacks.model_checkpoint.every_n_train_steps=1",
    ]
    _, straight = fit(train_cfg(*common, "trainer.max_steps=4"))
    ref = _params(straight)

    first_cfg = train_cfg(
        *common,
        "trainer.max_steps=2",
        f"paths.output_dir={tmp_path}/a",
        f"callbacks.model_checkpoint.dirpath={tmp_path}/a/ckpt",
    )
    fit(first_cfg)
    ckpt = Path(f"{tmp_path}/a/ckpt/last.ckpt")
    assert ckpt.exists()
    trainer, resumed = fit(
        train_cfg(
            *common, "trainer.max_steps=4", f"ckpt_path={ckpt}", f"paths.output_dir={tmp_path}/b"
        )
    )
    assert resumed.iteration == 4
    got = _params(resumed)
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=f"parameter {k} differs")
    # the resumed run logs only the steps it ran
    assert [r["step"] for r in read_metrics(trainer)] == ["2", "3"]


def test_unknown_option_names_the_choices():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as err:
        compose_config("train.yaml", ["method=nope"])
    msg = str(err.value)
    assert "method" in msg and "gdpo" in msg and "mrtpo" in msg


def test_bad_rl_key_is_named():
    from mrtpo.lightning.module import PolicyModule
    from mrtpo.lightning.pipeline import prepare
    from mrtpo.run.config_keys import check_overrides
    from mrtpo.run.settings import ConfigError

    # on the command line, before Hydra starts: the valid keys are listed
    with pytest.raises(ConfigError, match=r"'rl' has no key 'clip'; valid keys: \[.*'clip_high'"):
        check_overrides(["rl.clip=0.3"])
    # appended with +, it is refused when the settings are validated (before any load)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['clip'\] in 'rl'; valid keys"):
        prepare(compose_config("train.yaml", ["+rl.clip=0.3"]))
    # and by library callers that pass plain dicts
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['clip'\] in 'rl'"):
        PolicyModule(None, None, None, None, rl={"clip": 0.3})


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def test_cli_fails_before_training_on_unknown_method(tmp_path):
    res = subprocess.run(
        [sys.executable, "src/train.py", "method=nope", f"paths.log_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert res.returncode != 0
    assert "Could not find 'method/nope'" in res.stderr
    assert "mrtpo" in res.stderr  # the valid choices are listed


@pytest.mark.slow
def test_multirun_writes_one_folder_per_job(tmp_path, cache_dir):
    res = subprocess.run(
        [
            sys.executable,
            "src/train.py",
            "-m",
            "method=grpo,gdpo",
            "trainer.max_steps=1",
            "rl.prompts_per_step=2",
            "rl.group_size=2",
            "rollout.sampling.max_new_tokens=8",
            f"paths.log_dir={tmp_path}",
            f"paths.cache_dir={cache_dir}",
            "print_config=false",
            "callbacks.progress=null",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    csvs = sorted(tmp_path.glob("train/multiruns/*/*/csv/metrics.csv"))
    assert len(csvs) == 2, csvs
    # folders are named by each job's overrides (paths left out)
    names = {p.parent.parent.name.split("_", 1)[1].split(",")[0] for p in csvs}
    assert names == {"method=grpo", "method=gdpo"}
    assert not any("paths." in p.parent.parent.name for p in csvs)
