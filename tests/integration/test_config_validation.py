"""Every setting has a type and a range, checked before any model or data loads.

Regression tests for values that hung (``rl.ppo_epochs=0``), crashed after the model had
loaded with tracebacks naming no key, or trained silently wrong (``rl.group_size=1``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from tests.conftest import ROOT

from mrtpo.core import models
from mrtpo.lightning.pipeline import build, prepare, train
from mrtpo.run.settings import ConfigError


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load a model: validation must come first."""

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the config was validated")

    monkeypatch.setattr(models, "load_policy", refuse)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rl.ppo_epochs=0", "rl.ppo_epochs"),
        ("rl.group_size=0", "rl.group_size"),
        ("rl.group_size=-2", "rl.group_size"),
        ("rl.group_size=1", "rl.group_size"),
        ("rl.prompts_per_step=0", "rl.prompts_per_step"),
        ("rl.prompts_per_step=-1", "rl.prompts_per_step"),
        ("rl.mini_batch_size=0", "rl.mini_batch_size"),
        ("rl.micro_batch_size=0", "rl.micro_batch_size"),
        ("rl.clip_low=-0.1", "rl.clip_low"),
        ("rl.clip_high=-0.1", "rl.clip_high"),
        ("rl.kl_coef=-1", "rl.kl_coef"),
        ("rl.loss_agg=sum", "rl.loss_agg"),
        ("optim.lr=0", "optim.lr"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("replay.token_budget=0", "replay.token_budget"),
        ("data.val_batch_size=0", "data.val_batch_size"),
        # not finite: inf passes ">= 0" (rl.kl_coef=inf skipped every update, rc 0)
        ("rl.kl_coef=inf", "rl.kl_coef"),
        ("rl.clip_high=inf", "rl.clip_high"),
        ("rl.max_grad_norm=inf", "rl.max_grad_norm"),
        ("optim.lr=inf", "optim.lr"),
        ("optim.lr=nan", "optim.lr"),
        ("optim.betas=[0.9,nan]", "optim.betas"),
        # a run without a step limit never ended, without a word
        ("trainer.max_steps=-1", "trainer.max_steps"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        # numpy's or int()'s messages named no key
        ("seed=-1", "seed"),
        ("seed=99999999999", "seed"),
        ("seed=abc", "seed"),
        ("seed=1.5", "seed"),
    ],
)
def test_out_of_range_values_fail_before_the_model_loads(train_cfg, no_model_load, override, key):
    cfg = train_cfg(override)
    value = override.split("=", 1)[1]
    with pytest.raises(ConfigError) as err:
        train(cfg)
    msg = str(err.value)
    assert msg.startswith(f"{key}=") and "not allowed" in msg
    assert value.strip("[]").split(",")[0] in msg


@pytest.mark.parametrize(
    "override", ["rl.group_size=abc", "optim.lr=abc", "rl.ppo_epochs=1.5", "replay.jsd_chunk=x"]
)
def test_values_of_the_wrong_type_fail_while_composing_naming_the_key(train_cfg, override):
    with pytest.raises(ConfigCompositionException) as err:
        train_cfg(override)
    key = override.split("=")[0]
    assert key in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.sampling.max_new_tokens=0", "rollout.sampling.max_new_tokens"),
        ("rollout.sampling.temperature=-1", "rollout.sampling.temperature"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p"),
        ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p"),
        ("method.beta=2", "method.beta"),
        ("rollout.sampling.temperature=inf", "rollout.sampling.temperature"),
        ("method.eps=inf", "method.eps"),
        ("method.reward_weights={count:nan}", "method.reward_weights.count=nan"),
        ("method.reward_weights={count:-inf}", "method.reward_weights.count=-inf"),
    ],
)
def test_sampling_and_method_values_are_checked_before_the_model_loads(
    train_cfg, no_model_load, override, key
):
    with pytest.raises(Exception) as err:
        train(train_cfg(override))
    assert key in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize("val_prompts", [4, 0])
@pytest.mark.parametrize("every", ["0", "-2", "0.5"])
def test_a_validation_interval_that_is_no_step_count_is_refused(
    train_cfg, no_model_load, val_prompts, every
):
    """``0`` used to fail with a ZeroDivisionError after the first step (validation on or off)."""
    with pytest.raises(ConfigError) as err:
        train(train_cfg(f"trainer.val_check_interval={every}", f"data.val_prompts={val_prompts}"))
    msg = str(err.value)
    assert msg.startswith(f"trainer.val_check_interval={every} is not allowed: an integer >= 1")
    assert "data.val_prompts=0" in msg


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_number_of_every_typed_section_must_be_finite(value):
    """A float key added later without a range check is still refused when NaN or infinite."""
    import dataclasses
    import typing

    from mrtpo.run.settings import SCHEMAS

    checked = 0
    for name, schema in SCHEMAS.items():
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            if "float" not in str(hints[f.name]).lower():
                continue
            bad = [0.9, value] if "List" in str(hints[f.name]) else value
            with pytest.raises(ConfigError, match=rf"^{name}\.{f.name}=.* a finite value"):
                schema(**{f.name: bad})
            checked += 1
    assert checked >= 14  # rl 5, optim 3, stage.sft 6


def test_settings_that_lived_only_in_code_can_be_set_plainly(train_cfg):
    cfg = train_cfg(
        "rl.replay_oom_retries=8", "optim.betas=[0.9,0.95]", "rl.shared_prompt_forward=false"
    )
    _, module, _ = build(cfg)
    assert module.rl.replay_oom_retries == 8
    assert tuple(module.optim_cfg.betas) == (0.9, 0.95)
    # one switch for every shared-prompt forward: replay's and the HF engine's too
    assert module.replayer.shared_prompt == "off" and module.rl.shared_prompt_forward == "off"
    opt = module.configure_optimizers()["optimizer"]
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_stage_is_instantiated_not_named(train_cfg):
    from mrtpo.lightning.stages import RLStage, SFTStage

    stage, _ = prepare(train_cfg())
    assert isinstance(stage, RLStage)
    stage, _ = prepare(train_cfg("stage=sft", "stage.sft.lr=0.01"))
    assert isinstance(stage, SFTStage) and stage.sft.lr == 0.01
    with pytest.raises(ConfigError, match=r"stage\.sft\.stop_when="):
        prepare(train_cfg("stage=sft", "stage.sft.stop_when=sideways"))


def test_cli_refuses_a_bad_value_in_seconds_naming_it(tmp_path):
    """``rl.ppo_epochs=0`` used to hang (the step counter never advanced)."""
    out = subprocess.run(
        [sys.executable, "src/train.py", "rl.ppo_epochs=0", f"paths.log_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "rl.ppo_epochs=0 is not allowed: >= 1" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr  # the message, not a stack


def test_cli_refuses_a_run_without_a_step_limit_naming_it(tmp_path):
    """``trainer.max_steps=-1`` used to train forever without a word."""
    out = subprocess.run(
        [sys.executable, "src/train.py", "trainer.max_steps=-1", f"paths.log_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "trainer.max_steps=-1 is not allowed: a positive step count" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method=opsd", "frozen teacher"),
        ("model.lora.r=4", r"model\.lora\.r > 0 with trainer=fsdp"),
    ],
)
def test_fsdp_refuses_what_it_cannot_shard_yet_before_the_model_loads(
    train_cfg, no_model_load, override, message
):
    cfg = train_cfg("trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", override)
    with pytest.raises(ValueError, match=message):
        prepare(cfg)


@pytest.mark.parametrize("key", ["replay.share_prefix", "rollout.engine.share_prompt"])
def test_a_replaced_prefix_sharing_key_names_the_one_to_use(train_cfg, key):
    from mrtpo.run.config_keys import check_overrides
    from mrtpo.run.settings import ConfigError

    for arg in (f"{key}=false", f"+{key}=false"):  # refused before Hydra composes anything
        with pytest.raises(ConfigError, match=rf"{key} was replaced by rl\.shared_prompt_forward"):
            check_overrides([arg])
    if key.startswith("rollout."):  # a config setting it, not by interpolation: refused too
        with pytest.raises(ConfigError, match=r"was replaced by rl\.shared_prompt_forward"):
            build(train_cfg(f"{key}=false"))


def test_the_hf_engine_takes_the_one_prefix_sharing_switch(train_cfg):
    trainer, _, _ = build(train_cfg("rl.shared_prompt_forward=always"))
    [engine] = [c.engine for c in trainer.callbacks if hasattr(c, "source")]
    assert engine.share_prompt == "always"
