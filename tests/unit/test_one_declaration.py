"""Each setting and each rollout engine is declared in one place (issue 48 item 2).

A new ``rl`` setting with its facts on its field (range, resume policy, old name, the words
people type for it) reaches the range check, the command-line checks, the resume rule and
the key hints without any list being edited. A new engine, configured by ``_target_`` with
its settings taken by interpolation, passes every check and is built with those settings
without a line in settings, config_keys, the run folder or the stages; the engine-vs-schedule
rule refuses it in the same words on the config and on the bound engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf, open_dict

from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig
from mrtpo.run import settings
from mrtpo.run.settings import ConfigError, RLConfig, setting


@dataclass
class ToyRL(RLConfig):
    """``rl`` with one setting more, declared once, on its field."""

    toy_knob: int = setting(
        3, check=lambda v: v >= 1, allowed=">= 1", resume=True, old=("rl.old_knob",),
        old_note="the knob's new name", words=("knob",),
    )  # fmt: skip


@pytest.fixture
def toy_rl(monkeypatch):
    monkeypatch.setitem(settings.SCHEMAS, "rl", ToyRL)
    return ToyRL


def test_a_new_setting_is_declared_once_and_every_list_reads_it(toy_rl):
    from mrtpo.run.config_keys import check_overrides, nearest
    from mrtpo.run.resume import may_change

    assert settings.renamed()["rl.old_knob"] == "rl.toy_knob"
    assert "rl.toy_knob" in settings.resumable() and may_change("rl.toy_knob")
    assert nearest("knob", []) == "rl.toy_knob"
    check_overrides(["rl.toy_knob=5"])  # a key of the section now
    with pytest.raises(ConfigError, match=r"^rl\.old_knob was replaced by rl\.toy_knob \(the"):
        check_overrides(["+rl.old_knob=5"])
    cfg = OmegaConf.create({"rl": {"toy_knob": 0}})
    with pytest.raises(ConfigError, match=r"^rl\.toy_knob=0 is not allowed: >= 1$"):
        settings.section(cfg, "rl")
    assert settings.section(OmegaConf.create({"rl": {}}), "rl").toy_knob == 3


def test_without_the_new_setting_none_of_the_lists_name_it():
    from mrtpo.run.resume import may_change

    assert "rl.old_knob" not in settings.renamed() and not may_change("rl.toy_knob")


class ToyEngine(RolloutEngine):
    """An engine of its own: each response is its prompt's last ``width`` tokens."""

    generates_apart = True  # it holds no trainer weights
    reports_logprobs = False
    checks_settings_when_built = True  # the run's checks build one early to run its own

    def __init__(self, share_prompt: str, width: int, salt: int = 0) -> None:
        if width < 1:
            raise ValueError(f"rollout.engine.width={width}: use 1 or more")
        self.share_prompt, self.width, self.salt = share_prompt, width, salt

    def generate(self, prompts, n: int, sampling: SamplingConfig, seed: int) -> list[Generation]:
        return [Generation(p[-self.width :], False) for p in prompts for _ in range(n)]

    def sync_weights(self, model) -> None:
        pass


class SyncOnlyToy(ToyEngine):
    generates_apart = False


#: The engine's config, as configs/rollout/toy.yaml would hold it: its settings come from
#: the run's by interpolation, so no code passes them.
TOY_YAML = """
_target_: tests.unit.test_one_declaration.ToyEngine
share_prompt: ${rl.shared_prompt_forward}
width: ${rl.group_size}
salt: ${seed}
"""


def _with_engine(cfg, target: str = "ToyEngine"):
    node = OmegaConf.create(TOY_YAML.replace("ToyEngine", target))
    with open_dict(cfg):
        cfg.rollout.engine = node
    return cfg


def test_an_engine_of_its_own_gets_its_settings_by_interpolation(train_cfg):
    from mrtpo.lightning.pipeline import build
    from mrtpo.run.checks import validate
    from mrtpo.run.config_keys import check_keys
    from mrtpo.run.resume import may_change

    cfg = _with_engine(train_cfg("rl.shared_prompt_forward=always", "seed=7"))
    check_keys(cfg)
    validate(cfg)
    assert may_change("rollout.engine.width")
    trainer, _, _ = build(cfg)
    [engine] = [c.source.engine for c in trainer.callbacks if hasattr(c, "source")]
    assert type(engine).__name__ == "ToyEngine"  # (built from its _target_: this module again)
    assert (engine.share_prompt, engine.width, engine.salt) == ("always", 2, 7)
    with open_dict(cfg):
        cfg.rollout.engine.width = 0  # its own check, run before anything loads
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.width=0: use 1 or more$"):
        validate(cfg)
    with open_dict(cfg):
        cfg.rollout.engine.widht = 3  # its signature says what it reads: no list to edit
    with pytest.raises(
        ConfigError, match=r"rollout\.engine\.widht.*did you mean rollout\.engine\.width"
    ):
        check_keys(cfg)


def test_the_engine_and_schedule_rule_is_one_rule(train_cfg):
    from mrtpo.rollout.source import RolloutSource
    from mrtpo.run.checks import validate

    sampling = SamplingConfig()
    said = []
    for target in ("SyncOnlyToy", "ToyEngine"):
        cfg = _with_engine(train_cfg("rollout.schedule=one_step_off"), target)
        engine = SyncOnlyToy("auto", 2) if target == "SyncOnlyToy" else ToyEngine("auto", 2)
        source = RolloutSource(engine, sampling, 2, sampling, "one_step_off")
        with pytest.raises((ConfigError, ValueError)) as on_config:
            validate(cfg)
        with pytest.raises(ValueError) as on_engine:
            source.bind(None, None, [0])
        said.append((str(on_config.value), str(on_engine.value)))
    (sync_cfg, sync_bound), (log_cfg, log_bound) = said
    assert sync_cfg == sync_bound and "SyncOnlyToy samples from the trainer's own" in sync_cfg
    assert log_cfg == log_bound and "which ToyEngine does not report" in log_cfg
